"""Compiling ahead of a job: :func:`compile_loader` (``Loader.compile()``) and the library's prebuilt kernels.

* :func:`compile_loader` compiles everything a loader's epochs run, the first
  batch's code and the producer loop, into the disk caches, so that a job
  started later (a container built with its caches) waits for no compiler:
  ``loader.compile()``, or ``stoker warmup DATASET`` for the default pipelines
  (``--pipelines module:name`` for your own).
* :func:`build_library` compiles stoker's own kernels for the generic CPU of
  this architecture and saves them among the package's files
  (:mod:`stoker.pipeline.prebuilt`): ``stoker warmup --library`` (``make
  prebuilt``), run once when a wheel is built. It runs :func:`library_workload`
  in a fresh process with ``NUMBA_CPU_NAME=generic``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from stoker.loader._view import LoaderView


def compile_loader(loader: LoaderView) -> float:
    """Compile what ``loader``'s epochs run and wait until it is cached; the seconds it took.

    Makes the first batch of the next epoch (read, decoded and dropped) and waits for
    the producer loop's compilation if that runs in the background; the library's
    kernels it needs are compiled for this CPU, not loaded from the prebuilt files
    (unless this process loaded them already); the loader's
    position (the next epoch, batches to skip) is left as it was, so that the job's
    first epoch is the one it would have been.
    """
    from stoker.pipeline import prebuilt

    t0 = time.perf_counter()
    saved = (loader._next_epoch, loader._skip_batches, loader._position, loader._seen)
    with prebuilt.suspended():  # (compiling ahead is for this machine's CPU: the library's kernels too)
        it = iter(loader)
        try:
            next(it)
            plan = loader._plan
            if plan is not None and plan.background is not None:
                plan.background.wait()
                if plan.background.error is not None:
                    raise plan.background.error
        except StopIteration:  # no batch in the epoch: nothing to compile for
            pass
        finally:
            it.close()  # type: ignore[attr-defined]
            loader._next_epoch, loader._skip_batches, loader._position, loader._seen = saved
    return time.perf_counter() - t0


# ---- the library's kernels, prebuilt -----------------------------------------------------------


def _image(i: int, h: int, w: int) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w]
    base = (np.sin(xx * (0.05 + 0.01 * (i % 5))) * 60 + np.cos(yy * 0.07) * 60 + 128).astype(np.uint8)
    return np.stack([base, base[::-1], np.roll(base, i, axis=1)], axis=-1)


def _write_datasets(folder: Path) -> dict[str, Path]:
    """Small datasets of every field type and image storage the built-in operations decode."""
    from stoker.fields import BytesField, FloatField, IntField, JSONField, NDArrayField, RaggedArrayField, RGBImageField
    from stoker.writer import DatasetWriter

    n = 96
    rng = np.random.default_rng(0)
    table_fields: dict[str, Any] = {
        "f32": NDArrayField(shape=(93,), dtype=np.dtype("float32")),
        "f64": NDArrayField(shape=(4, 3), dtype=np.dtype("float64")),
        "i64": NDArrayField(shape=(7,), dtype=np.dtype("int64")),
        "i32": NDArrayField(shape=(5,), dtype=np.dtype("int32")),
        "u8": NDArrayField(shape=(16,), dtype=np.dtype("uint8")),
        "f16": NDArrayField(shape=(8,), dtype=np.dtype("float16")),
        "label": IntField(),
        "score": FloatField(),
        "blob": BytesField(),
        "meta": JSONField(),
        "ragged": RaggedArrayField(dtype=np.dtype("float32"), inner_shape=(2,)),
    }
    rows = [
        (
            rng.random(93, dtype=np.float32),
            rng.random((4, 3)),
            rng.integers(0, 9, 7),
            rng.integers(0, 9, 5).astype(np.int32),
            rng.integers(0, 255, 16).astype(np.uint8),
            rng.random(8).astype(np.float16),
            int(i % 9),
            float(i) / 3,
            bytes(range(i % 17)),
            {"i": i},
            rng.random((1 + i % 4, 2)).astype(np.float32),
        )
        for i in range(n)
    ]
    paths = {"table": folder / "table.stoker", "otto": folder / "otto.stoker"}
    DatasetWriter(paths["table"], table_fields, num_workers=1, progress=False).from_indexed_dataset(rows)
    # the shape of seed 000's Otto table: one array and one label (a metadata table of one column)
    otto = {"x": NDArrayField(shape=(93,), dtype=np.dtype("float32")), "y": IntField()}
    DatasetWriter(paths["otto"], otto, num_workers=1, progress=False).from_indexed_dataset([(r[0], r[6]) for r in rows])
    for name, mode, size in (("raw32", "raw", 32), ("jpg32", "jpg", 32), ("photos", "jpg", 0)):
        images = [(_image(i, size or 90 + i % 30, size or 120 - i % 25), i % 10) for i in range(n)]
        paths[name] = folder / f"{name}.stoker"
        fields = {"image": RGBImageField(write_mode=mode, jpeg_quality=90), "label": IntField()}
        DatasetWriter(paths[name], fields, num_workers=1, progress=False).from_indexed_dataset(images)
    return paths


def _pipelines(kind: str) -> list[dict[str, Any]]:
    """The built-in pipelines run over dataset ``kind``."""
    from stoker.decoders import (
        CenterCropRGBImageDecoder,
        IntDecoder,
        NDArrayDecoder,
        RandomResizedCropRGBImageDecoder,
        SimpleRGBImageDecoder,
    )
    from stoker.transforms import Cutout, NormalizeImage, RandomHorizontalFlip, RandomTranslate, Squeeze, ToDevice, ToTensor, ToTorchImage

    mean, std = np.array([0.485, 0.456, 0.406]) * 255, np.array([0.229, 0.224, 0.225]) * 255
    labels = [IntDecoder(), ToTensor(), ToDevice("cpu"), Squeeze()]
    if kind == "table":  # each field's default pipeline (f16's is Python: without it, the compiled loop runs)
        return [{}, {"f16": None}]
    if kind == "otto":
        return [{}, {"x": [NDArrayDecoder(), ToTensor(), ToDevice("cpu")], "y": labels}]
    if kind in ("raw32", "jpg32"):
        simple = SimpleRGBImageDecoder
        return [
            {"image": [simple(), ToTensor(), ToTorchImage()], "label": labels},
            {"image": [simple(), ToTensor(), ToTorchImage(channels_last=False)], "label": [IntDecoder(), ToTensor()]},
            {"image": [simple(), RandomHorizontalFlip(), NormalizeImage(mean, std, np.float32), ToTensor()], "label": labels},
            {"image": [simple(), RandomHorizontalFlip(), RandomTranslate(padding=2), Cutout(8), ToTensor()], "label": labels},
            {"image": [simple(), NormalizeImage(mean, std, np.float16), ToTensor()], "label": labels},
        ]
    rrc, centre = RandomResizedCropRGBImageDecoder, CenterCropRGBImageDecoder
    return [
        {"image": [rrc((64, 64)), RandomHorizontalFlip(), ToTensor(), ToTorchImage()], "label": labels},
        {"image": [rrc((48, 48)), RandomHorizontalFlip(), ToTensor(), ToTorchImage(channels_last=False)], "label": labels},
        {"image": [centre((40, 40)), ToTensor(), ToTorchImage()], "label": labels},
        {"image": [rrc((32, 32)), NormalizeImage(mean, std, np.float32), ToTensor()], "label": labels},
    ]


def library_workload(folder: Path, log: Callable[[str], None] = print) -> None:
    """Run the built-in pipelines over small datasets in ``folder``: every way a loader calls the library's kernels.

    Each pipeline runs as a new environment's first epoch does (step by step, the
    kernels called from Python, the producer loop compiled in the background), with
    Python producers (the fused code, parallel kernels) and with the compiled producer
    loop on one thread (serial twins), in the three orders.
    """
    from stoker.loader import Loader, OrderOption

    paths = _write_datasets(folder)
    modes = (("1", "1", 2, OrderOption.RANDOM), ("0", "0", 2, OrderOption.QUASI_RANDOM), ("1", "0", 1, OrderOption.SEQUENTIAL))
    saved = {k: os.environ.get(k) for k in ("STOKER_COMPILED_EPOCH", "STOKER_COMPILE_IN_BACKGROUND")}
    try:
        for kind, path in paths.items():
            for pipelines in _pipelines(kind):
                for compiled, background, workers, order in modes:
                    os.environ["STOKER_COMPILED_EPOCH"], os.environ["STOKER_COMPILE_IN_BACKGROUND"] = compiled, background
                    t0 = time.perf_counter()
                    loader = Loader(path, batch_size=16, num_workers=workers, order=order, seed=0, pipelines=pipelines or None)
                    for _ in loader:
                        pass
                    plan = loader._plan
                    if plan is not None and plan.background is not None:
                        plan.background.wait()
                    loader.close()
                    log(f"{kind} {sorted(pipelines)} compiled={compiled} workers={workers} {order.name}: {time.perf_counter() - t0:.1f} s")
        _io_workload(paths["photos"])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _io_workload(path: Path) -> None:
    """stoker.io's kernels (flows): decode, resize, stack and normalise a few of the dataset's JPEGs."""
    import stoker.io
    from stoker.format import Reader

    with Reader(path) as reader:
        ptrs, sizes = reader.metadata["image/ptr"], reader.metadata["image/size"]
        blobs = [bytes(reader.storage[int(p) : int(p) + int(s)]) for p, s in zip(ptrs[:4], sizes[:4], strict=True)]
    frames = [stoker.io.decode_image(b, size=(48, 40)) for b in blobs]
    stoker.io.decode_images(blobs, size=(32, 32))
    stoker.io.resize(frames[0], (20, 24))
    batch = stoker.io.convert_frames(frames)
    for channels_first in (True, False):
        stoker.io.normalize(batch, (0.5, 0.5, 0.5), (0.2, 0.2, 0.2), channels_first=channels_first)
        stoker.io.normalize(np.ascontiguousarray(batch), (0.5, 0.5, 0.5), (0.2, 0.2, 0.2), channels_first=channels_first)


def _build_here(out: Path) -> None:
    """The build process's side: the workload, then every kernel of stoker it compiled, saved (see :func:`build_library`)."""
    from stoker.pipeline import prebuilt

    prebuilt.PREBUILT_DIR = out
    with tempfile.TemporaryDirectory(prefix="stoker-prebuilt-") as tmp:
        library_workload(Path(tmp), log=lambda line: print(line, file=sys.stderr, flush=True))
    saved = prebuilt.save_all()
    print(json.dumps(saved))


