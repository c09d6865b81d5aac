"""Cold start: ``Loader()`` to the first batch and to the end of the first epoch in a fresh process, with empty compile
caches (the README's install: ``pip install -e .``, with the prebuilt kernels the repository ships), and where the
time goes.

Each measurement is a new Python process with its own, new, empty cache
folders: stoker's (``STOKER_CACHE_DIR``) and Numba's (``NUMBA_CACHE_DIR``; with
it set, Numba reads and writes no other cache folder, the ``__pycache__``
folders beside stoker's sources included, and the child checks that every
cache lookup of stoker's own kernels missed, but those of kernels the first batch's compile children cached meanwhile).
Scenarios:

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
  run left (what every later job pays);
* ``otto-source``, ``photo-source``: without the prebuilt kernels (``STOKER_PREBUILT=0``:
  what a tree whose kernels changed since ``make prebuilt`` pays, every kernel compiled
  here); every other scenario is the README's install, the shipped prebuilt kernels
  (``src/stoker/_prebuilt``) used.

Each process checks its batches (the first batch's shapes and dtypes, every batch of
the first epoch alike, every sample once) and the script shows no figure of a
process whose batches are wrong.

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
  (``time.process_time``): robust to other load on the machine, unlike wall time;
  ``children cpu``: that of the first batch's compile children (:mod:`stoker.pipeline._ahead`), in all;
* ``first epoch``: ``Loader()`` to the end of the first epoch;
* ``compiled``: each kernel compiled before the first batch (outermost compilations:
  name, seconds, when it started after ``Loader()``, the thread), ``compiled after``
  those of the rest of the epoch (the producer loop compiles in a child process: not
  counted), ``said``: what stoker logged meanwhile (INFO), with its time.

The machine's load average before and after goes with the figures (other work on a
2-core machine makes wall times several times longer; ``cpu`` much less so).

Run: ``python benchmarks/cold_start.py [--runs 3] [--only otto,photo,newcombo,otto-warm,photo-warm] [--out DIR]``
(``--quick``: one run of ``otto`` and ``otto-warm``). Writes ``DIR/NAME.json`` (default ``bench-out/cold_start.json``;
``--src``: the stoker the processes run, e.g. an earlier commit's worktree, for a before/after).

``--ramp otto`` (or ``photo``), instead (issue 44): a process with empty caches runs one long epoch (the dataset
``--ramp-repeat`` times, shuffled) for ``--ramp-seconds`` from ``iter()``, then a warm process (the caches it left);
figures: when the loop's compile child ended (seen in ``/proc``), from when the compiled loop ran (the switch, or the
first epoch that began after the child ended), and when a 1-second window first reached 0.9x the warm process's
median speed (noisy on a loaded machine: the warm process runs at another moment).
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
#: the stoker the measured processes run (``--src``: another tree's, e.g. a worktree of an earlier commit)
SRC = [HERE.parent / "src"]

# ---- the measured process -------------------------------------------------------------------------

_CHILD = r"""
import json, os, sys, threading, time
c_start = time.process_time()
import numba
from numba.core import caching
from numba.core import event as ev

T0 = [time.perf_counter()]
stats = {"compile": 0.0, "llvm": 0.0, "load": 0.0, "hits": 0, "misses": 0, "stoker_hits": 0, "compiled": []}
_depth = {}


class _Outermost(ev.Listener):
    # the outermost event of a kind in each thread: nested compilations are inside their caller's time
    def __init__(self, key):
        self.key, self.starts, self.starts_rel = key, {}, {}

    def on_start(self, event):
        k = (threading.get_ident(), self.key)
        _depth[k] = _depth.get(k, 0) + 1
        if _depth[k] == 1:
            self.starts[k] = time.perf_counter()
            self.starts_rel[k] = self.starts[k] - T0[0]

    def on_end(self, event):
        k = (threading.get_ident(), self.key)
        _depth[k] -= 1
        if _depth[k] == 0:
            t = time.perf_counter() - self.starts.pop(k)
            stats[self.key] += t
            if self.key == "compile":
                fn = event.data["dispatcher"].py_func
                start = self.starts_rel.pop(k, 0.0)
                stats["compiled"].append([f"{fn.__module__}.{fn.__qualname__}", round(t, 3), round(start, 3), threading.current_thread().name])


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
import logging


