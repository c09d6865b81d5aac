"""Cold start: ``Loader()`` to the first batch in a fresh process, with empty compile caches, and where the time goes.

Each measurement is a new Python process with its own, new, empty cache
folders: stoker's (``STOKER_CACHE_DIR``) and Numba's (``NUMBA_CACHE_DIR``; with
it set, Numba reads and writes no other cache folder, the ``__pycache__``
folders beside stoker's sources included, and the child checks that every
cache lookup of stoker's own kernels missed). Scenarios:

* ``otto``: seed 000's pipelines on the Otto table (``NDArrayDecoder(), ToTensor(),
  ToDevice("cpu")`` and ``IntDecoder(), ToTensor(), ToDevice("cpu"), Squeeze()``),
  batch 1024, one worker, as the seed's notebook;
* ``photo``: ``RandomResizedCropRGBImageDecoder(224), RandomHorizontalFlip(), ToTensor(),
  ToTorchImage()`` and FFCV's label pipeline on ~500x375 JPEGs, batch 64, two workers;
* ``newcombo``: a new combination of cached operations: two processes fill the caches
  with ``[RRC decoder, flip, ToTensor, ToTorchImage]`` and ``[RRC decoder,
  NormalizeImage, ToTensor]``; the process measured runs ``[RRC decoder, flip,
  NormalizeImage, ToTensor]``, whose every operation is compiled and cached,
  the combination not;
* ``otto-warm``, ``photo-warm``: the same pipelines again with the caches the cold
  run left (what every later job pays).

The breakdown, in the measured process (Numba's compile events; times are
wall-clock in the thread that compiles):

* ``import``: ``import torch`` and stoker's modules;
* ``Loader()``, ``iter()``, ``next()``: the three calls to the first batch;
  ``first batch``: their sum, the target;
* ``compile``: Numba compiling (outermost compilations only), of which
  ``LLVM`` (LLVM's optimisation and machine code, Numba's ``llvm_lock``) and the
  rest typing and lowering to LLVM IR (Numba's front end: "code generation");
* ``load``: loading compiled code from the caches;
* ``other``: the first batch's time outside compiling and loading (planning,
  reading, the batch itself);
* ``cpu``: the process's CPU time over the same window, every thread
  (``time.process_time``): robust to other load on the machine, unlike wall time.

Run: ``python benchmarks/cold_start.py [--runs 3] [--only otto,photo,newcombo,otto-warm,photo-warm] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# ---- the measured process -------------------------------------------------------------------------

_CHILD = r"""
import json, os, sys, threading, time
c_start = time.process_time()
import numba
from numba.core import caching
from numba.core import event as ev

stats = {"compile": 0.0, "llvm": 0.0, "load": 0.0, "hits": 0, "misses": 0, "stoker_hits": 0, "compiled": []}
_depth = {}


class _Outermost(ev.Listener):
    # the outermost event of a kind in each thread: nested compilations are inside their caller's time
    def __init__(self, key):
        self.key, self.starts = key, {}

    def on_start(self, event):
        k = (threading.get_ident(), self.key)
        _depth[k] = _depth.get(k, 0) + 1
        if _depth[k] == 1:
            self.starts[k] = time.perf_counter()

    def on_end(self, event):
        k = (threading.get_ident(), self.key)
        _depth[k] -= 1
        if _depth[k] == 0:
            t = time.perf_counter() - self.starts.pop(k)
            stats[self.key] += t
            if self.key == "compile":
                fn = event.data["dispatcher"].py_func
                stats["compiled"].append([f"{fn.__module__}.{fn.__qualname__}", round(t, 3)])


ev.register("numba:compile", _Outermost("compile"))
ev.register("numba:llvm_lock", _Outermost("llvm"))
_load = caching.Cache._load_overload  # (Numba's cache layer: stoker's prebuilt kernels are looked up after it)


