"""Where the Loader's time goes: ``stats()``, ``report()``, ``trace()``, and the warning about batches kept.

``stats()`` sums what producers and the loop measured (per field and stage, the waits on either side) beside the
step accounting's summary (:mod:`stoker.observe`), a dataset in object storage's counters and a mix's per-stream
figures; ``report()`` says the same in a few lines; ``trace()`` streams a timeline. Functions of the Loader
(:class:`~stoker.loader._view.LoaderView`); its methods of the same names call them.
"""

from __future__ import annotations

import os
import warnings
from contextlib import AbstractContextManager
from typing import Any

from stoker.loader import _mix
from stoker.loader._graph import FieldPipeline
from stoker.loader._view import LoaderView
from stoker.observe import _report, _trace

#: kept batches (slots given fresh memory because the user still held them) before a warning
HELD_BATCHES_WARNING = 128
STATS_SECTIONS = ("loader", "accounting", "remote", "mix")  # stats()'s keys that are not fields (a field of such a name: "field:<name>")


class HeldBatchesWarning(UserWarning):
    """Many batches were still held by the user when their memory was due for reuse."""


def counters(
    pipelines: list[FieldPipeline], producers: int
) -> tuple[list[dict[str, dict[str, float]]], list[dict[str, float]], dict[str, dict[str, float]]]:
    """The seconds of each field's stages per producer, each producer's waits, and the stages' seconds of batches the
    loop's own thread made (compiled epochs: while it waited, batches no producer had started).

    Every key is created here: producers only add to values, so :func:`stats` can read them while an epoch runs.
    """
    seconds = [{p.name: dict.fromkeys(p.stage_names, 0.0) for p in pipelines} for _ in range(producers)]
    waits = [{"producer_waiting_for_consumer": 0.0} for _ in range(producers)]
    return seconds, waits, {p.name: dict.fromkeys(p.stage_names, 0.0) for p in pipelines}


def note_held(loader: LoaderView) -> None:
    """Consumer side, at the start of ``next()``: warn once when kept batches keep piling up."""
    if not loader._warned_held and loader._held[0] >= HELD_BATCHES_WARNING:
        loader._warned_held = True
        warnings.warn(
            f"{loader._held[0]} batches were still in use when the loader was about to reuse their memory; each got fresh "
            "memory (a kept batch is never overwritten), so memory grows with every batch kept. Keep only what you "
            "need (e.g. model outputs, or .clone() a slice) if this is not on purpose",
            HeldBatchesWarning,
            stacklevel=4,
        )


def stats(loader: LoaderView) -> dict[str, dict[str, Any]]:
    """``Loader.stats``: seconds per field and stage, the waits, the accounting, a store's and a mix's figures."""
    key = {p.name: f"field:{p.name}" if p.name in STATS_SECTIONS else p.name for p in loader.pipelines}
    out: dict[str, dict[str, Any]] = {k: {} for k in key.values()}
    for producer in [*loader._producer_seconds, loader._loop_seconds]:
        for field, stages in producer.items():
            for stage, seconds in list(stages.items()):
                out[key[field]][stage] = out[key[field]].get(stage, 0.0) + seconds
    waits = dict(loader.wait_seconds)
    transfer = loader._transfer
    waits["consumer_waiting_for_device"] = transfer.waited_ns / 1e9 if transfer is not None else 0.0
    waits["producer_waiting_for_consumer"] = sum(w["producer_waiting_for_consumer"] for w in loader._producer_wait)
    waits["kept_batches"] = float(loader._held[0])
    waits["batches_made_by_loop"] = float(loader._made_by_loop[0])
    tuned = loader._tuner.last  # the last epoch's run-time choice (_tuning): its producers, its batches ahead in all (nan: none yet)
    waits["producers_last_epoch"] = float(tuned.producers) if tuned is not None else float("nan")
    waits["batches_ahead_last_epoch"] = float(tuned.producers * tuned.ahead) if tuned is not None else float("nan")
    out["loader"] = waits
    out["accounting"] = _report.summarize(loader._recorder) if loader._recorder is not None else {}
    if loader.remote is not None:  # a dataset in object storage: downloads, cache hits, retries, the cache's size [bytes]
        out["remote"] = loader.remote.stats()
    if loader._mix is not None:  # per stream: samples handed out, the time measured for it (see docs/mixing.md)
        out["mix"] = _mix.stats(loader._mix, loader._position[0])
        if loader.remote is not None:
            out["remote"]["streams"] = {name: {k[7:]: v for k, v in row.items() if k.startswith("remote_")}
                                        for name, row in out["mix"].items() if "remote_downloads" in row}  # fmt: skip
    return out


def report(loader: LoaderView, gather: bool) -> str:
    """``Loader.report``: the accounting's verdict in a few lines, a mix's and a store's lines after it."""
    if loader._recorder is None:
        return f"{loader!r}: accounting is off (STOKER_ACCOUNTING=0)"
    summary = _report.summarize(loader._recorder)
    text = _report.render(summary, _report.gather(summary) if gather else None)
    switched = loader._plan.switched if loader._plan is not None else None
    if switched is not None:  # a new install's first epoch: Python producers until the loop had compiled in the background
        epoch, batch, seconds = switched
        text = text.rstrip("\n") + (
            f"\nswitched to the compiled producer loop at batch {batch} of epoch {epoch}, {seconds:.2f} s after its iter() "
            "(compiled in the background meanwhile; the batches before it were made by Python producers)"
        )
    tuning = loader._tuner.describe()  # the last epoch's producers and batches ahead, chosen at run time, and why
    if tuning is not None:
        text = text.rstrip("\n") + "\n" + tuning
    if loader._mix is not None:
        text = text.rstrip("\n") + "\n" + _mix.report_lines(loader._mix, loader._position[0])
    if loader.remote is not None:  # a dataset in a store: its downloads and the retries of its faults
        text = text.rstrip("\n") + "\n" + loader.remote.summary()
    return text


def trace(loader: LoaderView, path: str | os.PathLike[str]) -> AbstractContextManager[None]:
    """``Loader.trace``: a timeline of the loader's recorder, streamed to ``path`` while the block runs."""
    return _trace.tracing(loader._recorder, path)
