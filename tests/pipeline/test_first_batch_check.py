"""The data check of a process whose check kernel is in no cache: no compiler before the first batch (issue 44).

:func:`stoker.format._verify.check_samples` took 7.7 s of a fresh install's first Otto batch (compiling it, under
load). Until it is compiled or cached, :meth:`DataCheck.check` runs :func:`check_samples_numpy` instead: it must give
the kernel's verdict exactly (the block it returns, the blocks it marks, the CRCs it counts), hence the same errors.

The reference model is the kernel's own source, run as Python (its callees ``_ensure`` and ``_crc`` swapped for their
Python forms and zlib's CRC): nothing here compiles.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoker.errors import DatasetFormatError
from stoker.fields import BytesField, IntField, NDArrayField
from stoker.format import DatasetWriter, Reader, _verify, spec

SRC = str(Path(_verify.__file__).parents[2])  # (the stoker this test imported: the child runs the same)


def _crc(data: np.ndarray, start: int, stop: int) -> np.uint32:
    return np.uint32(zlib.crc32(data[start:stop].tobytes()))


@pytest.fixture
def kernel_as_python(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The kernel's source run as Python (its compiled callees replaced by theirs)."""
    monkeypatch.setattr(_verify, "_ensure", _verify._ensure.py_func)
    monkeypatch.setattr(_verify, "_crc", _crc)
    return _verify.check_samples.py_func


@st.composite
def layouts(draw: st.DrawFn) -> dict[str, Any]:
    """A dataset's layout as the kernel sees it: shards with column fields and heap values, in blocks, some damaged."""
    n_shards = draw(st.integers(1, 3))
    col_sizes = draw(st.lists(st.sampled_from([0, 1, 4, 12, 40]), min_size=0, max_size=2))
    heap = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    storage = bytearray(rng.integers(0, 256, draw(st.integers(0, 24)), dtype=np.uint8).tobytes())  # bytes before shard 0
    shard_starts, block_base, data_start, data_end, block_size = [0], [0], [], [], []
    col_base: list[list[int]] = [[] for _ in col_sizes]
    heap_rows: list[tuple[int, int]] = []
    for shard in range(n_shards):
        n = draw(st.integers(1 if shard == 0 else 0, 12))
        bs = draw(st.sampled_from([8, 16, 64]))
        start = len(storage)
        region = bytearray()
        for c, size in enumerate(col_sizes):
            col_base[c].append(start + len(region))
            region += rng.integers(0, 256, n * size, dtype=np.uint8).tobytes()
        lengths = rng.integers(0, 50, n) * (rng.random(n) < 0.8) if heap else np.zeros(n, dtype=np.int64)
        for length in lengths.tolist():
            ptr = start + len(region)
            region += rng.integers(0, 256, length, dtype=np.uint8).tobytes()
            heap_rows.append((ptr, ptr + length - 1) if length else (-1, -1))
        region = region or bytearray(1)
        storage += region + bytes(int(rng.integers(0, 9)))  # (other bytes between shards)
        shard_starts.append(shard_starts[-1] + n)
        data_start.append(start)
        data_end.append(start + len(region))
        block_size.append(bs)
        block_base.append(block_base[-1] + (len(region) + bs - 1) // bs)
    crcs = []
    for k in range(n_shards):
        for b in range(block_base[k + 1] - block_base[k]):
            lo = data_start[k] + b * block_size[k]
            crcs.append(zlib.crc32(bytes(storage[lo : min(lo + block_size[k], data_end[k])])))
    crcs_arr = np.array(crcs, dtype=np.uint32)
    damaged = rng.random(len(crcs)) < draw(st.sampled_from([0.0, 0.1, 0.5]))
    crcs_arr[damaged] ^= np.uint32(0x5A5A5A5A)
    table = np.full((shard_starts[-1] if heap else 0, 2), -1, dtype=np.int32)
    for s, (lo, hi) in enumerate(heap_rows if heap else []):
        if lo >= 0:
            k = int(np.searchsorted(shard_starts, s, side="right") - 1)
            table[s] = [block_base[k] + (lo - data_start[k]) // block_size[k], block_base[k] + (hi - data_start[k]) // block_size[k]]
    total = shard_starts[-1]
    idx = np.array(draw(st.lists(st.integers(0, total - 1), min_size=0, max_size=30)), dtype=np.int64)
    by_position = draw(st.booleans())
    data = np.frombuffer(bytes(storage), dtype=np.uint8)
    verified = (rng.random(len(crcs)) < draw(st.sampled_from([0.0, 0.5]))).astype(np.uint8)
    return {
        "idx": idx,
        "by_position": by_position,
        "shard_starts": np.array(shard_starts, dtype=np.int64),
        "col_base": np.array(col_base, dtype=np.int64).reshape(len(col_sizes), n_shards),
        "col_size": np.array(col_sizes, dtype=np.int64),
        "heap_blocks": table[idx] if (by_position and heap) else table,
        "block_base": np.array(block_base, dtype=np.int64),
        "data_start": np.array(data_start, dtype=np.int64),
        "data_end": np.array(data_end, dtype=np.int64),
        "block_size": np.array(block_size, dtype=np.int64),
        "crcs": crcs_arr,
        "verified": verified,
        "counts": np.zeros(1, dtype=np.int64),
        "storage": data,
        "compute": draw(st.booleans()),
    }


def _run(fn: Any, layout: dict[str, Any]) -> tuple[int, list[int], int]:
    args = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in layout.items()}
    g = int(fn(*args.values()))
    return g, args["verified"].tolist(), int(args["counts"][0])


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])  # (the fixture holds no state)
@given(layouts())
def test_the_numpy_check_is_the_kernels_verdict(kernel_as_python: Any, layout: dict[str, Any]) -> None:
    """The same block returned (the first damaged or, without ``compute``, unchecked one), the same marks, the same count."""
    assert _run(_verify.check_samples_numpy, layout) == _run(kernel_as_python, layout)


