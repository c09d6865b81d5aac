"""Every misuse a new user makes in the first hour fails when the Loader is built, naming the argument and the fix.

Each case is a line of code, run as written (``eval``) in a folder holding
small datasets; it must raise the expected exception before any batch is made
(nothing here iterates a loader), with a message that contains the expected
words. The same run writes the table of ``docs/misuse.md``: the test fails
when the committed file differs, so the table cannot go stale. Regenerate it
with ``STOKER_REGENERATE_DOCS=1 pytest tests/loader/test_misuse.py``.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stoker.decoders import IntDecoder, RaggedArrayDecoder, RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder
from stoker.errors import DatasetFormatError, DatasetNotFoundError, PipelineError, StokerError
from stoker.fields import BytesField, IntField, JSONField, NDArrayField, RaggedArrayField, RGBImageField
from stoker.loader import Loader, OrderOption
from stoker.transforms import Cutout, NormalizeImage, RandomHorizontalFlip, Squeeze, ToDevice, ToTensor, ToTorchImage
from stoker.writer import DatasetWriter

DOC = Path(__file__).resolve().parents[2] / "docs" / "misuse.md"
REGENERATE = "STOKER_REGENERATE_DOCS"

# the datasets the cases name, relative to the folder the cases run in
TABLE = "data/table.stoker"  # x: float32 (3,), y: int; 10 samples
IMAGES = "data/images.stoker"  # image: 16x16 RGB, label: int; 4 samples
TEXTS = "data/texts.stoker"  # meta: JSON, blob: bytes, tokens: ragged int32, index: int; 6 samples
NOT_STOKER = "data/notes.txt"
EMPTY_DIR = "data/empty"
SPLITS_DIR = "data/splits"  # train.stoker and val.stoker side by side, no manifest
MISSING = "data/missing.stoker"


@dataclass(frozen=True)
class Misuse:
    """One misuse: what the user meant, the code they wrote, and what they get."""

    what: str
    code: str
    error: type[BaseException]
    words: str  # a fragment the message must contain


CASES = [
    # ---- pipelines --------------------------------------------------------------------------------
    Misuse(
        "a pipeline without a decoder",
        'Loader(TABLE, batch_size=4, pipelines={"y": [ToTensor()]})',
        PipelineError,
        "which is not a decoder",
    ),
    Misuse(
        "a decoder class instead of an instance",
        'Loader(TABLE, batch_size=4, pipelines={"y": [IntDecoder, ToTensor()]})',
        PipelineError,
        "write IntDecoder()",
    ),
    Misuse(
        "`pipelines` given as a list",
        "Loader(TABLE, batch_size=4, pipelines=[IntDecoder(), ToTensor()])",
        TypeError,
        "pipelines must be a dict",
    ),
    Misuse(
        "a pipeline given as one operation, not a list",
        'Loader(TABLE, batch_size=4, pipelines={"y": IntDecoder()})',
        PipelineError,
        "must be a list of operations",
    ),
    Misuse("an unknown field name", 'Loader(IMAGES, batch_size=4, pipelines={"labels": None})', PipelineError, "did you mean 'label'"),
    Misuse("an empty pipeline", 'Loader(TABLE, batch_size=4, pipelines={"y": []})', PipelineError, "give a decoder, or None"),
    Misuse(
        "a lambda as the first operation",
        'Loader(TABLE, batch_size=4, pipelines={"y": [lambda b: b, IntDecoder()]})',
        PipelineError,
        "starts with <lambda>",
    ),
    Misuse(
        "a torch module class instead of an instance",
        'Loader(TABLE, batch_size=4, pipelines={"x": [NDArrayDecoder(), ToTensor(), torch.nn.Identity]})',
        PipelineError,
        "write Identity()",
    ),
    Misuse(
        "an operation given by name",
        'Loader(TABLE, batch_size=4, pipelines={"y": [IntDecoder(), "ToTensor"]})',
        PipelineError,
        "must be Operations, torch modules or callables",
    ),
    Misuse(
        "a transform before the decoder",
        'Loader(IMAGES, batch_size=4, pipelines={"image": [RandomHorizontalFlip(), SimpleRGBImageDecoder(), ToTensor()]})',
        PipelineError,
        "which is not a decoder",
    ),
    Misuse(
        "a decoder for the wrong field type",
        'Loader(IMAGES, batch_size=4, pipelines={"image": [IntDecoder(), ToTensor()]})',
        PipelineError,
        "decode it with SimpleRGBImageDecoder()",
    ),
    Misuse(
        "two decoders",
        'Loader(TABLE, batch_size=4, pipelines={"y": [IntDecoder(), IntDecoder(), ToTensor()]})',
        PipelineError,
        "second decoder",
    ),
    Misuse(
        "a numpy operation after ToTensor",
        'Loader(IMAGES, batch_size=4, pipelines={"image": [SimpleRGBImageDecoder(), ToTensor(), RandomHorizontalFlip()]})',
        PipelineError,
        "place it before ToTensor",
    ),
    Misuse(
        "a tensor operation before ToTensor",
        'Loader(TABLE, batch_size=4, pipelines={"y": [IntDecoder(), Squeeze(), ToTensor()]})',
        PipelineError,
        "place it after ToTensor",
    ),
    Misuse(
        "ToTorchImage before ToTensor",
        'Loader(IMAGES, batch_size=4, pipelines={"image": [SimpleRGBImageDecoder(), ToTorchImage(), ToTensor()]})',
        PipelineError,
        "place it after ToTensor",
    ),
    Misuse(
        "an image transform on a table",
        'Loader(TABLE, batch_size=4, pipelines={"x": [NDArrayDecoder(), RandomHorizontalFlip(), ToTensor()]})',
        PipelineError,
        "expects image samples",
    ),
    Misuse("ToDevice with a device that does not exist", 'ToDevice("gpu")', ValueError, "device must be 'cpu', 'cuda'"),
    Misuse(
        "NormalizeImage with one mean per channel but one std",
        "NormalizeImage(np.array([123.7, 116.3, 103.5]), np.array([58.4]), np.float32)",
        ValueError,
        "one value per channel",
    ),
    Misuse(
        "NormalizeImage with one value for three channels",
        'Loader(IMAGES, batch_size=4, pipelines={"image": [SimpleRGBImageDecoder(), NormalizeImage(np.array([0.5]), np.array([0.2]), np.float32), ToTensor()]})',
        PipelineError,
        "the images have 3",
    ),
    Misuse(
        "NormalizeImage to an integer type",
        "NormalizeImage(np.array([0.5] * 3), np.array([0.2] * 3), np.uint8)",
        ValueError,
        "numpy float dtype",
    ),
    Misuse("a crop decoder with a one-element size", "RandomResizedCropRGBImageDecoder((224,))", ValueError, "(height, width)"),
    Misuse(
        "a crop decoder with scale bounds reversed",
        "RandomResizedCropRGBImageDecoder((224, 224), scale=(1.0, 0.08))",
        ValueError,
        "0 < lo <= hi",
    ),
    Misuse("Cutout of size 0", "Cutout(0)", ValueError, "crop_size must be an integer >= 1"),
    Misuse(
        "RaggedArrayDecoder with a negative max_length", "RaggedArrayDecoder(max_length=-1)", ValueError, "max_length must be an int >= 0"
    ),
    # ---- arguments --------------------------------------------------------------------------------
    Misuse(
        "a seed that is a string",
        'Loader(TABLE, batch_size=4, seed="42")',
        TypeError,
        "seed must be an integer in [0, 2**64) or None; got str",
    ),
    Misuse("a seed that is a float", "Loader(TABLE, batch_size=4, seed=0.5)", TypeError, "seed must be an integer"),
    Misuse("order given as a string", 'Loader(TABLE, batch_size=4, order="random")', ValueError, "order=OrderOption.RANDOM"),
    Misuse("num_workers=0 (DataLoader's 'in this process')", "Loader(TABLE, batch_size=4, num_workers=0)", ValueError, "use 1"),
    Misuse("a negative num_workers other than -1", "Loader(TABLE, batch_size=4, num_workers=-2)", ValueError, "-1 (every CPU available)"),
    Misuse("batch_size 0", "Loader(TABLE, batch_size=0)", ValueError, "batch_size must be an int >= 1"),
    Misuse("a float batch_size", "Loader(TABLE, batch_size=32.0)", ValueError, "(use 32)"),
    Misuse("a bool batch_size", "Loader(TABLE, batch_size=True)", ValueError, "got bool True"),
    Misuse("drop_last as a string", 'Loader(TABLE, batch_size=4, drop_last="yes")', ValueError, "drop_last must be True or False"),
    Misuse("os_cache as a string", 'Loader(TABLE, batch_size=4, os_cache="false")', ValueError, "os_cache must be True or False"),
    Misuse("named as an int", "Loader(TABLE, batch_size=4, named=1)", ValueError, "named must be True or False"),
    Misuse("batches_ahead 0", "Loader(TABLE, batch_size=4, batches_ahead=0)", ValueError, "batches_ahead must be an int >= 1"),
    Misuse(
        "a float window_chunks",
        "Loader(TABLE, batch_size=4, order=OrderOption.QUASI_RANDOM, window_chunks=1.5)",
        ValueError,
        "window_chunks must be an int",
    ),
    # ---- indices --------------------------------------------------------------------------------
    Misuse("an index past the end", "Loader(TABLE, batch_size=4, indices=[0, 10])", IndexError, "indices must lie in [0, 10)"),
    Misuse("a negative index", "Loader(TABLE, batch_size=4, indices=[-1])", IndexError, "indices must lie in [0, 10)"),
    Misuse(
        "a boolean mask of the wrong length",
        "Loader(TABLE, batch_size=4, indices=np.ones(5, dtype=bool))",
        ValueError,
        "one entry per sample",
    ),
    Misuse("float indices", "Loader(TABLE, batch_size=4, indices=[0.0, 1.0])", TypeError, "integers or a boolean mask"),
    Misuse("two-dimensional indices", "Loader(TABLE, batch_size=4, indices=[[0, 1], [2, 3]])", ValueError, "one-dimensional"),
    # ---- distributed --------------------------------------------------------------------------------
    Misuse(
        "distributed=True without a process group",
        "Loader(TABLE, batch_size=4, seed=0, distributed=True)",
        RuntimeError,
        "init_process_group",
    ),
    Misuse(
        "rank >= world_size",
        "Loader(TABLE, batch_size=4, seed=0, distributed=True, rank=2, world_size=2)",
        ValueError,
        "rank must lie in [0, world_size)",
    ),
    Misuse(
        "rank without distributed=True", "Loader(TABLE, batch_size=4, seed=0, rank=1, world_size=2)", ValueError, "pass distributed=True"
    ),
    Misuse("several ranks without a seed", "Loader(TABLE, batch_size=4, distributed=True, rank=0, world_size=2)", ValueError, "pass seed="),
    # ---- files --------------------------------------------------------------------------------
    Misuse("a file that does not exist", "Loader(MISSING, batch_size=4)", DatasetNotFoundError, "No such file"),
    Misuse("a file that is not a stoker file", "Loader(NOT_STOKER, batch_size=4)", DatasetFormatError, "not a stoker dataset"),
    Misuse("a folder with no stoker files", "Loader(EMPTY_DIR, batch_size=4)", DatasetFormatError, "no *.stoker files"),
    Misuse(
        "a folder of stoker files without a manifest (two datasets side by side, or a write that did not finish)",
        "Loader(SPLITS_DIR, batch_size=4)",
        DatasetFormatError,
        "name the files you mean",
    ),
    Misuse("no path", "Loader(None, batch_size=4)", TypeError, "fname must name a stoker dataset"),
    Misuse("a list holding something that is not a path", "Loader([TABLE, 3], batch_size=4)", TypeError, "or a list of files"),
    Misuse(
        "custom_fields mapping to a type that is not a Field",
        'Loader(TABLE, batch_size=4, custom_fields={"y": int})',
        TypeError,
        "subclass of stoker.fields.Field",
    ),
    Misuse(
        "custom_fields mapping to a Field instance",
        'Loader(TABLE, batch_size=4, custom_fields={"y": IntField()})',
        TypeError,
        "write IntField, not IntField(...)",
    ),
    # ---- indices and lengths with the batch ---------------------------------------------------------
    Misuse(
        "return_lengths on a file without variable-size fields",
        "Loader(TABLE, batch_size=4, return_lengths=True)",
        ValueError,
        "Leave return_lengths out",
    ),
    Misuse(
        "return_lengths naming a fixed-size field",
        'Loader(TEXTS, batch_size=4, return_lengths=["index"])',
        ValueError,
        "whose samples all have one size",
    ),
    Misuse(
        "return_indices in dicts with a field named 'index'",
        "Loader(TEXTS, batch_size=4, named=True, return_indices=True)",
        ValueError,
        "two values the key 'index'",
    ),
    # ---- pickling --------------------------------------------------------------------------------
    Misuse(
        "pickling a Loader (to send it to a worker process)",
        "pickle.dumps(Loader(TABLE, batch_size=4))",
        TypeError,
        "build the Loader inside each worker process",
    ),
]


def write_data(root: Path) -> None:
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((10, 3)).astype(np.float32)
    DatasetWriter(
        data / "table.stoker", {"x": NDArrayField(shape=(3,), dtype=np.dtype("float32")), "y": IntField()}, num_workers=1, progress=False
    ).from_arrays({"x": x, "y": np.arange(10)})
    images = rng.integers(0, 256, (4, 16, 16, 3), dtype=np.uint8)
    DatasetWriter(
        data / "images.stoker", {"image": RGBImageField(), "label": IntField()}, num_workers=1, progress=False
    ).from_indexed_dataset([(images[i], i) for i in range(4)])
    texts = [({"i": i}, b"ab" * i, np.arange(i, dtype=np.int32), i) for i in range(6)]
    text_fields = {"meta": JSONField(), "blob": BytesField(), "tokens": RaggedArrayField(np.int32), "index": IntField()}
    DatasetWriter(data / "texts.stoker", text_fields, num_workers=1, progress=False).from_indexed_dataset(texts)
    (data / "notes.txt").write_bytes(b"not a dataset\n" * 100)
    (data / "empty").mkdir()
    (data / "splits").mkdir()
    for name in ("train.stoker", "val.stoker"):
        (data / "splits" / name).write_bytes((data / "table.stoker").read_bytes())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("misuse")
    write_data(root)
    return root


def namespace() -> dict[str, Any]:
    """What the cases' code may use: the names a user imports, and the paths of the datasets."""
    from stoker.decoders import NDArrayDecoder

    return {
        **dict(TABLE=TABLE, IMAGES=IMAGES, TEXTS=TEXTS, NOT_STOKER=NOT_STOKER, EMPTY_DIR=EMPTY_DIR, SPLITS_DIR=SPLITS_DIR, MISSING=MISSING),
        **dict(Loader=Loader, OrderOption=OrderOption, IntField=IntField, pickle=pickle, torch=torch, np=np),
        **dict(IntDecoder=IntDecoder, NDArrayDecoder=NDArrayDecoder, SimpleRGBImageDecoder=SimpleRGBImageDecoder),
        **dict(RandomResizedCropRGBImageDecoder=RandomResizedCropRGBImageDecoder, RaggedArrayDecoder=RaggedArrayDecoder),
        **dict(ToTensor=ToTensor, ToTorchImage=ToTorchImage, ToDevice=ToDevice, Squeeze=Squeeze, Cutout=Cutout),
        **dict(NormalizeImage=NormalizeImage, RandomHorizontalFlip=RandomHorizontalFlip),
    }


