"""Generated code calls the library's kernels by symbol: each kernel compiled (and cached) once, for every pipeline.

* a fused function's machine code declares the decoder kernel and calls it; it does not
  contain it (its LLVM code has no definition of it);
* two pipelines of different combinations share one compilation of the kernel;
* in a new process with the caches the first one left, a new combination of the same
  operations loads every kernel from the cache (hits, no misses) and compiles only its glue;
* an exception raised in a kernel called by symbol reaches the caller as a linked call's would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from stoker.decoders import IntDecoder, SimpleRGBImageDecoder
from stoker.fields import IntField, RGBImageField
from stoker.image import _kernels
from stoker.loader import Loader
from stoker.pipeline import linking
from stoker.transforms import Cutout, RandomHorizontalFlip, ToTensor
from stoker.writer import DatasetWriter


@pytest.fixture(scope="module")
def images_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("linking") / "images.stoker"
    rng = np.random.default_rng(0)
    samples = [(rng.integers(0, 256, (6, 5, 3), dtype=np.uint8), i) for i in range(17)]
    DatasetWriter(path, {"image": RGBImageField(), "label": IntField()}, num_workers=1, progress=False).from_indexed_dataset(samples)
    return path


@pytest.fixture(autouse=True)
def _python_producers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python producers call the fused function itself (one call per batch): compiled by the first batch."""
    monkeypatch.setenv("STOKER_COMPILED_EPOCH", "0")


def _fused_ir(loader: Loader) -> str:
    fused = loader.pipelines[0].fused
    assert fused is not None and fused.signatures, "the fused function should have been compiled by the first batch"
    return "".join(fused.inspect_llvm().values())


def test_a_fused_function_calls_the_decoder_by_symbol(images_path: Path) -> None:
    ops = [SimpleRGBImageDecoder(), RandomHorizontalFlip(), ToTensor()]
    os.environ["STOKER_FUSE"] = "0"  # the batch glue: one call of decode_images per batch
    try:
        loader = Loader(images_path, batch_size=4, num_workers=1, pipelines={"image": ops, "label": [IntDecoder(), ToTensor()]})
    finally:
        os.environ.pop("STOKER_FUSE")
    next(iter(loader))
    ir = _fused_ir(loader)
    loader.close()
    declared = [line for line in ir.splitlines() if line.startswith("declare") and "stoker_kernel_" in line]
    assert declared, "the fused function should declare the kernels it calls by symbol"
    defined = [line for line in ir.splitlines() if line.startswith("define") and "decode_images" in line]
    assert not defined, "the decoder's code should not be compiled into the fused function"


def test_two_combinations_share_one_compilation_of_a_kernel(images_path: Path) -> None:
    kernel = _kernels.decode_images
    before = dict(kernel.overloads)
    symbols_before = set(linking._SYMBOLS)
    outputs = []
    for ops in (
        [SimpleRGBImageDecoder(), RandomHorizontalFlip(), ToTensor()],
        [SimpleRGBImageDecoder(), Cutout(2), RandomHorizontalFlip(), ToTensor()],
    ):
        os.environ["STOKER_FUSE"] = "0"
        try:
            loader = Loader(images_path, batch_size=4, num_workers=1, pipelines={"image": ops, "label": [IntDecoder(), ToTensor()]})
        finally:
            os.environ.pop("STOKER_FUSE")
        outputs.append(next(iter(loader))[0].numpy().copy())
        loader.close()
    new = [sig for sig in kernel.overloads if sig not in before]
    assert len(new) <= 1, f"the decoder was compiled for {len(new)} signatures for the same data: {new}"
    decoder_symbols = {
        s for s in set(linking._SYMBOLS) - symbols_before if linking._SYMBOLS[s][0].fndesc.qualname.endswith("decode_images")
    }
    assert len(decoder_symbols) <= 1, decoder_symbols


CHILD = r"""
import json, sys
import numba
from stoker.decoders import IntDecoder, SimpleRGBImageDecoder
from stoker.loader import Loader
from stoker.transforms import Cutout, RandomHorizontalFlip, ToTensor
from stoker.image import _kernels
from stoker.transforms import flip, cutout
ops = {"a": [SimpleRGBImageDecoder(), RandomHorizontalFlip(), ToTensor()],
       "b": [SimpleRGBImageDecoder(), Cutout(2), RandomHorizontalFlip(), ToTensor()]}[sys.argv[2]]
loader = Loader(sys.argv[1], batch_size=4, num_workers=1, pipelines={"image": ops, "label": [IntDecoder(), ToTensor()]})
for _ in loader:
    pass
loader.close()
kernels = [_kernels.decode_images, _kernels._decode_one, flip.flip_one, flip._flip_kernel, cutout.cutout_one, cutout._cutout_kernel]
stats = {k.py_func.__name__: [sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values())] for k in kernels}
print(json.dumps(stats))
"""


@pytest.mark.long  # two child processes compiling from empty caches (TEST_SPLIT.md)
def test_a_new_combination_loads_every_kernel_from_the_cache(images_path: Path, tmp_path: Path) -> None:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), STOKER_CACHE_DIR=str(tmp_path / "stoker"), STOKER_PREBUILT="0")
    env.pop("STOKER_CACHE_KERNELS_DIR", None)  # (the suite's kernels folder, filled by earlier tests: the first child compiles)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2] / "src"), env.get("PYTHONPATH", "")])

    def run(combination: str) -> dict[str, list[int]]:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(images_path), combination], env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    first = run("a")  # compiles the decoder, the flip and their glue
    assert first["_decode_one"][1] >= 1 and first["flip_one"][1] >= 1, f"the first process should have compiled them: {first}"
    second = run("b")  # a new combination: cutout before the flip
    compiled_again = {
        name: hits_misses for name, hits_misses in second.items() if name not in ("cutout_one", "_cutout_kernel") and hits_misses[1]
    }
    assert not compiled_again, f"kernels compiled again for a new combination of cached operations: {compiled_again}"
    assert second["_decode_one"][0] >= 1 and second["flip_one"][0] >= 1, f"the kernels should load from the cache: {second}"


@numba.njit(nogil=True, cache=True)
def _may_raise(x: np.ndarray, k: int) -> np.ndarray:
    if k < 0:
        raise ValueError("k must be >= 0")
    x[0] = k
    return x


def test_an_exception_in_a_kernel_called_by_symbol_reaches_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_may_raise.py_func, "__module__", "stoker.tests_linking")  # (linkable: found by module and name)
    monkeypatch.setitem(sys.modules, "stoker.tests_linking", sys.modules[__name__])
    stand_in = linking.external(_may_raise)

    @numba.njit(nogil=True)
    def caller(x: np.ndarray, k: int) -> int:
        try:
            stand_in(x, k)
        except Exception:  # (Numba matches Exception only)
            return -1
        return int(x[0])

    @numba.njit(nogil=True)
    def raising(x: np.ndarray, k: int) -> np.ndarray:
        return stand_in(x, k)  # type: ignore[no-any-return]

    x = np.zeros(2, dtype=np.int64)
    assert caller(x, 5) == 5
    assert caller(x, -1) == -1
    with pytest.raises(ValueError, match="k must be >= 0"):
        raising(x, -2)
