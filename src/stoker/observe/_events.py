"""Trace events as JSON text: a recorder's folded rows and single spans, formatted off the loop's thread.

The trace's writer thread (:mod:`~stoker.observe._trace`) calls these on what the
recorders and the hooks queued. Each event is one line of Chrome trace-event JSON
(``"ph": "X"``: a complete span, ``ts`` and ``dur`` in microseconds since the trace
started; ``"ph": "M"``: a track's name). Rows are turned into spans with numpy, a
column at a time; only the final ``str`` formatting runs per event.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from stoker.observe._recorder import (
    BATCH,
    EPOCH,
    LOOP_MADE,
    M_DONE,
    M_START,
    MAKER,
    MARK_FIXED,
    STEP_FIXED,
    T_ENTER,
    T_EXIT,
    T_READY,
)

#: ``(key, track name) -> tid``: the session's track for a key (named the first time it is asked for)
Tracks = Callable[[Any, str], int]


@dataclass(frozen=True)
class Rows:
    """Copies of a recorder's folded rows, with what is needed to name their spans (taken at fold time).

    Attributes:
        owner: the recorder's ``id`` (its tracks' keys).
        label: the recorder's label (``"Loader('data.stoker', batch_size=512)"``).
        steps: step rows (``T_ENTER`` ... and the loop-side components' times) [ns].
        marks: mark rows (``M_START``, ``M_DONE`` and the producer-side components' times) [ns].
        prev_exit: ``T_EXIT`` of the step before the first row (0: none) [ns].
        prev_epoch: the epoch of the step before the first row.
        loop: ``(name, kind)`` of each loop-side component (the step rows' extra columns).
        producer: ``(name, kind)`` of each producer-side component (the mark rows' extra columns).
        tracks: the recorder's producer track names by ``MAKER``.
    """

    owner: int
    label: str
    steps: np.ndarray
    marks: np.ndarray
    prev_exit: int
    prev_epoch: int
    loop: tuple[tuple[str, str], ...]
    producer: tuple[tuple[str, str], ...]
    tracks: dict[int, str]

    @property
    def cost(self) -> int:
        """About how many events these rows make (what the session's bound on queued work counts)."""
        return len(self.steps) * (3 + len(self.loop) + len(self.producer))


def pieces(rows_: Rows, size: int) -> list[Rows]:
    """``rows_`` cut into pieces of at most ``size`` rows (formatted one at a time: the text of a piece is what the
    writer holds at once)."""
    out = []
    for i in range(0, len(rows_.steps), size):
        prev_exit = rows_.prev_exit if i == 0 else int(rows_.steps[i - 1, T_EXIT])
        prev_epoch = rows_.prev_epoch if i == 0 else int(rows_.steps[i - 1, EPOCH])
        out.append(
            replace(rows_, steps=rows_.steps[i : i + size], marks=rows_.marks[i : i + size], prev_exit=prev_exit, prev_epoch=prev_epoch)
        )
    return out


def metadata(pid: int, tid: int, name: str) -> list[str]:
    """The two metadata events of a new track: its name and its place (tracks in the order they appeared)."""
    return [
        f'{{"name":"thread_name","ph":"M","pid":{pid},"tid":{tid},"args":{{"name":{json.dumps(name)}}}}}',
        f'{{"name":"thread_sort_index","ph":"M","pid":{pid},"tid":{tid},"args":{{"sort_index":{tid}}}}}',
    ]


def process_name(pid: int) -> str:
    return f'{{"name":"process_name","ph":"M","pid":{pid},"tid":0,"args":{{"name":"stoker"}}}}'


def span(pid: int, tid: int, name: str, cat: str, start_us: float, dur_us: float, args: dict[str, Any] | None) -> str:
    """One complete event (``ts`` and ``dur`` in microseconds)."""
    extra = f',"args":{json.dumps(args, default=repr)}' if args else ""
    return (
        f'{{"name":{json.dumps(name)},"cat":{json.dumps(cat)},"ph":"X","ts":{start_us:.3f},"dur":{dur_us:.3f},'
        f'"pid":{pid},"tid":{tid}{extra}}}'
    )


def _spans(out: list[str], pid: int, tid: int, name: str, cat: str, start: np.ndarray, end: np.ndarray, t0: int) -> None:
    """Spans of one name on one track (``start``/``end`` [ns])."""
    head = f'{{"name":{json.dumps(name)},"cat":{json.dumps(cat)},"ph":"X","ts":'
    tail = f',"pid":{pid},"tid":{tid}}}'
    ts = ((start - t0) / 1e3).tolist()
    dur = (np.maximum(end - start, 0) / 1e3).tolist()
    out.extend([f'{head}{a:.3f},"dur":{d:.3f}{tail}' for a, d in zip(ts, dur, strict=True)])


def rows(rows_: Rows, t0: int, pid: int, track: Tracks) -> list[str]:
    """The spans of folded rows (the loop's waits, steps and Python stages; each batch on its maker's track).

    Rows whose ``next()`` started before the trace (``T_ENTER < t0``) are left out.
    """
    s, m = rows_.steps, rows_.marks
    out: list[str] = []
    if len(s) == 0:
        return out
    t_enter, t_ready, t_exit = s[:, T_ENTER], s[:, T_READY], s[:, T_EXIT]
    batch, epoch = s[:, BATCH], s[:, EPOCH]
    prev_exit = np.concatenate(([rows_.prev_exit], t_exit[:-1]))
    prev_epoch = np.concatenate(([rows_.prev_epoch], epoch[:-1]))
    inside = t_enter >= t0
    loop = track((rows_.owner, "loop"), f"{rows_.label}: the loop (waits, steps, Python stages)")
    # the loop's track: the step before each next() (same epoch), the wait, then each Python stage in turn
    k = inside & (prev_exit > 0) & (epoch == prev_epoch)
    _spans(out, pid, loop, "step", "step", prev_exit[k], t_enter[k], t0)
    k = np.flatnonzero(inside & (t_ready > t_enter))
    for i, ts, dur in zip(k.tolist(), ((t_enter[k] - t0) / 1e3).tolist(), ((t_ready[k] - t_enter[k]) / 1e3).tolist(), strict=True):
        b, e = int(batch[i]), int(epoch[i])
        out.append(
            f'{{"name":"wait for batch {b}","cat":"stall","ph":"X","ts":{ts:.3f},"dur":{dur:.3f},"pid":{pid},"tid":{loop},'
            f'"args":{{"epoch":{e},"batch":{b}}}}}'
        )
    t = t_ready.copy()
    for j, (name, kind) in enumerate(rows_.loop):
        d = s[:, STEP_FIXED + j]
        k = inside & (d > 0)
        _spans(out, pid, loop, name, kind if kind in ("copy", "device") else "python", t[k], t[k] + d[k], t0)
        t += d
    # each batch on the track of whoever made it, with its producer-side components inside it
    start, done = m[:, M_START], m[:, M_DONE]
    made = inside & (start > 0) & (done >= start)
    makers = s[:, MAKER]
    for maker in np.unique(makers[made]).tolist():
        where = made & (makers == maker)
        name = "the loop's thread (batches made while it waited)" if maker == LOOP_MADE else f"producer {maker}"
        tid = track((rows_.owner, maker), f"{rows_.label}: {rows_.tracks.get(maker, name)}")
        idx = np.flatnonzero(where)
        for i, ts, dur in zip(idx.tolist(), ((start[idx] - t0) / 1e3).tolist(), ((done[idx] - start[idx]) / 1e3).tolist(), strict=True):
            b, e = int(batch[i]), int(epoch[i])
            out.append(
                f'{{"name":"batch {b}","cat":"batch","ph":"X","ts":{ts:.3f},"dur":{dur:.3f},"pid":{pid},"tid":{tid},'
                f'"args":{{"epoch":{e},"batch":{b}}}}}'
            )
        t = start[idx].copy()
        for j, (cname, kind) in enumerate(rows_.producer):
            d = m[idx, MARK_FIXED + j]
            k = d > 0
            _spans(out, pid, tid, cname, kind, t[k], np.minimum(t[k] + d[k], done[idx][k]), t0)
            t += d
    return out