def attempt(case: Misuse, root: Path) -> BaseException | None:
    """Run the case's code in ``root``; the exception it raised, or ``None`` (nothing here iterates a loader)."""
    old = os.getcwd()
    os.chdir(root)
    try:
        eval(case.code, namespace())  # the cases above, written in this file
    except Exception as exc:
        return exc
    finally:
        os.chdir(old)
    return None


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 25
    assert len({c.code for c in CASES}) == len(CASES), "two cases run the same code"


@pytest.mark.parametrize("case", CASES, ids=[c.what for c in CASES])
def test_misuse_fails_when_built_naming_the_fix(case: Misuse, workdir: Path) -> None:
    exc = attempt(case, workdir)
    assert exc is not None, f"{case.code} was accepted; expected {case.error.__name__} containing {case.words!r}"
    assert type(exc) is case.error, f"{case.code} raised {type(exc).__name__}: {exc}; expected {case.error.__name__}"
    assert case.words in str(exc), f"{case.code}: the message lacks {case.words!r}: {exc}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: ToDevice('cuda') is not a misuse here")
def test_to_device_cuda_without_cuda_fails_when_built(workdir: Path) -> None:
    case = Misuse(
        "",
        'Loader(TABLE, batch_size=4, pipelines={"y": [IntDecoder(), ToTensor(), ToDevice("cuda")]})',
        StokerError,
        "CUDA is not available",
    )
    exc = attempt(case, workdir)
    assert isinstance(exc, StokerError) and "device = 'cuda' if torch.cuda.is_available() else 'cpu'" in str(exc), exc