class _Said(logging.Handler):  # what stoker says while the process waits (its INFO messages, with their time)
    def emit(self, record):
        said.append([round(time.perf_counter() - T0[0], 2), record.getMessage()[:300]])


said = []
logging.getLogger("stoker").addHandler(_Said())
logging.getLogger("stoker").setLevel(logging.INFO)
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
T0[0] = w0
loader = Loader(path, batch_size=batch_size, num_workers=workers, order=OrderOption.RANDOM, seed=0, pipelines=pipelines)
w1 = time.perf_counter()
it = iter(loader)
w2 = time.perf_counter()
batch = next(it)
w3 = time.perf_counter()
c1 = time.process_time()
shapes = [[list(b.shape), str(b.dtype)] for b in batch]
compiled_first = len(stats["compiled"])
at_first = {key: stats[key] for key in ("compile", "llvm", "load", "hits", "misses", "stoker_hits")}
batches, samples, odd = 1, len(batch[1]), []
for b in it:  # the rest of the first epoch: every batch of the same kind as the first
    batches += 1
    samples += len(b[1])
    got = [[list(x.shape)[1:], str(x.dtype)] for x in b]
    if got != [[s[0][1:], s[1]] for s in shapes] and len(odd) < 3:
        odd.append(got)
w4 = time.perf_counter()
total = loader.reader.num_samples
try:
    from stoker.pipeline import prebuilt
    prebuilt_hits, prebuilt_s = len(prebuilt.hits), prebuilt.load_seconds[0]
except ImportError:  # a stoker without prebuilt kernels
    prebuilt_hits, prebuilt_s = 0, 0.0
compile_s, llvm_s, load_s = at_first["compile"], at_first["llvm"], at_first["load"] + prebuilt_s
try:  # the first batch's compile children (issue 44), if this stoker has them: their CPU, once they have ended
    from stoker.pipeline import _ahead
    ahead = _ahead.last[0] if _ahead.last else None
except ImportError:
    ahead = None
if ahead is not None:
    ahead.wait(1800)
children_cpu = sum(ahead.cpu.values()) if ahead is not None else 0.0
plan = loader._plan
w5 = time.perf_counter()
if plan is not None and plan.background is not None:  # (not timed: the next process finds the loop cached, and no
    plan.background.wait(1800)  # compile child of this one takes CPU from the next measurement)
