"""The JPEG decoder's kernels call each other by symbol: each compiled (and cached) once, on its own.

Linked in, a callee's LLVM code is optimised again inside every caller: the resize kernel
inside ``_decode_one``, ``_decode_one`` inside ``decode_sample`` and ``decode_images`` (its
parallel and serial builds), most of a cold start's compile (``docs/benchmarks.md``, "Cold
start"). Here the machine code of each caller, compiled or loaded from the cache, calls its
large callee through the callee's symbol (:mod:`stoker.pipeline.linking`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest

from stoker.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from stoker.fields import IntField, RGBImageField
from stoker.image import _kernels, _resize
from stoker.loader import Loader
from stoker.pipeline import linking
from stoker.pipeline.compiler import Compiler, serial_twin
from stoker.transforms import ToTensor
from stoker.writer import DatasetWriter


def _symbols_of(kernel: Any) -> set[str]:
    """The symbols that :mod:`~stoker.pipeline.linking` registered for ``kernel`` in this process."""
    fn = kernel.py_func
    return {
        name
        for name, (cres, _) in linking._SYMBOLS.items()
        if (cres.fndesc.modname, cres.fndesc.qualname) == (fn.__module__, fn.__qualname__)
    }


def _calls(kernel: Any) -> list[set[str]]:
    """Per compiled signature of ``kernel``: the kernel symbols its machine code calls.

    Compiled in this process: the names its object code holds. Loaded from the cache (Numba keeps no object
    code then): those that its library registers first (its ``reload_init``, which a cached caller keeps).
    """
    out = []
    for cres in kernel.overloads.values():
        try:
            _, _, data = cres.library.serialize_using_object_code()
        except RuntimeError:  # loaded from the cache
            out.append({init.symbol() for init in cres.library._reload_init if isinstance(init, linking._Relink)})
            continue
        out.append(linking.called_symbols(b"".join(data) if isinstance(data, tuple) else data))
    return out


@pytest.fixture(autouse=True)
def _batch_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_FUSE", "0")  # the batch glue: decode_images, one call per batch
    monkeypatch.setenv("STOKER_COMPILED_EPOCH", "0")  # Python producers: compiled by the first batch


def test_the_decoder_calls_decode_one_and_resize_by_symbol(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    samples = [(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8), i) for i in range(6)]
    path = tmp_path / "photos.stoker"
    DatasetWriter(path, {"image": RGBImageField(write_mode="jpg"), "label": IntField()}, progress=False).from_indexed_dataset(samples)
    pipelines = {"image": [RandomResizedCropRGBImageDecoder((8, 8))], "label": [IntDecoder(), ToTensor()]}
    for workers in (1, 2):  # (one worker: the serial twin of decode_images, where the loop runs on one thread)
        with Loader(str(path), batch_size=3, num_workers=workers, pipelines=pipelines) as loader:
            assert sum(len(b[1]) for b in loader) == 6
    decode_one, resize = _symbols_of(_kernels._decode_one), _symbols_of(_resize.resize)
    # (one symbol per signature: other tests in this process may have linked the kernels for other array types)
    assert decode_one, "_decode_one should have been linked by symbol"
    assert resize, "resize should have been linked by symbol"
    callers = [_kernels.decode_sample, _kernels.decode_images, serial_twin(_kernels.decode_images)]
    for caller in callers:
        name = caller.py_func.__qualname__
        calls = _calls(caller)
        assert calls or caller is not _kernels.decode_images, f"{name} should have been compiled or loaded by the first batch"
        for called in calls:
            assert decode_one & called, f"{name}'s machine code should call _decode_one by symbol, not contain it: {called}"
    calls = _calls(_kernels._decode_one)
    assert calls and all(resize & called for called in calls), f"_decode_one should call resize by symbol: {calls}"


def test_debug_mode_links_the_decoders_kernels_bounds_checked() -> None:
    """In debug mode every kernel the decoder calls is its bounds-checked copy, linked: none is called by symbol.

    (Nothing is compiled here: the checked copies are built, not run.)
    """
    with Compiler.debug():
        checked = Compiler.compile(_kernels.decode_images)
    sample = checked.py_func.__globals__["decode_sample"]
    decode_one = sample.py_func.__globals__["_decode_one"]
    resize = decode_one.py_func.__globals__["resize"]
    for kernel in (checked, sample, decode_one, resize):
        assert isinstance(kernel, numba.core.dispatcher.Dispatcher), f"{kernel!r} should be a compiled function, linked"
        assert kernel.targetoptions.get("boundscheck"), f"{kernel.py_func.__qualname__} should be bounds-checked in debug mode"