def _build_fast_here(out: Path) -> None:
    """A fast build's process: :data:`~stoker.pipeline.prebuilt.FAST_MODULES` compiled for a level of
    :data:`~stoker.pipeline.prebuilt.FAST_CPUS` (``NUMBA_CPU_NAME``), with the generic build's signatures, saved beside them."""
    from stoker.pipeline import prebuilt

    prebuilt.PREBUILT_DIR = out
    prebuilt.compile_fast_entries()
    print(json.dumps(prebuilt.save_all()))


def build_library(out: Path | None = None, timeout_s: float = 3600.0) -> list[str]:
    """Compile stoker's kernels for the generic CPU and save them in ``out`` (default: the package's prebuilt folder).

    Runs :func:`library_workload` in a new process with ``NUMBA_CPU_NAME=generic`` and
    empty compile caches of its own, then (x86-64) compiles the kernels of
    :data:`~stoker.pipeline.prebuilt.FAST_MODULES` again for each CPU level of
    :data:`~stoker.pipeline.prebuilt.FAST_CPUS` (AVX-512, AVX2), one process each;
    what was in ``out`` is replaced.

    Returns:
        The kernels saved, one entry per signature.

    Raises:
        RuntimeError: the build process failed.
    """
    import shutil

    from stoker.pipeline import prebuilt

    final = Path(out) if out is not None else prebuilt.PREBUILT_DIR
    # built beside, then put in place by two renames: a process loading kernels meanwhile never reads a half-written
    # folder (a test run beside `make prebuilt` crashed in llvmlite on one)
    out = final.with_name(f"{final.name}.building-{os.getpid()}")
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="stoker-build-cache-") as caches:
        env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(Path(caches) / "numba"))
        # (every kernel compiled in this process: one a compile child made is loaded from the cache, and a library
        # loaded from a cache gives its object code to the JIT, leaving none to save)
        env.update(STOKER_CACHE_DIR=str(Path(caches) / "stoker"), STOKER_PREBUILT="0", STOKER_COMPILE_IN_BACKGROUND="0",
                   STOKER_COMPILE_CHILDREN="0")  # fmt: skip
        env.pop("NUMBA_CPU_FEATURES", None)
        code = f"from pathlib import Path; from stoker.loader.warmup import _build_here; _build_here(Path({str(out)!r}))"
        done = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, timeout=timeout_s, check=False, text=True)
    saved = list(json.loads(done.stdout.strip().splitlines()[-1])) if done.returncode == 0 else []
    for cpu, _ in prebuilt.FAST_CPUS:  # FAST_MODULES again, for each CPU level (see prebuilt)
        if done.returncode != 0:
            break
        with tempfile.TemporaryDirectory(prefix="stoker-build-cache-") as caches:
            env.update(NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES="", NUMBA_CACHE_DIR=str(Path(caches) / "numba"),
                       STOKER_CACHE_DIR=str(Path(caches) / "stoker"))  # fmt: skip
            code = f"from pathlib import Path; from stoker.loader.warmup import _build_fast_here; _build_fast_here(Path({str(out)!r}))"
            done = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, timeout=timeout_s, check=False, text=True)
        if done.returncode == 0:
            saved += json.loads(done.stdout.strip().splitlines()[-1])
    if done.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        raise RuntimeError(f"building the prebuilt kernels failed (exit code {done.returncode}); see the output above")
    old = final.with_name(f"{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    out.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return saved