def _dataset(path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    rng = np.random.default_rng(1)
    rows = [
        (rng.random(7, dtype=np.float32), i % 5, bytes(rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8))) for i in range(200)
    ]
    fields = {"x": NDArrayField(shape=(7,), dtype=np.dtype("float32")), "y": IntField(), "b": BytesField()}
    with monkeypatch.context() as m:
        m.setattr(spec, "DATA_BLOCK_SIZE", 512)  # (many blocks)
        DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset(rows)
    return path


def _damage(src: Path, dst: Path, block: int) -> Path:
    shutil.copy(src, dst)
    with Reader(dst) as r:
        at = r.data_offset + block * r.data_block_size + 3
    with open(dst, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    return dst


def _checked(path: Path, idx: np.ndarray, lazy: bool, bounded: bool) -> tuple[str, list[int], int]:
    _verify._MARKS.clear()  # (the marks are per process and dataset: each run starts from none)
    with Reader(path) as reader:
        if not lazy:
            reader.validate_metadata()
        check = _verify.DataCheck(reader, ["x", "b"])
        try:
            check.check(idx, lazy=lazy, bounded=bounded)
            said = ""
        except DatasetFormatError as err:
            said = str(err)
        return said, check.verified.tolist(), int(check.counts[0])


@pytest.mark.parametrize(("lazy", "bounded"), [(False, False), (True, False), (False, True)])
def test_a_check_before_the_kernel_is_compiled_compiles_nothing_and_says_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lazy: bool, bounded: bool
) -> None:
    """A kernel in no cache (a dispatcher of its own, cached nowhere) is not compiled by the check; the error (file,
    block, bytes, samples) and the marks are those of the kernel (its source run as Python, afterwards)."""
    good = _dataset(tmp_path / "good.stoker", monkeypatch)
    with Reader(good) as r:
        blocks = len(r._data_crcs)
    bad = _damage(good, tmp_path / "bad.stoker", blocks // 2)
    idx = np.random.default_rng(0).permutation(200)[:120].astype(np.int64)
    fresh = numba.njit(nogil=True)(_verify.check_samples.py_func)  # (no disk cache: "missing" whatever was compiled)
    outcomes = {}
    monkeypatch.setattr(_verify, "check_samples", fresh)
    outcomes["first batches"] = (_checked(good, idx, lazy, bounded), _checked(bad, idx, lazy, bounded))
    assert not fresh.overloads, "the check compiled its kernel before the first batch"
    monkeypatch.setattr(_verify, "_ensure", _verify._ensure.py_func)
    monkeypatch.setattr(_verify, "_crc", _crc)
    monkeypatch.setattr(_verify, "check_samples", fresh.py_func)
    monkeypatch.setattr(_verify, "_FORCE_KERNEL", True, raising=False)
    outcomes["kernel"] = (_checked(good, idx, lazy, bounded), _checked(bad, idx, lazy, bounded))
    assert outcomes["first batches"] == outcomes["kernel"]
    said = outcomes["kernel"][1][0]
    assert outcomes["kernel"][0][0] == "" and "checksum mismatch in data block" in said and "bad.stoker" in said, outcomes


def test_the_kernel_is_used_once_it_is_compiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the kernel is compiled in the process (here: by the test), the check calls it (asked at most every 0.5 s)."""
    good = _dataset(tmp_path / "good.stoker", monkeypatch)
    calls: list[str] = []
    real = _verify.check_samples_numpy

    def counted(*args: Any) -> int:
        calls.append("numpy")
        return real(*args)

    monkeypatch.setattr(_verify, "check_samples_numpy", counted)
    monkeypatch.setattr(_verify, "_PROBE_EVERY", 1e9)  # (asked once, then again only when the test says)
    monkeypatch.setattr(_verify, "kernel_state", lambda argtypes: "missing")
    _verify._MARKS.clear()
    with Reader(good) as reader:
        reader.validate_metadata()
        check = _verify.DataCheck(reader, ["x", "b"])
        check.check(np.arange(10))
        assert calls == ["numpy"]
        monkeypatch.setattr(_verify, "kernel_state", lambda argtypes: "ready")
        check.check(np.arange(10, 20))  # (not asked again yet: _PROBE_EVERY)
        assert calls == ["numpy", "numpy"]
        check._probed.clear()
        ready = set(check._ready)
        monkeypatch.setattr(_verify, "check_samples", lambda *a: -1)  # (the kernel, without compiling it here)
        check.check(np.arange(20, 30))
        assert calls == ["numpy", "numpy"] and check._ready != ready


CHILD = r"""
import hashlib, json, sys, threading
from numba.core import event
compiled = []


class Compiles(event.Listener):
    def on_start(self, ev):
        fn = ev.data["dispatcher"].py_func
        compiled.append(f"{fn.__module__}.{fn.__qualname__}")

    def on_end(self, ev):
        pass


event.register("numba:compile", Compiles())
from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.loader import Loader, OrderOption
from stoker.transforms import ToTensor

path, seed, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
loader = Loader(path, batch_size=64, num_workers=workers, order=OrderOption.RANDOM, seed=seed,
                pipelines={"x": [NDArrayDecoder(), ToTensor()], "y": [IntDecoder(), ToTensor()]})
digests, before_first = [], None
for epoch in range(2):
    for x, y in loader:
        if before_first is None:
            before_first = list(compiled)
        digests.append(hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:16])