def test_batch_size_larger_than_the_dataset_allocates_only_the_samples(workdir: Path) -> None:
    """``batch_size=10**12`` on 10 samples: one batch of 10, and memory for 10 samples per slot, not 10**12."""
    loader = Loader(workdir / TABLE, batch_size=10**12, num_workers=2)
    assert len(loader) == 1
    (x, y), *rest = list(loader)
    assert not rest and x.shape == (10, 3) and y.shape == (10, 1)
    np.testing.assert_array_equal(y.numpy()[:, 0], np.arange(10))
    for p in loader.pipelines:
        for slot in range(loader._num_slots):
            assert all(m is None or len(m) <= 10 for m in p.slot_memory(slot)), "memory for more samples than there are"
    assert len(Loader(workdir / TABLE, batch_size=10**12, drop_last=True)) == 0
    few = Loader(workdir / TABLE, batch_size=10**12, indices=[3, 4, 3])
    assert [b[1].numpy()[:, 0].tolist() for b in few] == [[3, 4, 3]]
    assert all(m is None or len(m) <= 3 for p in few.pipelines for m in p.slot_memory(0))


def test_empty_indices_give_an_empty_epoch(workdir: Path) -> None:
    loader = Loader(workdir / TABLE, batch_size=4, indices=[])
    assert len(loader) == 0 and list(loader) == []
    assert list(Loader(workdir / TABLE, batch_size=4, indices=np.zeros(10, dtype=bool))) == []


