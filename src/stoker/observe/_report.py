"""From a :class:`~stoker.observe._recorder.Recorder` to figures (a plain dict) and to a few lines of text."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from stoker.observe._recorder import (
    DATA_BOUND_SHARE,
    EPOCH,
    HANDOVER,
    M_DONE,
    MARK_FIXED,
    OVERHEAD,
    STEP_FIXED,
    T_ENTER,
    T_EXIT,
    Recorder,
    attribute,
)

_NS = 1e-9


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def _compiling(s: dict[str, Any]) -> str:
    """``, N s of it compiling`` when the first batch waited for the compiler (stoker's code, any thread), else nothing."""
    seconds = s.get("first_compile_s", 0.0)
    return f", {seconds:.2f} s of it compiling" if seconds >= 0.01 else ""


def summarize(rec: Recorder) -> dict[str, Any]:
    """The figures of one Loader or flow (the structure documented in ``docs/observability.md``)."""
    rec.fold()
    s, m = rec.recent()
    with rec.lock:
        stall_s, step_s = rec.stall_ns * _NS, rec.step_ns * _NS
        batches = rec.total_steps
        comp_stall = dict(rec.comp_stall)
        comp_time, comp_items, info = dict(rec.comp_time), dict(rec.comp_items), dict(rec.comp_info)
        wall_s = (rec.last_exit - rec.first_enter) * _NS if rec.first_enter is not None else 0.0
        waited = rec.waited
        first_s, first_next_s = rec.first_batch_ns * _NS, rec.first_next_ns * _NS  # (from the first iter(); its next() alone)
        first_compile_s = rec.first_compile_ns * _NS
    busy = stall_s + step_s
    # next() waiting for the device (a loader that copies to CUDA): the GPU's time, not the loader's
    device_names = [n for n, c in info.items() if c.kind == "device" and n in comp_stall]
    device_s = sum(comp_stall[n] for n in device_names) * _NS
    stall_s = max(0.0, stall_s - device_s)
    share = stall_s / busy if busy > 0 else 0.0
    a = attribute(s, m) if len(s) else None
    stall_ms = a["stall"] * 1e-6 if a is not None else np.zeros(0)
    device_cols = [STEP_FIXED + k for k, c in enumerate(rec.loop) if c.kind == "device"]
    if a is not None and device_cols:
        stall_ms = np.maximum(stall_ms - s[:, device_cols].sum(axis=1) * 1e-6, 0)
    prev_exit = np.concatenate(([0], s[:-1, T_EXIT])) if len(s) else np.zeros(0, np.int64)
    same = np.concatenate(([False], s[1:, EPOCH] == s[:-1, EPOCH])) if len(s) else np.zeros(0, bool)
    step_ms = (s[same, T_ENTER] - prev_exit[same]) * 1e-6 if len(s) else np.zeros(0)
    done = m[:, M_DONE] if len(m) else np.zeros(0, np.int64)
    queue_ms = np.maximum(s[done > 0, T_ENTER] - done[done > 0], 0) * 1e-6 if len(s) else np.zeros(0)
    flow_durations = rec.durations() if rec.durations is not None else {}
    stages: dict[str, dict[str, Any]] = {}
    recent_by_name: dict[str, np.ndarray] = {}
    for k, comp in enumerate(rec.producer):
        recent_by_name[comp.name] = m[:, MARK_FIXED + k] * 1e-6
    for k, comp in enumerate(rec.loop):
        recent_by_name[comp.name] = s[:, STEP_FIXED + k] * 1e-6
    for name, ns in comp_stall.items():
        c = info.get(name)
        entry: dict[str, Any] = {
            "kind": c.kind if c is not None else ("hand-over" if name == HANDOVER else "overhead"),
            "side": c.side if c is not None else "loop",
            "field": c.field if c is not None else "",
            "stall_s": ns * _NS,
            "stall_share": ns * _NS / stall_s if stall_s > 0 else 0.0,
        }
        if name in device_names:  # (its share of the loop's time, not of the waiting for data)
            entry["stall_share"] = ns * _NS / busy if busy > 0 else 0.0
        if name in flow_durations:
            items, mean_s, p50_s, p95_s = flow_durations[name]
            entry.update(items=int(items), mean_ms=mean_s * 1e3, p50_ms=p50_s * 1e3, p95_ms=p95_s * 1e3)
        elif name in comp_items and c is not None and c.kind != "stage":
            recent = recent_by_name.get(name, np.zeros(0))
            items = comp_items[name]
            entry.update(
                items=int(items),
                mean_ms=comp_time[name] * 1e-6 / items if items else math.nan,
                p50_ms=_pct(recent, 50),
                p95_ms=_pct(recent, 95),
            )
        stages[name] = entry
    ranked = sorted(stages, key=lambda n: stages[n]["stall_s"], reverse=True)
    data_stages = [n for n in ranked if n not in device_names]
    bottleneck = data_stages[0] if data_stages and stages[data_stages[0]]["stall_s"] > 0 else None
    data_bound = share >= DATA_BOUND_SHARE
    out: dict[str, Any] = {
        "source": rec.label,
        "kind": rec.kind,
        "batches": int(batches),
        "batches_waited": int(waited),
        "first_batch_s": first_s,
        "first_next_s": first_next_s,
        "first_compile_s": first_compile_s,
        "wall_s": wall_s,
        "stall_s": stall_s,
        "step_s": step_s,
        "stall_share": share,
        "device_s": device_s,
        "device_share": device_s / busy if busy > 0 else 0.0,
        "data_bound": data_bound,
        "verdict": "data-bound" if data_bound else "not data-bound",
        "data_bound_threshold_share": DATA_BOUND_SHARE,
        "stall_p50_ms": _pct(stall_ms, 50),
        "stall_p95_ms": _pct(stall_ms, 95),
        "step_p50_ms": _pct(step_ms, 50),
        "step_p95_ms": _pct(step_ms, 95),
        "queue_p50_ms": _pct(queue_ms, 50),
        "stages": {n: stages[n] for n in ranked},
        "bottleneck": bottleneck,
    }
    out["suggestion"] = suggestion(out, rec.context)
    return out


def suggestion(summary: dict[str, Any], context: dict[str, Any]) -> str:
    """One concrete change that follows from the figures (and the owner's settings in ``context``).

    ``context`` is what the owner knows of itself: ``num_workers``, ``cpus`` (those this process may use),
    ``batches_ahead``, ``os_cache``, ``verify``, ``remote`` and ``download_ahead`` (a dataset in object
    storage), ``forms`` (what each Python component is: see ``stoker.loader._accounting.forms``) and, for a
    flow, ``concurrency``. Each suggestion is tested against the situation it names (``tests/observe/test_advice.py``).
    """
    share = summary["stall_share"]
    if summary["batches"] == 0:
        return "no batch has been handed to the loop yet"
    if not summary["data_bound"]:
        if summary.get("device_share", 0.0) >= DATA_BOUND_SHARE:
            return (
                f"none needed for the input: next() waited {summary['device_share']:.0%} of the loop's time for the GPU, "
                "which is behind (GPU-bound): a faster step on the GPU is what speeds training up"
            )
        return (
            f"none needed for the input: the loop waits {share:.0%} of its time; a faster step (model, optimizer, "
            "logging) is what speeds training up"
        )
    name = summary["bottleneck"]
    stage = summary["stages"].get(name, {}) if name else {}
    kind, side = stage.get("kind", ""), stage.get("side", "")
    form = context.get("forms", {}).get(name, "")
    workers, cpus, ahead = context.get("num_workers"), context.get("cpus"), context.get("batches_ahead")
    idle_cpus = workers is not None and cpus is not None and workers < cpus
    if name == HANDOVER:
        more = f", or num_workers (now {workers}; this process may use {cpus} CPUs)" if idle_cpus else ""
        return f"batches finish just after the loop asks for them: raise batches_ahead (now {ahead}) so that they are ready sooner{more}"
    if name == OVERHEAD:
        return "the loader's own work per batch dominates: use larger batches"
    if kind == "read":
        if context.get("remote"):
            return (
                f"waiting for shards from the store dominates: raise download_ahead (now {context.get('download_ahead')}) with a "
                "cache_limit that holds those shards, and read in QUASI_RANDOM order (stats()['remote'] counts the downloads)"
            )
        if context.get("os_cache") is False:
            return "reading into the bounded cache dominates: os_cache=True if the dataset fits in RAM, else a faster disk (local NVMe)"
        # (with the file memory-mapped, reading is page faults inside the compiled heads: "read" is the data check)
        return (
            "checking data blocks against their CRCs dominates (each block once per process, the first time a batch "
            "reads it: it stops once every block is checked); check_data=False skips it for storage you trust"
        )
    if kind == "compiled":
        if idle_cpus:
            return f"raise num_workers (now {workers}; this process may use {cpus} CPUs): '{name}' runs on them"
        if "Image" in name or "Crop" in name:
            return (
                f"'{name}' uses every CPU: store smaller images (a lower max_resolution when writing) or decode "
                "a smaller crop; more CPUs help too"
            )
        return f"'{name}' uses every CPU ({workers} workers): make it cheaper, or run on more CPUs"
    if kind == "python" and side == "producer":
        if form == "uncompiled":
            return (
                f"'{name}' runs as Python because compiling is off (compile=False or Compiler.disabled(), meant for "
                "debugging): build the Loader with compiling on"
            )
        return (
            f"'{name}' is a decoder that runs as Python on the producer threads, one call per batch: make it cheaper, "
            "or write it as a compiled decoder (docs/loader.md, 'Custom decoders')"
        )
    if kind == "python":
        if form.startswith("movable"):
            where = "on the GPU, queued from" if form == "movable on the GPU" else "with torch on"
            cost = " (the copy to the GPU then carries its float output instead of uint8)" if form == "movable on the GPU" else ""
            return (
                f"'{name}' runs after ToTensor, {where} the loop's thread inside next(): place it before ToTensor, "
                f"where it runs compiled in the field's head, on producer threads ahead of the loop{cost}"
            )
        if form == "operation":
            return (
                f"'{name}' runs as Python inside next(), on the loop's thread: make it cheaper, or do its work in a "
                "compiled operation before ToTensor, which producer threads run ahead of the loop"
            )
        return (
            f"'{name}' runs as Python inside next(), on the loop's thread: make it a compiled operation "
            "(stoker.pipeline.Operation, placed before ToTensor), so that producer threads run it ahead of the loop"
        )
    if kind == "copy":
        return (
            "the host-to-device copy dominates: copy fewer bytes (uint8 images, normalised on the device by a "
            "NormalizeImage placed after ToDevice)"
        )
    if kind == "stage":
        conc = context.get("concurrency", {}).get(name)
        return f"give stage '{name}' more concurrency (now {conc}) and num_threads, or make it cheaper"
    if kind == "source":
        return "the flow's source is the slowest part: make it cheaper, or feed the flow from a stoker Loader"
    return f"'{name}' causes most of the waiting: make it cheaper"


def render(summary: dict[str, Any], ranks: list[dict[str, Any]] | None = None) -> str:
    """A few lines of text: the share waited, the verdict, the stage that caused it, a suggestion."""
    s = summary
    unit = "items" if s["kind"] == "flow" else "batches"
    lines = [
        f"{s['source']}: {s['batches']} {unit} in {s['wall_s']:.2f} s after the first (which took {s['first_batch_s']:.2f} s from iter(){_compiling(s)}); the loop waited for data {s['stall_share']:.0%} of its time "
        f"({s['stall_s']:.2f} s waiting, {s['step_s']:.2f} s in its steps)",
        f"verdict: {s['verdict']} (data-bound: the loop waits >= {s['data_bound_threshold_share']:.0%} of its time); per step: "
        f"wait p50 {_ms(s['stall_p50_ms'])}, p95 {_ms(s['stall_p95_ms'])}; step p50 {_ms(s['step_p50_ms'])}, p95 {_ms(s['step_p95_ms'])}",
    ]
    if s.get("device_s", 0.0) > 0:
        lines.append(
            f"blocked on the device: next() waited for the GPU {s['device_share']:.0%} of the loop's time ({s['device_s']:.2f} s): "
            "a copy out of a batch's page-locked memory was still queued behind the GPU's work (the GPU's time, not the loader's)"
        )
    name = s["bottleneck"]
    if name is not None:
        st = s["stages"][name]
        where = f"{st['kind']}, " + ("on producer threads" if st["side"] == "producer" else "on the loop's thread")
        if s["kind"] == "flow":
            where = "a stage of the flow" if st["kind"] == "stage" else "the flow's source"
        per = (
            f"; per {'item' if s['kind'] == 'flow' else 'batch'} p50 {_ms(st['p50_ms'])}, p95 {_ms(st['p95_ms'])}" if "p50_ms" in st else ""
        )
        lines.append(f"most waiting: {name} ({where}): {st['stall_share']:.0%} of the waiting ({st['stall_s']:.2f} s){per}")
        others = [
            f"{n} {v['stall_share']:.0%}" for n, v in s["stages"].items() if n != name and v["kind"] != "device" and v["stall_s"] > 0
        ][:3]
        if others:
            lines.append("then: " + ", ".join(others))
    lines.append(f"suggestion: {s['suggestion']}")
    if ranks:
        worst = max(ranks, key=lambda r: r["stall_share"])
        median = float(np.median([r["stall_share"] for r in ranks]))
        lines.append(
            f"ranks: {len(ranks)}; rank {worst['rank']} waits most ({worst['stall_share']:.0%} of its time; median of the ranks "
            f"{median:.0%}; its bottleneck: {worst['bottleneck']}): a straggler holds every rank back"
        )
    return "\n".join(lines)


def _ms(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f} ms"


def gather(summary: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's key figures, in one collective call (``None`` when ``torch.distributed`` is not initialised).

    Every rank must call it (``report(gather=True)`` on every rank), as any collective.
    """
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mine = {
        "rank": dist.get_rank(),
        "stall_share": summary["stall_share"],
        "stall_s": summary["stall_s"],
        "batches": summary["batches"],
        "bottleneck": summary["bottleneck"],
    }
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out
