"""The device check (issue 30): the CUDA tests, training steps fed by stoker and by the DataLoader, CPU scaling.

One run, every system side by side in one process, on one GPU and its CPUs:

1. **tests**: the suite's CUDA tests (``pytest -m gpu tests/gpu``), in a subprocess.
2. **resnet50**: ResNet-50 (torchvision, bf16 autocast, channels_last, SGD) on
   224 px RandomResizedCrop + flip of JPEG photos (synthetic, about 400x350, q90),
   a step that loading can keep up with. **resnet18**: ResNet-18 on 32x32 JPEGs,
   where loading dominates. Systems: stoker (decode on CPU threads, ``ToDevice``,
   copies ahead of the step), stoker with the copy on the loop's thread
   (``STOKER_COPY_AHEAD=0``'s path, the behaviour before issue 30), and the
   DataLoader (Pillow, ``pin_memory=True``, ``num_workers`` 8 and 16: the best is
   compared). Each system yields uint8 NHWC images; the step makes them channels-last
   float on the GPU, normalises them there and trains. Measured: images/s (host
   wall time, ended by a synchronisation) and the GPU's busy share, in the steady
   state (each system reads the dataset 40 times over in one epoch: no epoch
   boundary falls inside a run).
3. **scaling**: the photo crop task (RandomResizedCrop 224 + flip to a uint8
   batch of 128, no GPU) with 1, 2, 4, 8, 16 threads, against the DataLoader with
   as many workers.
4. **verdicts**: ``loader.report()``'s verdict after each stoker run (and, for the
   DataLoader, the share of the loop's time spent in ``next()``).

**GPU busy share**: a CUDA event is recorded on the training stream just before
each step's first kernel (after the batch was handed over: stoker's stream wait
for the copy, or the DataLoader batch's copy, comes before it) and one after its
last (the optimizer's step); busy = the sum of the steps' event-to-event times over
the time from the first measured step's start event to the last one's end event,
both on the GPU's clock. The loop never synchronises per step (the host runs ahead
as in real training), so a GPU that waits for data shows as gaps between steps.

Every system's first measured batch is checked for shape and dtype against the
others of its section; a mismatch is an error. A section that fails is recorded
(``"error"`` in the JSON) and the others still run; the JSON is written again after
each section, so a run cut short keeps what it measured.

Run: ``python benchmarks/gpu/check.py [--quick | --cpu] [--out DIR] [--no-tests]``
(``--cpu``: no GPU, a small conv net on the CPU, 1 and 2 threads: the smoke test;
``$OUT`` or ``--out``: where ``gpu_check.json`` and ``gpu_check.md`` go). The device
runs it through ``benchmarks/gpu/run_device.sh``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


@dataclasses.dataclass(frozen=True)
class Mode:
    """The sizes of one mode of the check."""

    name: str
    photos: int  # JPEG photos (about 400x350)
    tiny: int  # 32x32 JPEGs
    r50_batch: int
    r18_batch: int
    warm_steps: int  # steps before measuring (compiling, cudnn's autotuning)
    train_seconds: float  # each system measured at least this long...
    min_steps: int  # ...and this many steps
    max_steps: int
    dl_workers: tuple[int, ...]
    threads: tuple[int, ...]  # the scaling section's thread counts
    scale_batch: int
    scale_seconds: float
    tests_timeout: float  # [s]


MODES = {
    "full": Mode("full", 6000, 50000, 256, 512, 6, 4.0, 20, 400, (8, 16), (1, 2, 4, 8, 16), 128, 3.0, 240.0),
    "quick": Mode("quick", 1200, 8192, 128, 512, 4, 1.5, 8, 200, (8,), (1, 16), 128, 1.5, 150.0),
    "cpu": Mode("cpu", 96, 1024, 16, 64, 1, 0.3, 3, 12, (1,), (1, 2), 16, 0.5, 0.0),
}


# ---- results ------------------------------------------------------------------------------------
class Results:
    """The JSON of the run, written (atomically) after each section."""

    def __init__(self, out: Path, mode: Mode) -> None:
        self.out = out
        self.data: dict[str, Any] = {"mode": mode.name, "sections": {}}
        out.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[dict[str, Any]]:
        entry: dict[str, Any] = {}
        self.data["sections"][name] = entry
        t0 = time.perf_counter()
        print(f"\n== {name}", flush=True)
        try:
            yield entry
        except Exception as exc:  # recorded; the other sections still run
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-4000:]
            print(f"!! {name} failed: {entry['error']}\n{entry['traceback']}", flush=True)
        finally:
            entry["seconds"] = round(time.perf_counter() - t0, 2)
            self.save()

    def save(self) -> None:
        path = self.out / "gpu_check.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, path)


# ---- data -----------------------------------------------------------------------------------------
class SynthPhotos:
    """Images that compress like photographs, fast to make: a colour gradient, a few soft shapes, smooth texture, grain.

    ``jitter`` varies each image's size by up to that many pixels.
    """

    def __init__(self, n: int, h: int, w: int, jitter: int = 0, seed: int = 0) -> None:
        self.n, self.h, self.w, self.jitter, self.seed = n, h, w, jitter, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        rng = np.random.default_rng(self.seed * 1_000_003 + i)
        h = self.h + (int(rng.integers(-self.jitter, self.jitter + 1)) if self.jitter else 0)
        w = self.w + (int(rng.integers(-self.jitter, self.jitter + 1)) if self.jitter else 0)
        yy = np.linspace(0.0, 1.0, h, dtype=np.float32)[:, None, None]
        xx = np.linspace(0.0, 1.0, w, dtype=np.float32)[None, :, None]
        c = rng.uniform(20, 235, (3, 1, 1, 3)).astype(np.float32)
        img = c[0] + (c[1] - c[0]) * xx + (c[2] - c[0]) * yy
        for _ in range(4):  # soft-edged ellipses, each computed over its own box
            cy, cx = rng.uniform(0, h), rng.uniform(0, w)
            ry, rx = rng.uniform(0.05, 0.4) * h, rng.uniform(0.05, 0.4) * w
            y0, y1 = max(0, int(cy - 1.3 * ry)), min(h, int(cy + 1.3 * ry) + 1)
            x0, x1 = max(0, int(cx - 1.3 * rx)), min(w, int(cx + 1.3 * rx) + 1)
            if y1 <= y0 or x1 <= x0:
                continue
            dy = ((np.arange(y0, y1, dtype=np.float32) - cy) / ry)[:, None, None] ** 2
            dx = ((np.arange(x0, x1, dtype=np.float32) - cx) / rx)[None, :, None] ** 2
            alpha = np.clip(1.5 - dy - dx, 0.0, 1.0)
            box = img[y0:y1, x0:x1]
            box += (rng.uniform(0, 255, 3).astype(np.float32) - box) * alpha
        gh, gw = max(2, h // 24), max(2, w // 24)  # smooth texture: a coarse random grid, enlarged (separably, bilinear)
        grid = rng.standard_normal((gh, gw, 3), dtype=np.float32) * 14
        ys, xs = np.linspace(0, gh - 1, h, dtype=np.float32), np.linspace(0, gw - 1, w, dtype=np.float32)
        iy, ix = np.minimum(ys.astype(np.intp), gh - 2), np.minimum(xs.astype(np.intp), gw - 2)
        ty, tx = (ys - iy)[:, None, None], (xs - ix)[None, :, None]
        rows = grid[iy] * (1 - ty) + grid[iy + 1] * ty
        img += rows[:, ix] * (1 - tx) + rows[:, ix + 1] * tx
        img += rng.standard_normal((h, w, 1), dtype=np.float32) * 3  # grain
        return np.clip(img, 0, 255).astype(np.uint8), i % 1000


def build(path: Path, dataset: SynthPhotos, workers: int) -> dict[str, Any]:
    """Write ``dataset`` as JPEGs (q90) with labels, unless the file is there already."""
    from stoker.fields import IntField, RGBImageField
    from stoker.format import Reader
    from stoker.writer import DatasetWriter

    t0 = time.perf_counter()
    if not path.exists():
        fields = {"image": RGBImageField(write_mode="jpg", jpeg_quality=90), "label": IntField()}
        chunk = max(8, min(256, len(dataset) // (4 * max(1, workers))))
        DatasetWriter(path, fields, num_workers=workers, progress=False).from_indexed_dataset(dataset, chunksize=chunk)
    with Reader(path) as reader:
        sizes = np.asarray(reader.metadata["image/size"])
        return {"images": len(reader), "mean_jpeg_bytes": float(sizes.mean()), "build_s": round(time.perf_counter() - t0, 2)}


class WorkerRng:
    """One numpy ``Generator`` per process (per DataLoader worker, seeded from torch's seed for that worker)."""

    def __init__(self) -> None:
        self._pid, self._rng = -1, np.random.default_rng(0)

    def get(self) -> np.random.Generator:
        if self._pid != os.getpid():
            import torch

            self._rng, self._pid = np.random.default_rng(torch.initial_seed()), os.getpid()
        return self._rng


def rrc_params(h: int, w: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop geometry (scale 0.08..1, ratio 3/4..4/3): (top, left, height, width)."""
    area = h * w
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
    return 0, 0, h, w


class PillowPhotos:
    """The DataLoader's dataset: Pillow decodes the same JPEG bytes (the stoker file, memory-mapped in each worker),
    then a RandomResizedCrop to ``size`` (bilinear, as torchvision's) or none, and a random flip; HWC uint8 tensors."""

    def __init__(self, path: Path, size: int | None) -> None:
        from stoker.format import Reader

        with Reader(path) as reader:
            m = reader.metadata
            self.ptr = np.asarray(m["image/ptr"]).astype(np.int64)
            self.nbytes = np.asarray(m["image/size"]).astype(np.int64)
            self.labels = np.asarray(m["label/value"]).astype(np.int64)
        self.path, self.size = str(path), size
        self.rng = WorkerRng()
        self._storage: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_storage": None}

    def __len__(self) -> int:
        return len(self.ptr)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch
        from PIL import Image

        if self._storage is None:
            self._storage = np.memmap(self.path, dtype=np.uint8, mode="r")
        p, n = int(self.ptr[i]), int(self.nbytes[i])
        img = Image.open(io.BytesIO(self._storage[p : p + n].tobytes())).convert("RGB")
        rng = self.rng.get()
        if self.size is not None:
            top, left, ch, cw = rrc_params(img.height, img.width, rng)
            img = img.resize((self.size, self.size), Image.Resampling.BILINEAR, box=(left, top, left + cw, top + ch))
        arr = np.array(img)  # (a copy: writable)
        if rng.random() < 0.5:
            arr = np.ascontiguousarray(arr[:, ::-1])
        return torch.from_numpy(arr), int(self.labels[i])


#: each system reads the dataset this many times in one epoch (random order, repeats augmented anew): the runs measure
#: the steady state, with no epoch boundary inside (where the DataLoader's workers start over, and stoker's loop makes
#: the first batch)
PASSES = 40


def dataloader(dataset: Any, batch: int, workers: int, pin: bool) -> Any:
    """The DataLoader baseline: persistent workers started from a forkserver (clear of this process's threads); one
    epoch of :data:`PASSES` random passes over the dataset."""
    import torch

    sampler = torch.utils.data.RandomSampler(dataset, num_samples=PASSES * len(dataset))
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch, sampler=sampler, num_workers=workers, pin_memory=pin, drop_last=True,
        persistent_workers=workers > 0, multiprocessing_context="forkserver" if workers > 0 else None,
    )  # fmt: skip


def stoker_loader(path: Path, batch: int, workers: int, image_ops: list[Any], device: str | None, seed: int = 0) -> Any:
    """A stoker Loader of (images, labels): the labels' pipeline ends on ``device`` too (``None``: the CPU); one epoch of
    :data:`PASSES` passes over the dataset, in a random order."""
    from stoker.decoders import IntDecoder
    from stoker.format import Reader
    from stoker.loader import Loader, OrderOption
    from stoker.transforms import Squeeze, ToDevice, ToTensor

    with Reader(path) as reader:
        n = len(reader)
    label = [IntDecoder(), ToTensor(), *([ToDevice(device)] if device else []), Squeeze()]
    return Loader(path, batch_size=batch, num_workers=workers, order=OrderOption.RANDOM, seed=seed, drop_last=True,
                  indices=np.tile(np.arange(n), PASSES), pipelines={"image": image_ops, "label": label})  # fmt: skip


def epochs(source: Any) -> Iterator[Any]:
    """The batches of ``source``, epoch after epoch."""
    while True:
        empty = True
        for batch in source:
            empty = False
            yield batch
        if empty:
            raise RuntimeError("the source yielded no batch in an epoch")


def signature(x: Any, y: Any) -> list[Any]:
    return [list(x.shape), str(x.dtype).replace("torch.", ""), list(y.shape), str(y.dtype).replace("torch.", "")]


def same_signatures(systems: dict[str, dict[str, Any]]) -> None:
    sigs = {name: r.get("batch") for name, r in systems.items() if r.get("batch") is not None}
    if len({json.dumps(s) for s in sigs.values()}) > 1:
        raise AssertionError(f"the systems' batches differ in shape or dtype: {sigs}")


# ---- training -------------------------------------------------------------------------------------
class Trainer:
    """A model, its optimizer, and the step: uint8 NCHW images (views of NHWC memory) to channels-last float, normalised
    on the device."""

    def __init__(self, model: Any, device: str, bf16: bool) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.model = model.to(device).to(memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
        self.bf16 = bf16

    def step(self, x: Any, y: Any) -> Any:
        torch = self.torch
        x = x.to(dtype=torch.float32, memory_format=torch.channels_last).sub_(self.mean).div_(self.std)
        with torch.autocast(device_type=torch.device(self.device).type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.loss_fn(self.model(x), y.long())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


def busy_label(cuda: bool) -> str:
    """What ``busy_share`` measured: the GPU's busy share, or (no GPU) the training loop's share of time in its steps."""
    return "GPU busy" if cuda else "in steps (CPU, no GPU)"


def train_run(trainer: Trainer, source: Any, to_device: Callable[[Any, Any], tuple[Any, Any]], mode: Mode, cuda: bool) -> dict[str, Any]:
    """Warm up, then step until ``mode.train_seconds`` and ``mode.min_steps`` have passed; images/s and the GPU's busy share."""
    torch = trainer.torch
    it = epochs(source)
    try:
        for _ in range(mode.warm_steps):
            x, y = to_device(*next(it))
            trainer.step(x, y)
        if cuda:
            torch.cuda.synchronize()
        events: list[tuple[Any, Any]] = []
        images, steps, in_next, sig = 0, 0, 0.0, None
        step_s = 0.0
        t0 = time.perf_counter()
        while True:
            a = time.perf_counter()
            x, y = next(it)
            b = time.perf_counter()
            in_next += b - a
            x, y = to_device(x, y)
            if sig is None:
                sig = signature(x, y)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                loss = trainer.step(x, y)
                end.record()
                events.append((start, end))
            else:
                loss = trainer.step(x, y)
                step_s += time.perf_counter() - b
            images += int(x.shape[0])
            steps += 1
            del x, y
            if steps >= mode.max_steps or (steps >= mode.min_steps and time.perf_counter() - t0 >= mode.train_seconds):
                break
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        if cuda:
            busy_ms = sum(s.elapsed_time(e) for s, e in events)
            span_ms = events[0][0].elapsed_time(events[-1][1])
            busy = busy_ms / span_ms if span_ms > 0 else math.nan
        else:
            busy = step_s / wall  # (no GPU: the loop's share of time in its steps)
        return {"images_per_s": images / wall, "busy_share": busy, "busy_of": "gpu" if cuda else "cpu_steps", "steps": steps, "images": images, "wall_s": wall,
                "next_share": in_next / wall, "loss": float(loss.detach().float().cpu()), "batch": sig}  # fmt: skip
    finally:
        it.close()


def _verdict(loader: Any) -> dict[str, Any]:
    a = loader.stats()["accounting"]
    if not a:
        return {"verdict": "accounting off"}
    return {"verdict": a["verdict"], "stall_share": a["stall_share"], "device_share": a.get("device_share", 0.0),
            "bottleneck": a["bottleneck"], "report": loader.report()}  # fmt: skip


def train_section(entry: dict[str, Any], name: str, path: Path, mode: Mode, model_fn: Callable[[], Any], batch: int,
                  image_ops: Callable[[str | None], list[Any]], crop: int | None, cuda: bool, workers: int) -> None:  # fmt: skip
    """stoker (copies ahead), stoker (copy on the loop's thread), the DataLoader per worker count: one model, in turn."""
    import torch

    device = "cuda" if cuda else "cpu"
    trainer = Trainer(model_fn(), device, bf16=cuda)
    systems: dict[str, dict[str, Any]] = {}
    entry.update(model=name, batch=batch, device=torch.cuda.get_device_name() if cuda else "cpu", systems=systems)
    variants = [("stoker", True), ("stoker_loop_thread", False)] if cuda else [("stoker", True)]
    for label, ahead in variants:
        loader = stoker_loader(path, batch, workers, image_ops(device if cuda else None), device if cuda else None)
        loader._copy_ahead = ahead
        try:
            r = train_run(trainer, loader, lambda x, y: (x, y), mode, cuda)
            r.update(_verdict(loader))
            r["host_waits_for_gpu"] = loader._transfer.host_waits if loader._transfer is not None else 0
        finally:
            loader.close()
        systems[label] = r
        print(f"  {name} {label}: {r['images_per_s']:.0f} images/s, {busy_label(cuda)} {r['busy_share']:.1%}, {r['verdict']}", flush=True)
    for w in mode.dl_workers:
        dl = dataloader(PillowPhotos(path, crop), batch, w, pin=cuda)

        def move(x: Any, y: Any) -> tuple[Any, Any]:  # (NHWC batches: the NCHW view, as stoker's ToTorchImage gives)
            return x.to(device, non_blocking=True).permute(0, 3, 1, 2), y.to(device, non_blocking=True)

        try:
            r = train_run(trainer, dl, move, mode, cuda)
        finally:
            del dl
            gc.collect()
        r["verdict"] = f"(DataLoader: no report(); next() took {r['next_share']:.0%} of the loop's time)"
        systems[f"dataloader_w{w}"] = r
        print(f"  {name} dataloader_w{w}: {r['images_per_s']:.0f} images/s, {busy_label(cuda)} {r['busy_share']:.1%}", flush=True)
    same_signatures(systems)
    dls = {k: v for k, v in systems.items() if k.startswith("dataloader")}
    best = max(dls, key=lambda k: dls[k]["images_per_s"])
    entry["dataloader_best"] = best
    entry["stoker_over_dataloader"] = systems["stoker"]["images_per_s"] / dls[best]["images_per_s"]
    if "stoker_loop_thread" in systems:
        entry["ahead_over_loop_thread"] = systems["stoker"]["images_per_s"] / systems["stoker_loop_thread"]["images_per_s"]
        entry["ahead_over_loop_thread_busy"] = systems["stoker"]["busy_share"] / systems["stoker_loop_thread"]["busy_share"]
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# ---- CPU scaling ----------------------------------------------------------------------------------
def throughput(source: Any, seconds: float) -> tuple[float, list[Any]]:
    """Images/s of ``source`` after one warm-up batch, over at least ``seconds`` and 2 batches; the first batch's signature."""
    it = epochs(source)
    try:
        next(it)
        images, batches, sig = 0, 0, None
        t0 = time.perf_counter()
        while True:
            x, y = next(it)
            if sig is None:
                sig = signature(x, y)
            images += int(x.shape[0])
            batches += 1
            del x, y
            if batches >= 2 and time.perf_counter() - t0 >= seconds:
                break
        return images / (time.perf_counter() - t0), sig  # type: ignore[return-value]
    finally:
        it.close()


def scaling_section(entry: dict[str, Any], path: Path, mode: Mode) -> None:
    from stoker.decoders import RandomResizedCropRGBImageDecoder
    from stoker.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage

    rows: dict[str, dict[str, Any]] = {}
    entry.update(task=f"RandomResizedCrop 224 + flip, uint8 NHWC batches of {mode.scale_batch}", threads=rows)
    for k in mode.threads:
        ops = [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip(), ToTensor(), ToTorchImage()]
        loader = stoker_loader(path, mode.scale_batch, k, ops, None)
        try:
            s, s_sig = throughput(loader, mode.scale_seconds)
        finally:
            loader.close()
        dl = dataloader(PillowPhotos(path, 224), mode.scale_batch, k, pin=False)
        try:
            d, d_sig = throughput(dl, mode.scale_seconds)
        finally:
            del dl
            gc.collect()
        s_sig[0] = [s_sig[0][i] for i in (0, 2, 3, 1)]  # (stoker's NCHW view of NHWC memory, as NHWC)
        if s_sig != d_sig:
            raise AssertionError(f"{k} threads: stoker's batches {s_sig}, the DataLoader's {d_sig}")
        rows[str(k)] = {"stoker_images_per_s": s, "dataloader_images_per_s": d, "stoker_over_dataloader": s / d, "batch": s_sig}
        print(f"  {k:2d} threads: stoker {s:.0f} images/s, DataLoader {d:.0f} ({s / d:.2f}x)", flush=True)
    first = rows[str(mode.threads[0])]["stoker_images_per_s"]
    for r in rows.values():
        r["stoker_over_1_thread"] = r["stoker_images_per_s"] / first


# ---- tests ----------------------------------------------------------------------------------------
def tests_section(entry: dict[str, Any], mode: Mode) -> None:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "--timeout", "120", "-rfE"]  # fmt: skip
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=mode.tests_timeout)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else str(exc.stdout or "")
        rc = "timeout"
    print(out[-6000:], flush=True)
    summary = [line for line in out.splitlines() if " passed" in line or " failed" in line or " error" in line]
    entry.update(returncode=rc, summary=summary[-1] if summary else "", seconds_tests=round(time.perf_counter() - t0, 1),
                 failures=[line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))][:30])  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"the CUDA tests did not pass (exit {rc}): {entry['summary']}")


