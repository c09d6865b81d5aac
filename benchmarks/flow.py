"""stoker.flow against torch's DataLoader: seed 002's table (SPDL's multi_thread_preprocessing), on this machine.

Both sides are the example's code (``examples/spdl_multi_thread.py``): ``exp_spdl``
(a flow: decode + resize with ``stoker.io`` on the pipeline's threads, batch and
normalize in this process) and ``exp_torch`` (DataLoader, Pillow decode + resize in
fork workers, ``default_collate``, normalize in the collate), over a folder of
generated photo-like JPEGs (about 500x375, q90). Configurations: decode + resize;
+ batch; + normalize; (+ transfer to the GPU only where CUDA exists). Worker
counts 1, 2, 4, 8. Each cell is the median of ``--runs`` runs, in images/s,
timed as the seed times them (from the first ``iter()``, so worker start-up
counts; stoker's compiled kernels are compiled before timing, once per process).

A third row, ``stoker.io``, runs the same flow with the batch normalized by
``stoker.io.normalize`` (one compiled pass without the GIL) instead of the
seed's torch operations: how one would write it for stoker.

Before anything is timed, every system's first item of each configuration is
checked: same shapes and dtypes, and pixel statistics (mean, standard deviation)
within a tolerance that allows for different resize filters.

Each cell also prints the CPU time per image (this process and the DataLoader's workers) and the
load: on a shared machine images/s follows the share of the cores a run happened to get, the CPU
time much less (``flow.json``: ``cpu_ms_per_image``).

It also measures the cost of a flow stage that does nothing: per item, at
concurrency 1 and 8, as the slope of time against the number of such stages.

Run: ``python benchmarks/flow.py [--images 256] [--per-run 192] [--runs 3] [--workers 1,2,4,8] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
MEAN_TOL, STD_TOL = 2.0, 2.0  # [pixel levels, of 255] on uint8 outputs; scaled by 1/(255 * std) after normalize


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("spdl_multi_thread", ROOT / "examples" / "spdl_multi_thread.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def first_item(example: ModuleType, exp: Any, **kwargs: Any) -> Any:
    """The first item ``exp`` yields: its ``run_dataloader`` replaced by one that keeps it."""
    kept: list[Any] = []

    def keep(dataloader: Any, max_items: int) -> tuple[int, float]:
        for item in dataloader:
            kept.append(item)
            break
        return 1, 1.0

    original = example.run_dataloader
    example.run_dataloader = keep
    try:
        exp(**kwargs)
    finally:
        example.run_dataloader = original
    return kept[0]


def verify(example: ModuleType, root: str, configs: list[dict[str, Any]]) -> list[str]:
    """Check shapes, dtypes and pixel statistics of both systems' first item, per configuration."""
    lines = []
    for cfg in configs:
        common = {"root_dir": root, "split": "val", "num_workers": 1, "max_items": 1, **cfg}  # one worker: the same first images
        t_data, _ = first_item(example, example.exp_torch, **common)
        t_arr = t_data.numpy()
        for name, exp in systems(example, cfg)[1:]:
            s_data, _ = first_item(example, exp, **common)
            s_arr = np.ascontiguousarray(s_data.numpy())
            if s_arr.shape == (1, *t_arr.shape):  # without batching the seed's flow yields batches of one image
                s_arr = s_arr[0]
            if t_arr.shape != s_arr.shape or t_arr.dtype != s_arr.dtype:
                raise SystemExit(f"{cfg}: torch gives {t_arr.dtype} {t_arr.shape}, {name} {s_arr.dtype} {s_arr.shape}: not comparable")
            scale = 1.0 if t_arr.dtype == np.uint8 else 1 / (255 * 0.226)
            dm = abs(float(t_arr.mean()) - float(s_arr.mean()))
            ds = abs(float(t_arr.std()) - float(s_arr.std()))
            if dm > MEAN_TOL * scale or ds > STD_TOL * scale:
                raise SystemExit(
                    f"{cfg}: pixel statistics differ: mean {t_arr.mean():.4f} vs {s_arr.mean():.4f}, std {t_arr.std():.4f} vs {s_arr.std():.4f}"
                )
            lines.append(
                f"{cfg}: {t_arr.dtype} {t_arr.shape}; mean {t_arr.mean():.3f} / {s_arr.mean():.3f}, std {t_arr.std():.3f} / {s_arr.std():.3f} (torch / {name})"
            )
    return lines


MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def exp_stoker_io(
    example: ModuleType,
    *,
    root_dir: str,
    split: str,
    num_workers: int,
    max_items: int,
    batch_size: int | None = None,
    normalize: bool = False,
    transfer: bool = False,
) -> tuple[int, float]:
    """``exp_spdl`` as one would write it for stoker: the batch is normalized by ``stoker.io.normalize``
    (one compiled pass, no GIL, NHWC uint8 -> NCHW float32) on two threads instead of four torch ops."""
    import stoker.io
    from stoker.flow import PipelineBuilder

    dataset = example.ImageNet(root=root_dir, split=split, loader=lambda path: stoker.io.decode_image(path, (224, 224)))

    def convert(items: list[Any]) -> tuple[Any, Any]:
        frames, cls = list(zip(*items))
        buffer = stoker.io.convert_frames(frames)
        if normalize:
            return torch.from_numpy(stoker.io.normalize(buffer, MEAN, STD)), cls
        return stoker.io.to_tensor_batch(buffer), cls

    builder = PipelineBuilder().add_source(range(len(dataset))).pipe(dataset.__getitem__, concurrency=num_workers)
    builder = builder.aggregate(batch_size or 1).pipe(convert, concurrency=2, output_order="input")
    if transfer:
        builder = builder.pipe(lambda item: (item[0].cuda(), item[1]))
    pipeline = builder.add_sink(num_workers).build(num_threads=num_workers + 2)
    with torch.no_grad(), pipeline.auto_stop():
        return example.run_dataloader(pipeline, max_items)


def systems(example: ModuleType, cfg: dict[str, Any]) -> list[tuple[str, Any]]:
    out = [("torch", example.exp_torch), ("stoker", example.exp_spdl)]
    if cfg.get("normalize"):
        out.append(("stoker.io", lambda **kw: exp_stoker_io(example, **kw)))
    return out


