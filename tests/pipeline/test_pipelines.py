"""Decoders, transforms, fusion and the compiler switch."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest
import torch

from stoker.decoders import BytesDecoder, FloatDecoder, IntDecoder, NDArrayDecoder, RaggedArrayDecoder, SimpleRGBImageDecoder
from stoker.errors import PipelineError, StokerError
from stoker.fields import JSONField
from stoker.format import Reader
from stoker.loader import Loader, OrderOption
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation
from stoker.pipeline.random import uniform
from stoker.pipeline.state import State
from stoker.transforms import Convert, Squeeze, ToDevice, ToTensor, ToTorchImage, View

from .._profile import python_producers_unless_long
from ..loader.conftest import MixedDataset


class AddIndex(Operation):
    """x + index, into new memory (a compiled transform taking indices)."""

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        return previous_state, AllocationQuery(previous_state.shape, previous_state.dtype)

    def generate_code(self):  # type: ignore[no-untyped-def]
        parallel_range = Compiler.get_iterable()

        def add_index(batch, dst, indices):  # type: ignore[no-untyped-def]
            for i in parallel_range(batch.shape[0]):
                dst[i] = batch[i] + indices[i]
            return dst

        add_index.is_parallel = True
        return add_index


class RandomNegate(Operation):
    """Negates each sample with probability 1/2, drawn from the per-sample seeds (in place)."""

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        return previous_state, None

    def generate_code(self):  # type: ignore[no-untyped-def]
        parallel_range = Compiler.get_iterable()
        draw = uniform if Compiler.is_enabled() else uniform.py_func

        def random_negate(batch, dst, indices, seeds):  # type: ignore[no-untyped-def]
            for i in parallel_range(batch.shape[0]):
                if draw(seeds[i], 0) < 0.5:
                    batch[i] = -batch[i]
            return batch

        random_negate.is_parallel = True
        return random_negate


def only(**pipelines: object) -> dict:
    """Pipelines for the named fields; every other field of the mixed dataset skipped."""
    return {name: pipelines.get(name) for name in ("x", "y", "f", "b", "j", "r", "img")}


def _collect(loader: Loader) -> list[list[np.ndarray]]:
    return [[t.numpy().copy() if isinstance(t, torch.Tensor) else np.array(t) for t in batch] for batch in loader]


def test_default_pipelines_match_the_reader(mixed_path: Path) -> None:
    reader = Reader(mixed_path)
    loader = Loader(mixed_path, batch_size=50, order=OrderOption.RANDOM, seed=0)
    order = loader.epoch_indices(0)
    batches = _collect(loader)
    k = 0
    for x, y, f, b, j, r, img in batches:
        assert x.dtype == np.float32 and x.shape[1:] == (3, 4)
        assert y.shape[1:] == (1,) and y.dtype == np.int64 and f.dtype == np.float64
        for row in range(len(y)):
            want = reader.read(int(order[k]))
            np.testing.assert_array_equal(x[row], want[0])
            assert y[row, 0] == want[1] and f[row, 0] == want[2]
            assert bytes(b[row][: len(want[3])]) == bytes(want[3]) and not b[row][len(want[3]) :].any()
            assert JSONField.unpack(j[row : row + 1])[0] == want[4]
            np.testing.assert_array_equal(r[row][: len(want[5])], want[5])
            assert not r[row][len(want[5]) :].any()
            np.testing.assert_array_equal(img[row], want[6])
            k += 1
    assert k == len(reader)


PIPELINES = {
    "x": [NDArrayDecoder(), AddIndex(), RandomNegate(), ToTensor()],
    "y": [IntDecoder(), ToTensor(), Squeeze()],
    "f": [FloatDecoder(), ToTensor(), Convert(torch.float32)],
    "b": [BytesDecoder(), ToTensor()],
    "r": [RaggedArrayDecoder(max_length=3), ToTensor()],
    "img": [SimpleRGBImageDecoder(), ToTensor(), ToTorchImage()],
    "j": None,
}


def _run_as_python(run: Callable[[], Any], functions: list[Any]) -> tuple[Any, list[str]]:
    """What ``run()`` returns, and the names of those ``functions`` whose Python code ran meanwhile, on any thread.

    A line of Python ran, that is: a profiler also sees calls of compiled functions (Numba reports
    them under their Python code), a tracer sees no line of them.
    """
    codes = {id(f.__code__): f.__name__ for f in functions}
    ran: set[str] = set()

    def lines(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "line":
            ran.add(codes[id(frame.f_code)])
        return lines

    def calls(frame, event, arg):  # type: ignore[no-untyped-def]
        return lines if id(frame.f_code) in codes else None

    threading.settrace(calls)
    sys.settrace(calls)
    try:
        result = run()
    finally:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
    return result, sorted(ran)


@pytest.mark.parametrize("num_workers", [1, pytest.param(2, marks=pytest.mark.long)])  # (2: the parallel kernels, nightly)
def test_compiler_off_gives_identical_results(mixed_path: Path, num_workers: int) -> None:
    from stoker.decoders.arrays import _decode_bytes, _decode_rows, _decode_scalar
    from stoker.image._copy import copy, fill
    from stoker.pipeline.random import mix64

    on_loader = Loader(mixed_path, batch_size=40, order=OrderOption.RANDOM, seed=9, pipelines=PIPELINES, num_workers=num_workers)
    on = _collect(on_loader)
    with Compiler.disabled():
        off_loader = Loader(mixed_path, batch_size=40, order=OrderOption.RANDOM, seed=9, pipelines=PIPELINES, num_workers=num_workers)
    assert all(p.fused is None for p in off_loader.pipelines)
    assert not any(isinstance(s.code, numba.core.dispatcher.Dispatcher) for p in off_loader.pipelines for s in p.steps)
    kernels = [k.py_func for k in (_decode_rows, _decode_scalar, _decode_bytes, copy, fill, mix64)]
    off, off_ran = _run_as_python(lambda: _collect(off_loader), kernels)
    _, on_ran = _run_as_python(lambda: _collect(on_loader), kernels)  # an epoch later: compiled already
    # the decoders' kernels, and the compiled functions they and the transforms call, run as Python
    # (all but those that call Numba intrinsics: the image decoders' libjpeg-turbo calls)
    assert off_ran == sorted(k.__name__ for k in kernels), "with the compiler off, some kernels ran compiled"
    assert on_ran == [], "with the compiler on, some kernels ran as Python"
    also_off = _collect(Loader(mixed_path, batch_size=40, order=OrderOption.RANDOM, seed=9, pipelines=PIPELINES, compile=False))
    for a, b, c in zip(on, off, also_off, strict=True):
        for ta, tb, tc in zip(a, b, c, strict=True):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_array_equal(ta, tc)


def test_fused_transforms_compute_what_they_say(mixed_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python_producers_unless_long(monkeypatch)  # (the fused function's results; in the compiled loop: test_fusion.py)
    loader = Loader(mixed_path, batch_size=40, seed=4, pipelines=only(x=PIPELINES["x"], y=[IntDecoder(), ToTensor()]))
    assert loader.pipelines[0].fused is not None, "consecutive compiled operations should be fused"
    reader = Reader(mixed_path)
    signs = []
    for x, y in loader:
        for row in range(len(y)):
            i = int(y[row, 0])
            base = reader.read(i)[0] + i
            got = x[row].numpy()
            assert np.array_equal(got, base) or np.array_equal(got, -base)
            signs.append(np.array_equal(got, base))
    assert 0.3 < np.mean(signs) < 0.7, "RandomNegate should flip about half of the samples"
    epoch2 = [x.clone() for x, _ in loader]
    epoch1 = [x.clone() for (x,) in Loader(mixed_path, batch_size=40, seed=4, pipelines=only(x=PIPELINES["x"]))]
    assert any(not torch.equal(a, b) for a, b in zip(epoch1, epoch2)), "random draws should change with the epoch"


def test_torch_module_and_plain_callable_in_a_pipeline(table_path: Path) -> None:
    module = torch.nn.Linear(5, 2)
    loader = Loader(
        table_path, batch_size=100, pipelines={"x": [NDArrayDecoder(), module], "y": [IntDecoder(), ToTensor(), lambda t: t * 2]}
    )
    for x, y in loader:
        assert x.shape == (100, 2) and x.requires_grad
        assert (y % 2 == 0).all()
        break


def test_tensor_transforms(mixed_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python_producers_unless_long(monkeypatch)  # (the transforms' results, not the producer loop's)
    loader = Loader(mixed_path, batch_size=10, pipelines=only(
        img=[SimpleRGBImageDecoder(), ToTensor(), ToTorchImage(channels_last=False), ToDevice("cpu")],
        x=[NDArrayDecoder(), ToTensor(), View(torch.int32)],
        y=[IntDecoder(), ToTensor(), Squeeze()],
    ))  # fmt: skip
    x, y, img = next(iter(loader))  # the fields kept, in file order
    assert img.shape == (10, 3, 8, 6) and img.is_contiguous()
    assert x.dtype == torch.int32 and y.shape == (10,)


@pytest.mark.parametrize(
    ("pipelines", "message"),
    [
        ({"x": []}, "empty"),
        ({"x": [NDArrayDecoder(), ToTensor(), AddIndex()]}, "before ToTensor"),
        ({"y": [NDArrayDecoder(), ToTensor()]}, "decodes fields of type ndarray"),
        ({"x": [NDArrayDecoder(), 3]}, "Operations, torch modules or callables"),
    ],
)
def test_bad_pipelines_are_rejected_when_built(mixed_path: Path, pipelines: dict, message: str) -> None:
    with pytest.raises(PipelineError, match=message):
        Loader(mixed_path, batch_size=4, pipelines=pipelines)


def test_unknown_field_and_bad_arguments(mixed_path: Path) -> None:
    with pytest.raises(StokerError, match="does not have"):
        Loader(mixed_path, batch_size=4, pipelines={"nope": None})
    with pytest.raises(ValueError, match="batch_size"):
        Loader(mixed_path, batch_size=0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        Loader(mixed_path, batch_size=4, distributed=True, seed=0)
    with pytest.raises(IndexError, match="indices"):
        Loader(mixed_path, batch_size=4, indices=[0, 10_000])


def test_simple_image_decoder_names_a_sample_of_another_size(tmp_path: Path) -> None:
    from stoker.fields import RGBImageField
    from stoker.writer import DatasetWriter

    images = [np.zeros((4, 4, 3), np.uint8)] * 5 + [np.zeros((4, 5, 3), np.uint8)]
    path = tmp_path / "sizes.stoker"
    DatasetWriter(path, {"img": RGBImageField()}, progress=False).from_indexed_dataset(images)
    with pytest.raises(PipelineError, match="sample 5 is 4x5"):
        Loader(path, batch_size=2)


def test_state_dict_resumes_exactly(table_path: Path) -> None:
    def run(loader: Loader, epochs: int) -> list[np.ndarray]:
        return [y.numpy().ravel().copy() for _ in range(epochs) for _, y in loader]

    for order in OrderOption:
        reference = run(Loader(table_path, batch_size=64, order=order, seed=2), 2)
        loader = Loader(table_path, batch_size=64, order=order, seed=2)
        first = []
        for i, (_, y) in enumerate(loader):
            first.append(y.numpy().ravel().copy())
            if i == 6:
                state = loader.state_dict()  # inside the loop: after break, it is the next epoch's start
                break
        assert state["batches_consumed"] == 7 and state["epoch"] == 0
        resumed = Loader(table_path, batch_size=64, order=order)  # seed=None: takes the saved seed
        resumed.load_state_dict(state)
        rest = run(resumed, 2)
        got = first + rest
        assert len(got) == len(reference)
        for a, b in zip(got, reference, strict=True):
            np.testing.assert_array_equal(a, b)


def test_stats_report_where_time_goes(table_path: Path) -> None:
    loader = Loader(table_path, batch_size=100)
    for _ in loader:
        pass
    stats = loader.stats()
    assert set(stats) == {"x", "y", "loader", "accounting"}
    assert stats["accounting"]["batches"] == len(loader) - 1  # the first batch (warm-up) is reported apart
    assert any(k.startswith("compiled[NDArrayDecoder") for k in stats["x"]) and "ToTensor()" in stats["x"]
    assert stats["loader"]["consumer_waiting_for_producer"] >= 0


def test_fields_named_as_stats_sections_keep_their_times(tmp_path: Path) -> None:
    from stoker.fields import IntField
    from stoker.writer import DatasetWriter

    path = tmp_path / "named.stoker"
    DatasetWriter(path, {"accounting": IntField(), "loader": IntField(), "y": IntField()}, progress=False).from_indexed_dataset(
        [(i, 2 * i, 3 * i) for i in range(20)]
    )
    loader = Loader(path, batch_size=5)
    for _ in loader:
        pass
    stats = loader.stats()
    assert set(stats) == {"field:accounting", "field:loader", "y", "loader", "accounting"}
    for field in ("field:accounting", "field:loader", "y"):
        assert any(k.startswith("compiled[IntDecoder") for k in stats[field]), (field, stats[field])
    assert stats["accounting"]["batches"] == len(loader) - 1 and "consumer_waiting_for_producer" in stats["loader"]


def test_os_cache_false_gives_the_same_batches(table_path: Path) -> None:
    a = _collect(Loader(table_path, batch_size=10, order=OrderOption.QUASI_RANDOM, seed=1, os_cache=False, batches_ahead=1))
    b = _collect(Loader(table_path, batch_size=10, order=OrderOption.QUASI_RANDOM, seed=1))
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x, y, strict=True):
            np.testing.assert_array_equal(u, v)


def test_zero_length_ragged_and_empty_bytes(tmp_path: Path) -> None:
    from stoker.fields import BytesField, RaggedArrayField
    from stoker.writer import DatasetWriter

    path = tmp_path / "empty.stoker"
    data = [(b"", np.zeros((0, 4), np.float32))] * 3
    DatasetWriter(path, {"b": BytesField(), "r": RaggedArrayField(np.float32, (4,))}, progress=False).from_indexed_dataset(data)
    b, r = next(iter(Loader(path, batch_size=3)))
    assert b.shape == (3, 0) and r.shape == (3, 0, 4)


def test_dataset_class_is_importable_for_helpers() -> None:
    assert len(MixedDataset()) > 0


def test_ffcv_order_normalize_then_to_torch_image(mixed_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python_producers_unless_long(monkeypatch)  # (the operations' results, not the producer loop's)
    from stoker.transforms import NormalizeImage

    mean, std = np.array([10.0, 20.0, 30.0]), np.array([2.0, 4.0, 8.0])
    ffcv_order = [SimpleRGBImageDecoder(), NormalizeImage(mean, std, np.float32), ToTensor(), ToTorchImage()]
    (a,) = next(iter(Loader(mixed_path, batch_size=5, pipelines=only(img=ffcv_order))))
    (raw,) = next(iter(Loader(mixed_path, batch_size=5, pipelines=only(img=[SimpleRGBImageDecoder(), ToTensor()]))))
    expected = (raw.numpy().astype(np.float32) - mean.astype(np.float32)) / std.astype(np.float32)
    assert a.shape == (5, 3, 8, 6)
    np.testing.assert_allclose(a.numpy(), expected.transpose(0, 3, 1, 2), rtol=1e-6)