plan = loader._plan
if plan is not None and plan.background is not None:
    plan.background.wait(600)  # (the cold run leaves the caches full: the warm run loads everything)
loader.close()
print(json.dumps({"digests": digests, "before_first": before_first}))
"""


@pytest.mark.long
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork")
def test_the_same_batches_from_a_cold_cache_and_a_warm_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same seed, same batches, whatever the caches held: a process with empty caches (its first batches checked by the
    numpy path, made by Python producers while the loop compiles in a child) and a second one with the caches the first
    left (the kernel, the compiled loop from its first batch). The cold one compiles no check kernel before its first
    batch."""
    rng = np.random.default_rng(3)
    rows = [(rng.random(93, dtype=np.float32), i % 9) for i in range(600)]
    path = tmp_path / "otto.stoker"
    DatasetWriter(
        path, {"x": NDArrayField(shape=(93,), dtype=np.dtype("float32")), "y": IntField()}, num_workers=1, progress=False
    ).from_indexed_dataset(rows)
    caches = tmp_path / "caches"
    env = dict(os.environ, STOKER_CACHE_DIR=str(caches / "stoker"), NUMBA_CACHE_DIR=str(caches / "numba"))
    env.update(STOKER_PREBUILT="0", STOKER_COMPILE_IN_BACKGROUND="1", PYTHONPATH=SRC)
    env.pop("STOKER_CACHE_KERNELS_DIR", None)  # (the session's shared kernels: this test's caches start empty)
    runs = {}
    for name, workers in (("cold", 1), ("warm", 1), ("warm, 2 threads", 2)):
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(path), "7", str(workers)], env=env, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(runs["cold"]["digests"]) == 2 * 10
    assert runs["cold"]["digests"] == runs["warm"]["digests"] == runs["warm, 2 threads"]["digests"]
    assert not [c for c in runs["cold"]["before_first"] if c.endswith("check_samples")], runs["cold"]["before_first"]