HEADER = """# Misuses and their messages

Every line of code below fails when it runs, before any batch is made,
with the message shown: it names the argument, the rule, the value found and
what to write instead. The paths are relative to a folder with three small
datasets (`data/table.stoker`: `x` float32 (3,), `y` int, 10 samples;
`data/images.stoker`: `image` RGB 16x16, `label` int, 4 samples;
`data/texts.stoker`: `meta` JSON, `blob` bytes, `tokens` ragged int32, `index` int).

This file is generated by `tests/loader/test_misuse.py`, which runs each line
and fails when this file differs from what it finds. To change it, change the
cases there and run `STOKER_REGENERATE_DOCS=1 pytest tests/loader/test_misuse.py`.

Also refused when the Loader is built (not listed because the answer depends on
the machine): `ToDevice("cuda")` on a machine without CUDA.

Allowed on purpose:

* **`batch_size` larger than the dataset** (or than `indices`): one batch of
  every sample, as with the DataLoader (none with `drop_last=True`). Memory is
  allocated for the samples a batch can hold, never for `batch_size` of them:
  `batch_size=10**12` on 10 samples allocates batches of 10.
* **Empty `indices`** (or an all-`False` mask, or a file of 0 samples, of any
  field type): an epoch of no batches, as an empty split gives with the DataLoader.
* **A callable before `ToTensor`**: it runs in Python on the numpy batch.
* **`Cutout` larger than the image**: it erases the whole image.

| misuse | code | exception | message |
|---|---|---|---|
"""


def cell(text: str) -> str:
    return text.replace("\n", " ").replace("|", "\\|")


def render(rows: list[tuple[Misuse, BaseException]]) -> str:
    lines = [HEADER.rstrip("\n")]
    for case, exc in rows:
        lines.append(f"| {cell(case.what)} | `{cell(case.code)}` | `{type(exc).__name__}` | {cell(str(exc))} |")
    return "\n".join(lines) + "\n"


def test_docs_misuse_table_is_current(workdir: Path) -> None:
    rows = []
    for case in CASES:
        exc = attempt(case, workdir)
        assert exc is not None, case.code
        rows.append((case, exc))
    text = render(rows)
    assert str(workdir) not in text, "a message shows the test's temporary folder"
    if os.environ.get(REGENERATE) == "1":
        DOC.write_text(text, encoding="utf-8")
        return
    assert DOC.exists(), f"{DOC} is missing: run {REGENERATE}=1 pytest {Path(__file__).name}"
    current = DOC.read_text(encoding="utf-8")
    assert current == text, f"{DOC} is stale (a message or a case changed): run {REGENERATE}=1 pytest tests/loader/test_misuse.py"
