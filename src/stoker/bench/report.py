"""Turn the benchmark's results dict into markdown, JSON and a bar chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _rate(x: float) -> str:
    return f"{x:,.0f}"


def training_table(training: dict[str, Any]) -> str:
    """The notebook's table: Mean, Median, 0.95-Quantile per batch for STOKER, TORCH and UPLIFT (%)."""
    rows = ["| | Mean [ms] | Median [ms] | 0.95-Quantile [ms] | samples/s |", "|---|---:|---:|---:|---:|"]
    for name in ("STOKER", "TORCH"):
        s = training["systems"][name]
        rows.append(f"| {name} | {_ms(s['mean_s'])} | {_ms(s['median_s'])} | {_ms(s['q95_s'])} | {_rate(s['samples_per_s'])} |")
    up = training["uplift_percent"]
    rows.append(f"| UPLIFT (%) | {up['mean_s']:.1f} | {up['median_s']:.1f} | {up['q95_s']:.1f} | |")
    return "\n".join(rows)


def loading_table(loading: dict[str, Any]) -> str:
    """One row per system: median samples/s, median and first epoch, ratio to the numpy limit."""
    rows = [
        "| System | median samples/s | vs numpy limit | median epoch [ms] | first epoch [ms] |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in loading["systems"].values():
        rows.append(
            f"| {r['label']} | {_rate(r['samples_per_s'])} | {r['ratio_to_limit']:.2f}x | {_ms(r['median_epoch_s'])} | {_ms(r['first_epoch_s'])} |"
        )
    return "\n".join(rows)


def startup_table(startup: dict[str, Any]) -> str:
    """Time to first batch in a fresh process, cold and warm Numba cache."""
    rows = [
        "| Numba disk cache | import stoker.loader [s] | Loader() [s] | first batch [s] | Loader() to first batch [s] | whole process [s] |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for run, r in startup.items():
        rows.append(
            f"| {run} | {r['import_s']:.2f} | {r['construct_s']:.2f} | {r['first_batch_s']:.2f} | {r['construct_to_first_batch_s']:.2f} | {r['process_s']:.2f} |"
        )
    return "\n".join(rows)


def to_markdown(results: dict[str, Any]) -> str:
    """The whole report as markdown (what ``stoker bench`` prints)."""
    m, c, d = results["machine"], results["config"], results["dataset"]
    parts = [
        "# stoker bench: Otto",
        "",
        f"Machine: {m['cpu_count']} CPUs, {m['platform']}, Python {m['python']}, torch {m['torch']}, numpy {m['numpy']}, "
        f"numba {m['numba']}, CUDA: {m['cuda']}. Date: {m['date']}. "
        f"Load average (1 min) at start/end: {m['loadavg_1min']['start']:.2f}/{m['loadavg_1min']['end']:.2f}.",
        f"Dataset: {d['num_samples']:,} x {d['num_features']} float32 + int64 label ({d['file_bytes'] / 2**20:.1f} MiB stoker file), "
        f"batch size {c['batch_size']}, random order, drop_last.",
        "",
        f"## Training ({results['training']['device']}, {c['train_epochs']} timed epochs after 1 warm-up, first "
        f"{results['training']['skip_batches']} batches of each epoch not timed)",
        "",
        "Time between consecutive batches of a training loop (forward, loss, backward, Adam step). "
        f"DataLoader: 1 worker as in the notebook; stoker: {c['num_workers']} worker{'s' if c['num_workers'] != 1 else ''}.",
        "",
        training_table(results["training"]),
        "",
        f"Median speed-up (TORCH / STOKER): {results['training']['speedup_median']:.2f}x.",
        "",
        f"## Loading only ({c['load_epochs']} epochs after the first; per-sample DataLoader: {c['slow_epochs']})",
        "",
        loading_table(results["loading"]),
    ]
    if results.get("startup"):
        parts += ["", "## Time to first batch (fresh process)", "", startup_table(results["startup"])]
    parts += ["", "Every system's batches were checked (shape, dtype, each kept sample exactly once per epoch) before timing was reported."]
    return "\n".join(parts) + "\n"


def write_chart(results: dict[str, Any], path: Path) -> None:
    """Bar charts: training median batch time and samples/s, loading samples/s (PNG, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = results["training"]["systems"]
    ld = list(results["loading"]["systems"].values())
    fig, mosaic = plt.subplot_mosaic([["time", "rate"], ["load", "load"]], figsize=(11, 8), height_ratios=[1, 1.1])
    axes = [mosaic["time"], mosaic["rate"], mosaic["load"]]
    names = ["STOKER", "TORCH"]
    colors = ["tab:orange", "tab:blue"]
    axes[0].bar(names, [tr[n]["median_s"] * 1e3 for n in names], color=colors)
    axes[0].set_ylabel("median time per batch [ms]")
    axes[0].set_title("Training: batch time")
    axes[1].bar(names, [tr[n]["samples_per_s"] for n in names], color=colors)
    axes[1].set_ylabel("samples/s")
    axes[1].set_title("Training: throughput")
    bar_colors = ["tab:orange" if r["key"].startswith("stoker") else "tab:gray" if r["key"] == "numpy_take" else "tab:blue" for r in ld]
    pos = list(range(len(ld)))[::-1]  # first system on top
    axes[2].barh(pos, [r["samples_per_s"] for r in ld], color=bar_colors)
    axes[2].set_yticks(pos, [r["label"] for r in ld], fontsize=8)
    axes[2].set_xscale("log")
    axes[2].set_xlabel("samples/s (median epoch, log scale)")
    axes[2].set_title("Loading only (ratio to the numpy limit)")
    for p, r in zip(pos, ld):
        axes[2].annotate(f" {r['ratio_to_limit']:.2f}x", (r["samples_per_s"], p), ha="left", va="center", fontsize=8)
    axes[2].set_xlim(right=max(r["samples_per_s"] for r in ld) * 4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write ``otto.json``, ``otto.md`` and ``otto.png`` into ``out``.

    Returns:
        The paths written, by kind.
    """
    paths = {"json": out / "otto.json", "markdown": out / "otto.md", "chart": out / "otto.png"}
    paths["json"].write_text(json.dumps(results, indent=2) + "\n")
    paths["markdown"].write_text(to_markdown(results))
    write_chart(results, paths["chart"])
    return paths