loop_wait = time.perf_counter() - w5
loader.close()
print(json.dumps({
    "import": import_s, "Loader()": w1 - w0, "iter()": w2 - w1, "next()": w3 - w2, "first batch": w3 - w0,
    "cpu": c1 - c0, "compile": compile_s, "LLVM": llvm_s, "front end": max(0.0, compile_s - llvm_s), "load": load_s,
    "other": max(0.0, (w3 - w0) - compile_s - load_s), "cache hits": at_first["hits"], "cache misses": at_first["misses"],
    "stoker hits": at_first["stoker_hits"], "prebuilt hits": prebuilt_hits, "process cpu": time.process_time() - c_start, "shapes": shapes,
    "compiled": sorted(stats["compiled"][:compiled_first], key=lambda c: -c[1]),
    "compiled after": sorted(stats["compiled"][compiled_first:], key=lambda c: -c[1]),
    "first epoch": w4 - w0, "epoch batches": batches, "epoch samples": samples, "odd batches": odd,
    "samples": total, "said": said, "loop compile left after the epoch": loop_wait, "children cpu": children_cpu,
}))
"""

#: the README's install (``pip install -e .``): the prebuilt kernels the repository ships (src/stoker/_prebuilt)
README: dict[str, str] = {}
#: without them: every kernel compiled in the process (a tree whose kernels changed since ``make prebuilt``)
SOURCE = {"STOKER_PREBUILT": "0"}
#: the scenarios: the processes that fill the caches first (none: empty caches), the one measured, its environment
#: (``-source``: without the shipped prebuilt kernels)
SCENARIOS: dict[str, tuple[list[str], str, dict[str, str]]] = {
    "otto": ([], "otto", README),
    "photo": ([], "photo", README),
    "newcombo": (["photo", "fill-normalize"], "newcombo", README),
    "otto-warm": (["otto"], "otto", README),
    "photo-warm": (["photo"], "photo", README),
    "otto-source": ([], "otto", SOURCE),
    "photo-source": ([], "photo", SOURCE),
}
COLUMNS = (
    "first batch", "first epoch", "cpu", "children cpu", "import", "Loader()", "iter()", "next()", "compile", "LLVM", "front end", "load", "other",
    "prebuilt hits",
)  # fmt: skip


def _run_child(kind: str, path: Path, caches: Path | None, timeout_s: float, extra: dict[str, str]) -> dict[str, Any]:
    """One measured process (``caches``: its new cache root; ``None``: this process's caches, as they are)."""
    env = dict(os.environ, **extra)
    if caches is not None:
        env.update(STOKER_CACHE_DIR=str(caches / "stoker"), NUMBA_CACHE_DIR=str(caches / "numba"))
    env["PYTHONPATH"] = os.pathsep.join([str(SRC[0]), env.get("PYTHONPATH", "")])
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
        if not fills and result["stoker hits"] and not result["children cpu"]:  # (hits: what the compile children cached)
            raise SystemExit(f"{scenario}: {result['stoker hits']} of stoker's kernels came from a Numba cache that should be empty")
        out.append(result)
    for r in out:
        problem = check(kind, r)
        if problem:
            raise SystemExit(f"{scenario}: {problem}")
    return out


def check(kind: str, r: dict[str, Any], batch_size: int | None = None) -> str:
    """What is wrong with measured process ``r``'s batches (``""``: nothing): the first batch's shapes and dtypes, every
    batch of the epoch alike, every sample once. Checked before any figure is shown."""
    got = r["shapes"]
    if kind == "otto":
        n = batch_size or 1024
        want = [[[n, 93], "torch.float32"], [[n], "torch.int64"]]
        if got != want:
            return f"the first batch is {got}, expected {want}"
    else:
        n = batch_size or 64
        if got[0][0] != [n, 3, 224, 224] or got[0][1] != "torch.uint8" or got[1] != [[n], "torch.int64"]:
            return f"the first batch is {got}, expected [[{n}, 3, 224, 224], 'torch.uint8'] and [[{n}], 'torch.int64']"
    if r["odd batches"]:
        return f"batches of the first epoch unlike the first: {r['odd batches']}"
    if r["epoch samples"] != r["samples"]:
        return f"the first epoch gave {r['epoch samples']} samples of {r['samples']}"
    return ""


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


# ---- the ramp: from iter() to the warm process's speed (issue 44) ----------------------------------

_RAMP_CHILD = r"""
import json, sys, time
import numpy as np
from stoker.decoders import IntDecoder, NDArrayDecoder, RandomResizedCropRGBImageDecoder
from stoker.loader import Loader, OrderOption
from stoker.transforms import RandomHorizontalFlip, Squeeze, ToDevice, ToTensor, ToTorchImage

kind, path, samples, repeat, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
labels = [IntDecoder(), ToTensor(), ToDevice("cpu"), Squeeze()]
if kind == "otto":
    pipelines = {"x": [NDArrayDecoder(), ToTensor(), ToDevice("cpu")], "y": labels}
    batch_size, workers = 1024, 1
else:
    pipelines = {"image": [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip(), ToTensor(), ToTorchImage()], "label": labels}
    batch_size, workers = 64, 2
indices = np.tile(np.arange(samples), repeat)  # one long epoch: the dataset `repeat` times, shuffled
loader = Loader(path, batch_size=batch_size, num_workers=workers, order=OrderOption.RANDOM, seed=0, pipelines=pipelines, indices=indices)
t0 = time.perf_counter()
times, epochs = [], []  # when each batch was handed over, after iter() [s]; when each epoch began
ended = []  # when the loop's compile child ended, after iter() [s]: seen as a zombie in /proc (not reaped here)


def watch():
    while time.perf_counter() - t0 < seconds:
        bg = loader._plan.background if loader._plan is not None else None
        pid = getattr(bg, "pid", None)
        if pid is not None:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:  # reaped already
                state = "Z"
            if state in "ZX":
                ended.append(time.perf_counter() - t0)
                return
        time.sleep(0.01)


import threading
threading.Thread(target=watch, daemon=True).start()
while time.perf_counter() - t0 < seconds:
    epochs.append(time.perf_counter() - t0)
    for batch in loader:
        times.append(time.perf_counter() - t0)
        if times[-1] >= seconds:
            break
plan = loader._plan
switched = getattr(plan, "switched", None)
bg = plan.background if plan is not None else None
if bg is not None:
    bg.wait(1800)
print(json.dumps({"times": [round(t, 5) for t in times], "batch": batch_size, "epochs": epochs, "switched": switched,
                  "compile ended at s": ended[0] if ended else None,
                  "loop compile s": bg.seconds if bg is not None else None, "epoch batches": len(loader)}))
loader.close()
"""


def _ramp_child(kind: str, path: Path, caches: Path, samples: int, repeat: int, seconds: float, timeout_s: float) -> dict[str, Any]:
    env = dict(os.environ, **README, STOKER_CACHE_DIR=str(caches / "stoker"), NUMBA_CACHE_DIR=str(caches / "numba"))
    env["PYTHONPATH"] = os.pathsep.join([str(SRC[0]), env.get("PYTHONPATH", "")])
    args = [sys.executable, "-c", _RAMP_CHILD, kind, str(path), str(samples), str(repeat), str(seconds)]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"ramp ({kind}) exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def _throughput(times: list[float], batch: int, lo: float, hi: float) -> float:
    """Samples per second handed over in ``[lo, hi)`` seconds after ``iter()``."""
    n = sum(1 for t in times if lo <= t < hi)
    return n * batch / (hi - lo)


def ramp_figures(cold: dict[str, Any], warm: dict[str, Any], window: float = 1.0, share: float = 0.9) -> dict[str, Any]:
    """The warm process's speed (samples/s, the median of its ``window``-second windows after its first second) and
    the cold one's time to reach ``share`` of it: the end of its first ``window``-second window at that speed
    (``None``: not within the measured time)."""
    import numpy as np

    times, batch = warm["times"], warm["batch"]
    edges = np.arange(1.0, times[-1] - window, window / 2) if times else np.zeros(0)
    warm_speed = float(np.median([_throughput(times, batch, t, t + window) for t in edges])) if len(edges) else float("nan")
    reached = None
    t = 0.0
    while t + window <= (cold["times"][-1] if cold["times"] else 0.0):
        if _throughput(cold["times"], cold["batch"], t, t + window) >= share * warm_speed:
            reached = t + window
            break
        t += window / 10
    end = cold["compile ended at s"]
    starts = cold["epochs"]
    if cold["switched"] is not None:  # (this stoker: mid-epoch, at the batch boundary after the child ended)
        epoch, _, after_iter = cold["switched"]
        compiled_from = starts[epoch] + after_iter if epoch < len(starts) else None
    else:  # (before issue 44: the first epoch that began after the child ended)
        compiled_from = next((t for t in starts if end is not None and t >= end), None)
    return {"warm samples/s": warm_speed, f"s to {share:.0%} of warm": reached, "compile ended at s": end,
            "lag after the compile s": reached - end if reached is not None and end is not None else None, "switched": cold["switched"],
            "compiled loop from s": compiled_from,
            "loop compile s": cold["loop compile s"], "cold epochs began at s": cold["epochs"][:3],
            "cold epoch batches": cold["epoch batches"]}  # fmt: skip


def ramp_main(kind: str, path: Path, samples: int, repeat: int, seconds: float, runs: int, timeout_s: float) -> list[dict[str, Any]]:
    """``runs`` times: a process with empty caches (the README's install) runs ``seconds`` of one long epoch from
    ``iter()``, then a second process with the caches it left (warm); the figures of :func:`ramp_figures`."""
    out = []
    for _ in range(runs):
        caches = Path(tempfile.mkdtemp(prefix="stoker-ramp-"))
        try:
            cold = _ramp_child(kind, path, caches, samples, repeat, seconds, timeout_s)
            warm = _ramp_child(kind, path, caches, samples, repeat, min(seconds, 20.0), timeout_s)
        finally:
            shutil.rmtree(caches, ignore_errors=True)
        figures = ramp_figures(cold, warm)
        print(f"ramp {kind} ({SRC[0]}): {json.dumps(figures)}", file=sys.stderr, flush=True)
        out.append({**figures, "cold": cold, "warm": warm})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", default=",".join(SCENARIOS))
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--photos", type=int, default=256, help="JPEGs in the photo dataset")
    parser.add_argument("--timeout", type=float, default=600.0, help="per process [seconds]")
    parser.add_argument("--quick", action="store_true", help="one run of the README install's Otto scenario, cold and warm")
    parser.add_argument("--src", type=Path, default=SRC[0], help="the stoker the measured processes run (its src folder)")
    parser.add_argument("--name", default="cold_start", help="the JSON file's name in --out (without .json)")
    parser.add_argument("--ramp", choices=["otto", "photo"], help="instead: the time from iter() to 0.9x the warm speed (issue 44)")
    parser.add_argument("--ramp-seconds", type=float, default=60.0, help="--ramp: how long the cold process runs [seconds]")
    parser.add_argument("--ramp-repeat", type=int, default=50, help="--ramp: the epoch is the dataset this many times")
    args = parser.parse_args()
    SRC[0] = args.src.resolve()
    if args.ramp:
        sys.path.insert(0, str(HERE))
        import images
        from stoker.bench.data import OTTO_SAMPLES, write_otto

        data = args.out / "cold-start-data"
        data.mkdir(parents=True, exist_ok=True)
        path, samples = (write_otto(data, OTTO_SAMPLES, 0).path, OTTO_SAMPLES) if args.ramp == "otto" else (
            images.dataset_path(data, "C", args.photos), args.photos)  # fmt: skip
        load_before = os.getloadavg()[0]
        runs = ramp_main(args.ramp, path, samples, args.ramp_repeat, args.ramp_seconds, args.runs, args.timeout)
        report = {"src": str(SRC[0]), "load average before": load_before, "load average after": os.getloadavg()[0], "runs": runs}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
        print(json.dumps([{k: v for k, v in r.items() if k not in ("cold", "warm")} for r in runs], indent=1))
        print(f"load average (1 min): {load_before:.2f} before, {report['load average after']:.2f} after")
        return
    if args.quick:
        args.runs, args.only = 1, "otto,otto-warm"
    load_before = os.getloadavg()
    sys.path.insert(0, str(HERE))
    import images  # the photo dataset of benchmarks/images.py, scenario C
    from stoker.bench.data import OTTO_SAMPLES, write_otto

    data = args.out / "cold-start-data"
    data.mkdir(parents=True, exist_ok=True)
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
        "load average before": load_before[0],
        "load average after": load[0],
        "src": str(SRC[0]),
        "results": results,
    }
    print(table(results))
    print(f"load average (1 min): {load_before[0]:.2f} before, {load[0]:.2f} after")
    for name, runs in results.items():
        slowest = [f"{c[0].rsplit('.', 2)[-2]}.{c[0].rsplit('.', 1)[-1]} {c[1]:.2f} s" for c in runs[0]["compiled"][:6]]
        print(f"{name}: compiled before the first batch (first run): {', '.join(slowest) or 'nothing'}")
        for t, message in runs[0]["said"][:4]:
            print(f"{name}:   said at {t:.1f} s: {message[:160]}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
