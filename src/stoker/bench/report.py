"""Turn the benchmark's results dict into markdown, JSON and (when matplotlib is installed) a bar chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stoker.bench.load import busy_note


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _rate(x: float) -> str:
    return f"{x:,.0f}"


#: names of the training table's rows
_TRAIN_LABELS = {
    "STOKER": "STOKER",
    "TORCH": "TORCH (`__getitem__` per sample, 1 worker)",
    "TORCH_BATCHED": "TORCH_BATCHED (`__getitems__` per batch, 0 workers)",
}


def _first(seconds: float | None) -> str:
    return "-" if seconds is None or seconds != seconds else _ms(seconds)


def _range(r: dict[str, Any] | None) -> str:
    if not r or not r.get("n"):
        return ""
    return f" ({r['min']:.2f}-{r['max']:.2f})"


def training_table(training: dict[str, Any]) -> str:
    """The notebook's table: Mean, Median, 0.95-Quantile per batch per system, the first batch as the user waits
    for it (from ``iter()``), and an UPLIFT (%) row per DataLoader."""
    rows = [
        "| | Mean [ms] | Median [ms] | 0.95-Quantile [ms] | samples/s | first batch, warm-up epoch [ms] | first batch of an epoch, median [ms] |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in training["systems"].items():
        label = _TRAIN_LABELS.get(name, name)
        rows.append(
            f"| {label} | {_ms(s['mean_s'])} | {_ms(s['median_s'])} | {_ms(s['q95_s'])} | {_rate(s['samples_per_s'])} "
            f"| {_first(s.get('first_batch_s'))} | {_first(s.get('epoch_first_batch_median_s'))} |"
        )
    for name, up in training["uplift_percent"].items():
        rows.append(f"| UPLIFT vs {name} (%) | {up['mean_s']:.1f} | {up['median_s']:.1f} | {up['q95_s']:.1f} | | | |")
    return "\n".join(rows)


def loading_table(loading: dict[str, Any]) -> str:
    """One row per system: median samples/s, ratios to the two limits (median of the rounds, their range), median and
    first epoch, and the first batch from ``iter()``."""
    rows = [
        "| System | median samples/s | vs numpy take (range) | vs compiled gather (range) | median epoch [ms] | first epoch [ms] "
        "| first batch [ms] |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in loading["systems"].values():
        rows.append(
            f"| {r['label']} | {_rate(r['samples_per_s'])} | {r['ratio_to_limit']:.2f}x{_range(r.get('ratio_to_limit_rounds'))} "
            f"| {r['ratio_to_compiled']:.2f}x{_range(r.get('ratio_to_compiled_rounds'))} "
            f"| {_ms(r['median_epoch_s'])} | {_ms(r['first_epoch_s'])} | {_first(r.get('first_batch_s'))} |"
        )
    return "\n".join(rows)


def verdict_lines(results: dict[str, Any]) -> list[str]:
    """The answers, one line each (a speed ratio over the rounds, its spread, the verdict), and the machine's load:
    when other work made it busy, a warning that the verdicts may be unreliable."""
    load = results["machine"].get("load")
    lines = []
    note = busy_note(load) if load else None
    if note is not None:
        lines += [note, ""]
    for v in results.get("verdicts", []):
        word = v["verdict"]
        if note is not None:
            word += " (may be unreliable: busy machine)"
        lines.append(f"- {v['what']}: **{word}**, {v['summary']}")
    if load and note is None and load.get("busy") is False:
        lines += [
            "",
            f"The machine was quiet: other work kept {load['others']:.2f} threads runnable on average "
            f"({load['cores']} cores, {load['free']:.1f} left free by this benchmark).",
        ]
    return lines


def per_batch_table(loading: dict[str, Any]) -> str:
    """Where a stoker batch's time goes, in microseconds per batch, beside the compiled gather's whole batch.

    Empty when no system reported its stages (``per_batch_us``).
    """
    systems = loading["systems"]
    compiled = systems.get("compiled_gather")
    rows = [
        "| System | wall time per batch | compiled gather's batch | compiled stages (all threads) | Python stages | loop waiting for a batch | producers waiting for the loop |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in systems.values():
        spent = r.get("per_batch_us")
        if not spent:
            continue
        batches = r["samples_per_epoch"] / r["batch"]["x"][0][0]
        wall = r["median_epoch_s"] / batches * 1e6
        limit = f"{compiled['median_epoch_s'] / batches * 1e6:.1f}" if compiled else "-"
        rows.append(
            f"| {r['label']} | {wall:.1f} | {limit} | {spent['compiled']:.1f} | {spent['python_stages']:.1f} | {spent['loop_waiting']:.1f} "
            f"| {spent['producers_waiting']:.1f} |"
        )
    return "\n".join(rows) if len(rows) > 2 else ""


def startup_table(startup: dict[str, Any]) -> str:
    """Time to first batch in a fresh process, cold and warm Numba cache."""
    rows = [
        "| Numba disk cache | import stoker.loader [s] | Loader() [s] | iter() to first batch [s] | report()'s first batch [s] "
        "| Loader() to first batch [s] | process start to first batch [s] | whole process, exit included [s] |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run, r in startup.items():
        reported = r.get("report_first_batch_s")
        rows.append(
            f"| {run} | {r['import_s']:.2f} | {r['construct_s']:.2f} | {r['first_batch_s']:.2f} "
            f"| {'-' if reported is None else f'{reported:.2f}'} | {r['construct_to_first_batch_s']:.2f} "
            f"| {r['start_to_first_batch_s']:.2f} | {r['process_s']:.2f} |"
        )
    return "\n".join(rows)


def to_markdown(results: dict[str, Any]) -> str:
    """The whole report as markdown (what ``stoker bench`` prints)."""
    m, c, d = results["machine"], results["config"], results["dataset"]
    rounds = c.get("rounds", 1)
    loadavg = m["loadavg_1min"]
    top = f"Load average (1 min) at start/end: {loadavg['start']:.2f}/{loadavg['end']:.2f}"
    if "max" in loadavg:
        top += f", at most {loadavg['max']:.2f}"
    parts = [
        "# stoker bench: Otto",
        "",
        f"Machine: {m['cpu_count']} CPUs, {m['platform']}, Python {m['python']}, torch {m['torch']}, numpy {m['numpy']}, "
        f"numba {m['numba']}, CUDA: {m['cuda']}. Date: {m['date']}. {top}.",
        f"Dataset: {d['num_samples']:,} x {d['num_features']} float32 + int64 label ({d['file_bytes'] / 2**20:.1f} MiB stoker file), "
        f"batch size {c['batch_size']}, random order, drop_last.",
    ]
    answers = verdict_lines(results)
    if answers:
        parts += [
            "",
            f"## Verdicts (speed ratios of {rounds} alternating rounds: median, quartiles, range)",
            "",
            *answers,
        ]
    parts += [
        "",
        f"## Training ({results['training']['device']}, {c['train_epochs']} timed epochs after 1 warm-up in {rounds} alternating "
        f"rounds, first {results['training']['skip_batches']} batches of each epoch not timed)",
        "",
        "Time between consecutive batches of a training loop (forward, loss, backward, Adam step). "
        f"DataLoader: 1 worker as in the notebook (kept between epochs); stoker: {c['num_workers']} worker{'s' if c['num_workers'] != 1 else ''}. "
        "First batch: from `iter()` to the batch in hand, as a user waits for it.",
        "",
        training_table(results["training"]),
        "",
        "Median speed-up (DataLoader's median step / STOKER's, round by round; median of the rounds and their range): "
        + ", ".join(
            f"{name} {v:.2f}x{_range(results['training'].get('speedup_rounds', {}).get(name))}"
            for name, v in results["training"]["speedup_median"].items()
        )
        + ".",
        "",
        f"## Loading only ({c['load_epochs']} epochs after the first, per-sample DataLoader {c['slow_epochs']}, in {rounds} "
        "alternating rounds; ratios: median of the rounds (range))",
        "",
        loading_table(results["loading"]),
    ]
    spent = per_batch_table(results["loading"])
    if spent:
        round_trip = m.get("thread_round_trip_us")
        parts += [
            "",
            "Where a stoker batch's time goes [microseconds per batch, timed epochs]: compiled stages and Python stages are "
            "summed over the threads that made batches (producers and, when none was ready, the loop; they overlap), the waits are measured on either side of the hand-over.",
            "",
            spent,
        ]
        if round_trip and round_trip.get("same_cpu") is not None:
            same, two = round_trip["same_cpu"], round_trip.get("two_cpus")
            if two is not None:
                line = (
                    f"Two threads passing an object there and back through queues take {two:.0f} microseconds between two "
                    f"CPUs and {same:.0f} on one (medians, this machine): a batch handed to a loop that sleeps waiting for "
                    "it costs about half of the first."
                )
            else:
                line = f"Two threads passing an object there and back through queues take {same:.0f} microseconds (one CPU, median)."
            parts += ["", line]
    if results.get("startup"):
        parts += ["", "## Time to first batch (fresh process)", "", startup_table(results["startup"])]
    parts += [
        "",
        "Every system was timed in alternating rounds (each system once a round, the order reversed every other round), "
        "and each ratio is taken within a round, where both systems saw the same load. "
        "Every system's batches were checked before any time was reported: shape and dtype of every batch; in an untimed "
        "random-order epoch, each kept (row, label) pair of the dataset exactly once (64-bit fingerprints of the bits); "
        "in file order, the first batches equal to the dataset's rows and labels bit for bit; in training, the warm-up "
        "epoch's samples checked the same way.",
    ]
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
    names = list(tr)
    colors = ["tab:orange" if n == "STOKER" else "tab:blue" for n in names]
    axes[0].bar(names, [tr[n]["median_s"] * 1e3 for n in names], color=colors)
    axes[0].set_ylabel("median time per batch [ms]")
    axes[0].set_title("Training: batch time")
    axes[1].bar(names, [tr[n]["samples_per_s"] for n in names], color=colors)
    axes[1].set_ylabel("samples/s")
    axes[1].set_title("Training: throughput")
    limits = ("numpy_take", "compiled_gather")
    bar_colors = ["tab:orange" if r["key"].startswith("stoker") else "tab:gray" if r["key"] in limits else "tab:blue" for r in ld]
    pos = list(range(len(ld)))[::-1]  # first system on top
    axes[2].barh(pos, [r["samples_per_s"] for r in ld], color=bar_colors)
    axes[2].set_yticks(pos, [r["label"] for r in ld], fontsize=8)
    axes[2].set_xscale("log")
    axes[2].set_xlabel("samples/s (median epoch, log scale)")
    axes[2].set_title("Loading only (ratio to numpy take / to the compiled gather)")
    for p, r in zip(pos, ld):
        axes[2].annotate(
            f" {r['ratio_to_limit']:.2f}x / {r['ratio_to_compiled']:.2f}x", (r["samples_per_s"], p), ha="left", va="center", fontsize=8
        )
    axes[2].set_xlim(right=max(r["samples_per_s"] for r in ld) * 4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def matplotlib_missing() -> str | None:
    """``None`` when matplotlib can be imported, else a one-line note saying how to install it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "no chart: matplotlib is not installed (pip install 'stoker[bench]' or pip install matplotlib)"
    return None


def write_outputs(results: dict[str, Any], out: Path) -> dict[str, Path | None]:
    """Write ``otto.json`` and ``otto.md`` into ``out``, and ``otto.png`` when matplotlib is installed.

    Returns:
        The paths written, by kind; ``"chart"`` is ``None`` without matplotlib
        (see :func:`matplotlib_missing` for the note to show).
    """
    paths: dict[str, Path | None] = {"json": out / "otto.json", "markdown": out / "otto.md", "chart": None}
    (out / "otto.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "otto.md").write_text(to_markdown(results))
    chart = out / "otto.png"
    if matplotlib_missing() is None:
        paths["chart"] = chart
        write_chart(results, chart)
    else:
        chart.unlink(missing_ok=True)  # a chart left by an earlier run would not match these results
    return paths