# ---- the table --------------------------------------------------------------------------------------
def table(data: dict[str, Any]) -> str:
    env = data.get("env", {})
    cuda = not str(env.get("device", "")).startswith("cpu")
    lines = [f"# Device check ({data['mode']}): {env.get('device', '?')}, {env.get('cpus', '?')} CPUs, torch {env.get('torch', '?')}",
             "", f"| section | system | images/s | {busy_label(cuda)} | verdict (report()) | notes |", "|---|---|---:|---:|---|---|"]  # fmt: skip
    secs = data["sections"]
    for name, sec in secs.items():
        if "error" in sec:
            lines.append(f"| {name} | **failed** | | | | {sec['error'][:120]} |")
            continue
        if name == "tests":
            lines.append(f"| tests | pytest -m gpu | | | | {sec.get('summary', '')} ({sec.get('seconds_tests', '?')} s) |")
        elif "systems" in sec:
            for label, r in sec["systems"].items():
                v = r.get("verdict", "")
                if "device_share" in r and r.get("busy_of") == "cpu_steps":
                    v += f" (waits for data {r['stall_share']:.0%})"
                elif "device_share" in r:
                    v += f" (waits for data {r['stall_share']:.0%}, for the GPU {r['device_share']:.0%})"
                lines.append(f"| {name} | {label} | {r['images_per_s']:.0f} | {r['busy_share']:.1%} | {v} | loss {r.get('loss', 0):.2f} |")
            notes = [f"stoker / best DataLoader ({sec.get('dataloader_best')}): {sec.get('stoker_over_dataloader', math.nan):.2f}x"]
            if "ahead_over_loop_thread" in sec:
                notes.append(f"copy ahead / loop thread: {sec['ahead_over_loop_thread']:.2f}x images/s, "
                             f"{sec['ahead_over_loop_thread_busy']:.2f}x busy")  # fmt: skip
            lines.append(f"| {name} | | | | | {'; '.join(notes)} |")
        elif name == "scaling":
            for k, r in sec["threads"].items():
                lines.append(f"| scaling | {k} threads | {r['stoker_images_per_s']:.0f} (DataLoader {r['dataloader_images_per_s']:.0f}) | | | "
                             f"{r['stoker_over_dataloader']:.2f}x the DataLoader, {r['stoker_over_1_thread']:.2f}x 1 thread |")  # fmt: skip
    targets = data.get("targets")
    if targets:
        lines += ["", "| target | value | met |", "|---|---|---|"]
        lines += [f"| {t['target']} | {t['value']} | {'yes' if t['met'] else 'NO'} |" for t in targets]
    return "\n".join(lines)


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, from what was measured (those whose section failed are left out)."""
    out: list[dict[str, Any]] = []
    s = data["sections"]
    r50, r18, sc = s.get("resnet50", {}), s.get("resnet18", {}), s.get("scaling", {})
    if "systems" in r50 and "error" not in r50:
        st, dl = r50["systems"]["stoker"], r50["systems"][r50["dataloader_best"]]
        out.append({"target": "ResNet-50: stoker keeps the GPU busy >= 95%, the best DataLoader does not",
                    "value": f"{st['busy_share']:.1%} vs {dl['busy_share']:.1%}", "met": st["busy_share"] >= 0.95 > dl["busy_share"]})  # fmt: skip
    if "systems" in r18 and "error" not in r18:
        out.append({"target": "ResNet-18 32x32: >= 2x the DataLoader's images/s", "value": f"{r18['stoker_over_dataloader']:.2f}x",
                    "met": r18["stoker_over_dataloader"] >= 2.0})  # fmt: skip
    for name, sec in (("ResNet-50", r50), ("ResNet-18", r18)):
        if "ahead_over_loop_thread" in sec and "error" not in sec:
            out.append({"target": f"{name}: copy ahead >= loop thread", "value": f"{sec['ahead_over_loop_thread']:.3f}x",
                        "met": sec["ahead_over_loop_thread"] >= 1.0})  # fmt: skip
    if "threads" in sc and "error" not in sc and "16" in sc["threads"]:
        r = sc["threads"]
        out.append({"target": "photo task: >= 12x its 1-thread throughput at 16 threads", "value": f"{r['16']['stoker_over_1_thread']:.2f}x",
                    "met": r["16"]["stoker_over_1_thread"] >= 12})  # fmt: skip
    if "threads" in sc and "error" not in sc:
        worst = min(r["stoker_over_dataloader"] for r in sc["threads"].values())
        out.append(
            {
                "target": "photo task: >= 2.5x the DataLoader at every thread count",
                "value": f"{worst:.2f}x (the least)",
                "met": worst >= 2.5,
            }
        )
    return out


# ---- main -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="small data, few steps, one DataLoader worker count (about 2 minutes)")
    group.add_argument("--cpu", action="store_true", help="no GPU: a small conv net on the CPU, 1 and 2 threads (the smoke test)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench-out"), help="where the JSON and table go")
    parser.add_argument("--data", type=Path, default=None, help="where the datasets are written (default: OUT/data)")
    parser.add_argument("--no-tests", action="store_true", help="skip the CUDA tests")
    args = parser.parse_args(argv)
    mode = MODES["cpu" if args.cpu else "quick" if args.quick else "full"]
    res = Results(args.out, mode)
    data_dir = args.data or args.out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    from stoker._threads import available_cpus

    cpus = available_cpus()
    workers = cpus
    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    env = res.data["env"] = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__, "cpus": cpus,
                             "device": torch.cuda.get_device_name() if cuda else "cpu (no GPU)"}  # fmt: skip
    with contextlib.suppress(Exception):
        import numba

        env["numba"] = numba.__version__
    if not cuda and not args.cpu:
        print("no CUDA device: run with --cpu for the CPU-only parts", file=sys.stderr)
        return 2
    if cuda:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    paths: dict[str, Path] = {}
    with res.section("data") as entry:  # (before any Loader or CUDA context: the writer's workers fork cleanly)
        paths["photos"] = data_dir / f"photos-{mode.photos}.stoker"
        paths["tiny"] = data_dir / f"tiny-{mode.tiny}.stoker"
        entry["photos"] = build(paths["photos"], SynthPhotos(mode.photos, 350, 400, jitter=24), min(workers, 16))
        entry["tiny"] = build(paths["tiny"], SynthPhotos(mode.tiny, 32, 32, seed=1), min(workers, 16))
        print(f"  {entry}", flush=True)
    if cuda and not args.no_tests:
        with res.section("tests") as entry:
            tests_section(entry, mode)

    from stoker.decoders import RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder
    from stoker.transforms import RandomHorizontalFlip, ToDevice, ToTensor, ToTorchImage

    def photo_ops(device: str | None) -> list[Any]:
        return [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip(), ToTensor(), *([ToDevice(device)] if device else []),
                ToTorchImage()]  # fmt: skip

    def tiny_ops(device: str | None) -> list[Any]:
        return [SimpleRGBImageDecoder(), RandomHorizontalFlip(), ToTensor(), *([ToDevice(device)] if device else []), ToTorchImage()]

    if cuda:
        import torchvision

        with res.section("resnet50") as entry:
            train_section(entry, "ResNet-50 224px", paths["photos"], mode, lambda: torchvision.models.resnet50(), mode.r50_batch,
                          photo_ops, 224, True, workers)  # fmt: skip
        with res.section("resnet18") as entry:
            train_section(entry, "ResNet-18 32px", paths["tiny"], mode, lambda: torchvision.models.resnet18(), mode.r18_batch,
                          tiny_ops, None, True, workers)  # fmt: skip
    else:

        def small_net() -> Any:
            nn = torch.nn
            return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 1000))  # fmt: skip

        with res.section("small_cnn_cpu") as entry:
            train_section(
                entry, "small CNN 32px (CPU)", paths["tiny"], mode, small_net, mode.r18_batch, tiny_ops, None, False, min(2, workers)
            )
    with res.section("scaling") as entry:
        scaling_section(entry, paths["photos"], mode)
    res.data["targets"] = targets(res.data) if cuda else []
    res.save()
    text = table(res.data)
    (args.out / "gpu_check.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    failed = [name for name, sec in res.data["sections"].items() if "error" in sec]
    if failed:
        print(f"\nsections that failed: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