def measure(
    example: ModuleType,
    root: str,
    cfg: dict[str, Any],
    workers: list[int],
    runs: int,
    per_run: int,
    cpu: dict[str, dict[int, float]] | None = None,
) -> dict[str, dict[int, float]]:
    """Median images/s per system and worker count; ``cpu`` (if given) gets the median CPU time per image [ms].

    The CPU time is this process's and its finished children's (the DataLoader's workers, joined when
    it ends): on a machine shared with other work it moves far less than images/s, which follows the
    share of the cores each run happened to get.
    """
    batch = cfg.get("batch_size")
    max_items = per_run if batch is None else max(1, per_run // batch)
    out: dict[str, dict[int, float]] = {name: {} for name, _ in systems(example, cfg)}
    for nw in workers:
        for name, exp in systems(example, cfg):
            rates, cpu_ms = [], []
            for _ in range(runs):
                t0 = os.times()
                n, elapsed = exp(root_dir=root, split="val", num_workers=nw, max_items=max_items, **cfg)
                t1 = os.times()
                rates.append(n / elapsed)
                cpu_ms.append(1e3 * (sum(t1[:4]) - sum(t0[:4])) / n)
            out[name][nw] = statistics.median(rates)
            if cpu is not None:
                cpu.setdefault(name, {})[nw] = statistics.median(cpu_ms)
            print(
                f"  {cfg} {name:6s} workers={nw}: {out[name][nw]:8.1f} images/s (runs: {', '.join(f'{r:.0f}' for r in rates)}), "
                f"CPU {statistics.median(cpu_ms):.2f} ms/image, load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    return out


def noop_cost(items: int = 20_000, runs: int = 3) -> dict[int, dict[str, float]]:
    """Per item: the time of a flow with 0, 1 and 4 stages that do nothing; the slope is one stage's cost."""
    from stoker.flow import PipelineBuilder

    def noop(x: Any) -> Any:
        return x

    def per_item(stages: int, conc: int) -> float:
        times = []
        for _ in range(runs):
            b = PipelineBuilder().add_source(range(items))
            for _ in range(stages):
                b = b.pipe(noop, concurrency=conc)
            pipeline = b.add_sink(16).build(num_threads=conc)
            t0 = time.perf_counter()
            n = sum(1 for _ in pipeline)
            times.append((time.perf_counter() - t0) / n)
        return statistics.median(times)

    out = {}
    for conc in (1, 8):
        t0, t1, t4 = per_item(0, conc), per_item(1, conc), per_item(4, conc)
        out[conc] = {"no_stage_us": 1e6 * t0, "one_stage_us": 1e6 * t1, "four_stages_us": 1e6 * t4, "per_stage_us": 1e6 * (t4 - t0) / 4}
    return out


def table(results: dict[str, dict[str, dict[int, float]]], workers: list[int]) -> str:
    lines = [
        "| configuration | system | " + " | ".join(f"{w} workers" for w in workers) + " | best |",
        "|---|---|" + "---:|" * (len(workers) + 1),
    ]
    for label, res in results.items():
        for name in res:
            row = [f"{res[name][w]:.0f}" for w in workers]
            lines.append(f"| {label} | {name} | " + " | ".join(row) + f" | {max(res[name].values()):.0f} |")
        for name in list(res)[1:]:
            ratio = [f"{res[name][w] / res['torch'][w]:.2f}x" for w in workers]
            best = max(res[name].values()) / max(res["torch"].values())
            lines.append(f"| {label} | {name} / torch | " + " | ".join(ratio) + f" | **{best:.2f}x** |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict[int, float]]], workers: list[int], path: Path) -> bool:
    """Images/s against workers, one panel per configuration, as seed 002's chart; ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no chart: matplotlib is not installed; pip install 'stoker[bench]')", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), squeeze=False, sharey=True)
    for ax, (label, res) in zip(axes[0], results.items()):
        for name, by_workers in res.items():
            ax.plot(workers, [by_workers[w] for w in workers], marker="o", label=name)
        ax.set_title(label, fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_xticks(workers, [str(w) for w in workers])
        ax.set_xlabel("workers")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("images/s")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("stoker.flow vs DataLoader (Pillow), 500x375 JPEG -> 224x224", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=256, help="generated JPEGs in the folder")
    parser.add_argument("--per-run", type=int, default=192, help="images per timed run (batches: this / batch size)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3, help="runs per cell; the median is reported")
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--out", type=Path, default=None, help="folder for flow.json, flow.md and flow.png")
    parser.add_argument("--root-dir", default=None, help="an existing folder (root/val/<class>/*.JPEG) instead of generated images")
    args = parser.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # more workers than CPUs: on purpose, as the seed
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    example = load_example()
    with tempfile.TemporaryDirectory(prefix="stoker-flow-bench-") as tmp:
        root = args.root_dir or example.make_image_folder(tmp, args.images)
        sizes = [p.stat().st_size for p in Path(root).rglob("*.JPEG")]
        print(
            f"{len(sizes)} JPEGs, mean {np.mean(sizes) / 1024:.0f} KB; machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            flush=True,
        )
        b = args.batch_size
        configs = {
            "decode + resize": {"batch_size": None},
            "+ batch": {"batch_size": b},
            "+ normalize": {"batch_size": b, "normalize": True},
        }
        if torch.cuda.is_available():
            configs["+ transfer"] = {"batch_size": b, "normalize": True, "transfer": True}
        first_item(example, example.exp_spdl, root_dir=root, split="val", num_workers=1, max_items=1, batch_size=None)  # compile
        checks = verify(example, root, list(configs.values()))
        for line in checks:
            print("checked", line, flush=True)
        cpu: dict[str, dict[str, dict[int, float]]] = {label: {} for label in configs}
        results = {label: measure(example, root, cfg, workers, args.runs, args.per_run, cpu[label]) for label, cfg in configs.items()}
    noop = noop_cost()
    md = [
        table(results, workers),
        "",
        "No-op stage, per item [microseconds]:",
        "",
        "| concurrency | no stage | 1 stage | 4 stages | per stage |",
        "|---:|---:|---:|---:|---:|",
    ]
    for conc, r in noop.items():
        md.append(f"| {conc} | {r['no_stage_us']:.1f} | {r['one_stage_us']:.1f} | {r['four_stages_us']:.1f} | {r['per_stage_us']:.1f} |")
    text = "\n".join(md)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "flow.md").write_text(text + "\n")
        payload = {"results": {k: {s: {str(w): v for w, v in r.items()} for s, r in res.items()} for k, res in results.items()}, "noop": noop, "checks": checks,
                   "cpu_ms_per_image": {k: {s: {str(w): v for w, v in r.items()} for s, r in res.items()} for k, res in cpu.items()},
                   "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__}}  # fmt: skip
        (args.out / "flow.json").write_text(json.dumps(payload, indent=2))
        plot(results, workers, args.out / "flow.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