def _timed_load(self, sig, target):
    t = time.perf_counter()
    out = _load(self, sig, target)
    stats["load"] += time.perf_counter() - t
    stats["hits" if out is not None else "misses"] += 1
    if out is not None and self._py_func.__module__.startswith("stoker."):
        stats["stoker_hits"] += 1
    return out


caching.Cache._load_overload = _timed_load
w0 = time.perf_counter()
import numpy as np
import torch

from stoker.decoders import IntDecoder, NDArrayDecoder, RandomResizedCropRGBImageDecoder
from stoker.loader import Loader, OrderOption
from stoker.transforms import NormalizeImage, RandomHorizontalFlip, Squeeze, ToDevice, ToTensor, ToTorchImage

import_s = time.perf_counter() - w0
kind, path = sys.argv[1], sys.argv[2]
labels = [IntDecoder(), ToTensor(), ToDevice("cpu"), Squeeze()]
mean, std = np.array([0.485, 0.456, 0.406]) * 255, np.array([0.229, 0.224, 0.225]) * 255
rrc = lambda: RandomResizedCropRGBImageDecoder((224, 224))
images = {
    "photo": lambda: [rrc(), RandomHorizontalFlip(), ToTensor(), ToTorchImage()],
    "fill-normalize": lambda: [rrc(), NormalizeImage(mean, std, np.float32), ToTensor()],
    "newcombo": lambda: [rrc(), RandomHorizontalFlip(), NormalizeImage(mean, std, np.float32), ToTensor()],
}
if kind == "otto":
    pipelines = {"x": [NDArrayDecoder(), ToTensor(), ToDevice("cpu")], "y": labels}
    batch_size, workers = 1024, 1
else:
    pipelines = {"image": images[kind](), "label": labels}
    batch_size, workers = 64, 2
for key in ("compile", "llvm", "load"):
    stats[key] = 0.0
stats["compiled"] = []
c0, w0 = time.process_time(), time.perf_counter()
loader = Loader(path, batch_size=batch_size, num_workers=workers, order=OrderOption.RANDOM, seed=0, pipelines=pipelines)
w1 = time.perf_counter()
it = iter(loader)
w2 = time.perf_counter()
batch = next(it)
w3 = time.perf_counter()
c1 = time.process_time()
shapes = [[list(b.shape), str(b.dtype)] for b in batch]
try:
    from stoker.pipeline import prebuilt
    prebuilt_hits, prebuilt_s = len(prebuilt.hits), prebuilt.load_seconds[0]
except ImportError:  # a stoker without prebuilt kernels
    prebuilt_hits, prebuilt_s = 0, 0.0
