"""Time to first batch of the stoker ``Loader`` in a fresh Python process.

Each run is a new ``python -c`` process that imports stoker, builds a
``Loader`` and takes one batch. The first run starts with an empty Numba
cache folder (``NUMBA_CACHE_DIR``), the second reuses what the first left
there: the difference is what the on-disk cache saves. A last run (after one
that compiles its kernels) has pipelines of decoders only: numpy batches, a
process that never imports torch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stoker import _cache_roots

_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from stoker.loader import Loader, OrderOption
t1 = time.perf_counter()
pipelines = None  # the defaults: each field's decoder, then ToTensor
if sys.argv[4] == "numpy":  # each field's decoder only: numpy batches
    from stoker.format import Reader
    with Reader(sys.argv[1]) as reader:
        pipelines = {name: [field.default_decoder()] for name, field in reader.fields.items()}
loader = Loader(sys.argv[1], batch_size=int(sys.argv[2]), num_workers=int(sys.argv[3]),
                order=OrderOption.RANDOM, seed=0, drop_last=True, pipelines=pipelines)
t2 = time.perf_counter()
x, y = next(iter(loader))
t3 = time.perf_counter()
first_batch_at = time.time()
shape = [list(x.shape), str(x.dtype), list(y.shape), str(y.dtype)]
reported = loader.stats()["accounting"].get("first_batch_s")  # report()'s figure: it must count from iter() too
close = getattr(loader, "close", None)
if callable(close):
    close()
print(json.dumps({"import_s": t1 - t0, "construct_s": t2 - t1, "first_batch_s": t3 - t2,
                  "construct_to_first_batch_s": t3 - t1, "first_batch_at": first_batch_at, "shape": shape,
                  "torch_imported": "torch" in sys.modules, "report_first_batch_s": reported}))
"""


class StartupError(RuntimeError):
    """The child process failed, hung, or printed no result."""


def time_to_first_batch(path: Path, batch_size: int, num_workers: int, cache_dir: Path, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run the child twice (cold, then warm Numba disk cache) and time it.

    Args:
        path: the stoker file.
        batch_size: rows per batch.
        num_workers: the loader's threads.
        cache_dir: the runs' compile caches (stoker's and Numba's); emptied before the cold run.
        timeout_s: per run [seconds].

    Returns:
        ``{"cold": run, "warm": run, "warm, numpy batches": run}`` (the
        last with pipelines of decoders only, which never import torch; its
        kernels compiled by a run before it), each run with ``import_s``,
        ``construct_s``, ``first_batch_s`` (from ``iter()`` to the first batch in hand, as a
        user waits for it), ``construct_to_first_batch_s`` (measured in the child),
        ``report_first_batch_s`` (what the loader's ``report()`` says of the same wait),
        ``start_to_first_batch_s`` (from before the
        process starts to its first batch, interpreter start and imports
        included: wall clock) and ``process_s`` (the whole process, its exit
        included, measured here) [seconds].

    Raises:
        StartupError: a run failed, timed out or printed no result.
    """
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True)
    # (stoker's kernels and pipelines cache in its own root, never in NUMBA_CACHE_DIR: both emptied)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir / "numba"), **{_cache_roots.ENV: str(cache_dir / "stoker")})
    env.pop(_cache_roots.KERNELS_ENV, None)  # (kernels shared elsewhere would make the cold run warm)
    out: dict[str, Any] = {}
    # the third run primes the cache for the numpy pipelines' kernels, the fourth is measured
    runs = (("cold", "tensors"), ("warm", "tensors"), ("numpy, cold", "numpy"), ("warm, numpy batches", "numpy"))
    for run, batches in runs:
        cmd = [sys.executable, "-c", _CHILD, str(path), str(batch_size), str(num_workers), batches]
        start, started_at = time.perf_counter(), time.time()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise StartupError(
                f"time-to-first-batch ({run}) did not finish in {timeout_s:.0f} s (a loader thread left running at exit?)"
            ) from exc
        process_s = time.perf_counter() - start
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            raise StartupError(f"time-to-first-batch ({run}) exited with {proc.returncode}:\n{proc.stderr[-2000:]}")
        try:
            result = json.loads(lines[-1])
        except json.JSONDecodeError as exc:
            raise StartupError(f"time-to-first-batch ({run}) printed no result: {lines[-1]!r}") from exc
        result["process_s"] = process_s
        # wall clock from before the process started to its first batch: what a user waits (the exit is not in it)
        result["start_to_first_batch_s"] = float(result.pop("first_batch_at")) - started_at
        out[run] = result
    del out["numpy, cold"]
    return out