compile_s, llvm_s, load_s = stats["compile"], stats["llvm"], stats["load"] + prebuilt_s
loader.close()
print(json.dumps({
    "import": import_s, "Loader()": w1 - w0, "iter()": w2 - w1, "next()": w3 - w2, "first batch": w3 - w0,
    "cpu": c1 - c0, "compile": compile_s, "LLVM": llvm_s, "front end": max(0.0, compile_s - llvm_s), "load": load_s,
    "other": max(0.0, (w3 - w0) - compile_s - load_s), "cache hits": stats["hits"], "cache misses": stats["misses"],
    "stoker hits": stats["stoker_hits"], "prebuilt hits": prebuilt_hits, "process cpu": time.process_time() - c_start, "shapes": shapes,
    "compiled": sorted(stats["compiled"], key=lambda c: -c[1])[:12],
}))
"""

#: the scenarios: the processes that fill the caches first (none: empty caches), the one measured, its environment
#: (``-source``: without the package's prebuilt kernels, as from a source tree where they were never built)
SCENARIOS: dict[str, tuple[list[str], str, dict[str, str]]] = {
    "otto": ([], "otto", {}),
    "photo": ([], "photo", {}),
    "newcombo": (["photo", "fill-normalize"], "newcombo", {}),
    "otto-warm": (["otto"], "otto", {}),
    "photo-warm": (["photo"], "photo", {}),
    "otto-source": ([], "otto", {"STOKER_PREBUILT": "0"}),
    "photo-source": ([], "photo", {"STOKER_PREBUILT": "0"}),
}
COLUMNS = ("first batch", "cpu", "import", "Loader()", "iter()", "next()", "compile", "LLVM", "front end", "load", "other", "prebuilt hits")


def _run_child(kind: str, path: Path, caches: Path, timeout_s: float, extra: dict[str, str]) -> dict[str, Any]:
    env = dict(os.environ, STOKER_CACHE_DIR=str(caches / "stoker"), NUMBA_CACHE_DIR=str(caches / "numba"), **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _CHILD, kind, str(path)], env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"cold start ({kind}) exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def measure(scenario: str, path: Path, runs: int, timeout_s: float) -> list[dict[str, Any]]:
    """``runs`` measurements of ``scenario``, each with new, empty cache folders (filled by the scenario's fill runs)."""
    fills, kind, extra = SCENARIOS[scenario]
    out = []
    for _ in range(runs):
        caches = Path(tempfile.mkdtemp(prefix="stoker-cold-"))
        try:
            for fill in fills:
                _run_child(fill, path, caches, timeout_s, extra)
            result = _run_child(kind, path, caches, timeout_s, extra)
        finally:
            shutil.rmtree(caches, ignore_errors=True)
        if not fills and result["stoker hits"]:
            raise SystemExit(f"{scenario}: {result['stoker hits']} of stoker's kernels came from a Numba cache that should be empty")
        out.append(result)
    expected = {"otto": [[[1024, 93], "torch.float32"], [[1024], "torch.int64"]]}.get(
        kind, [[[64, 3, 224, 224], None], [[64], "torch.int64"]]
    )
    for r in out:
        got = r["shapes"]
        if kind == "otto" and got != expected:
            raise SystemExit(f"{scenario}: the first batch is {got}, expected {expected}")
        if kind != "otto" and (got[0][0] != [64, 3, 224, 224] or got[1] != [[64], "torch.int64"]):
            raise SystemExit(f"{scenario}: the first batch is {got}")
    return out


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    """A markdown table: per scenario, the median of each column and the spread of the first batch's time."""
    head = "| scenario | runs | " + " | ".join(COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for name, runs in results.items():
        cells = []
        for col in COLUMNS:
            values = [r[col] for r in runs]
            med = statistics.median(values)
            cell = f"{med:.2f}"
            if col in ("first batch", "cpu") and len(values) > 1:
                cell = f"**{med:.2f}** ({min(values):.2f}-{max(values):.2f})"
            cells.append(cell)
        lines.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", default=",".join(SCENARIOS))
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--photos", type=int, default=256, help="JPEGs in the photo dataset")
    parser.add_argument("--timeout", type=float, default=600.0, help="per process [seconds]")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    import images  # the photo dataset of benchmarks/images.py, scenario C
    from stoker.bench.data import OTTO_SAMPLES, write_otto

    data = args.out / "cold-start-data"
    otto = write_otto(data, OTTO_SAMPLES, 0).path
    photos = images.dataset_path(data, "C", args.photos)
    results: dict[str, list[dict[str, Any]]] = {}
    for scenario in args.only.split(","):
        path = otto if scenario.startswith("otto") else photos
        t0 = time.perf_counter()
        results[scenario] = measure(scenario, path, args.runs, args.timeout)
        first = [round(r["first batch"], 2) for r in results[scenario]]
        print(f"{scenario}: first batch {first} s ({time.perf_counter() - t0:.0f} s with the fills)", file=sys.stderr, flush=True)
    load = os.getloadavg()
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end",
        "results": results,
    }
    print(table(results))
    for name, runs in results.items():
        print(f"{name}: slowest compilations of the first run: {runs[0]['compiled'][:6]}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cold_start.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
