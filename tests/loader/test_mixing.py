"""The mixed order (stoker.loader.mixing) against a small reference model in plain Python, and its promises.

The model (``MixModel``) spells out the documented rules with lists, loops and
fractions: each stream's infinite sequence of passes, each epoch's counts (as
:class:`Schedule` phases), each batch's share of every stream (the last batch by
largest remainders, the full ones by McNaughton's wrap-around spread by the
golden-ratio step), the interleaving inside a batch, and the whole-batches
layout. Hypothesis draws sizes, weights, batch sizes, schedules and modes; the
vectorised module must give the same order. Independently of the model, the
promises of the issue are checked on the module's output: exact counts per epoch,
every batch within rounding of its share, no sample twice within a pass,
a down-sampled stream seen whole in its first ``ceil(size / count)`` epochs.
"""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.loader.mixing import (
    Schedule,
    Stream,
    apportion,
    batch_counts,
    batch_layout,
    epoch_counts,
    mixed_order,
    sample_layout,
    stream_slice,
)

# ---- the reference model ----------------------------------------------------------------------------------------------


def _perm(s: int, p: int, size: int) -> list[int]:
    """Pass ``p`` of stream ``s``: a permutation of its items (any will do: the model and the module take the same)."""
    return np.random.default_rng([s, p, 12345]).permutation(size).tolist()


def model_apportion(total: int, weights: list[Fraction]) -> list[int]:
    whole = sum(weights)
    quotas = [total * w / whole for w in weights]
    parts = [math.floor(q) for q in quotas]
    order = sorted(range(len(weights)), key=lambda s: (-(quotas[s] - parts[s]), s))
    for s in order[: total - sum(parts)]:
        parts[s] += 1
    return parts


def model_step(n: int) -> int:
    if n <= 2:
        return 1 % max(n, 1)
    g = max(1, round(n * 0.6180339887498949))
    while math.gcd(g, n) != 1:
        g += 1
    return g


class MixModel:
    """The mixed order, rule by rule, in plain Python."""

    def __init__(self, sizes: list[int], batch_size: int, whole_batches: bool) -> None:
        self.sizes, self.batch_size, self.whole_batches = sizes, batch_size, whole_batches

    def stream(self, s: int, start: int, count: int) -> list[int]:
        """Items ``start .. start + count - 1`` of stream ``s``'s passes, one pass after another."""
        out: list[int] = []
        position = 0
        p = 0
        while len(out) < count:
            for item in _perm(s, p, self.sizes[s]):
                if start <= position < start + count:
                    out.append(item)
                position += 1
            p += 1
        return out

    def rows(self, counts: list[int]) -> list[list[int]]:
        """Each batch's samples of each stream."""
        total, b = sum(counts), self.batch_size
        full, m = total // b, total % b
        rows = [[c * b // total for c in counts] for _ in range(full)]
        last = model_apportion(m, [Fraction(c) for c in counts]) if m else [0] * len(counts)
        extras = [counts[s] - full * (counts[s] * b // total) - last[s] for s in range(len(counts))]
        turn, step = 0, model_step(full)
        for s, e in enumerate(extras):
            for _ in range(e):
                rows[(turn % full) * step % full][s] += 1
                turn += 1
        return rows + ([last] if m else [])

    @staticmethod
    def interleave(row: list[int]) -> list[int]:
        items = [(Fraction(2 * k + 1, 2 * d), s) for s, d in enumerate(row) for k in range(d)]
        return [s for _, s in sorted(items)]

    def labels(self, counts: list[int]) -> list[int]:
        if self.whole_batches:
            batches = self.interleave([c // self.batch_size for c in counts])
            return [s for s in batches for _ in range(self.batch_size)]
        return [s for row in self.rows(counts) for s in self.interleave(row)]

    def order(self, counts: list[int], starts: list[int], offsets: list[int]) -> list[int]:
        taken = [iter(self.stream(s, starts[s], counts[s])) for s in range(len(counts))]
        return [offsets[s] + next(taken[s]) for s in self.labels(counts)]


def _module_order(sizes: list[int], counts: list[int], starts: list[int], batch_size: int, whole: bool) -> np.ndarray:
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
    return mixed_order(counts, starts, sizes, offsets, lambda s, p: np.array(_perm(s, p, sizes[s])), batch_size, whole)


# ---- strategies -------------------------------------------------------------------------------------------------------


@st.composite
def mixes(draw: st.DrawFn) -> dict[str, Any]:
    """Streams (sizes, weights or absolute counts), a batch size, a mode and a schedule of a few phases."""
    n = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    batch_size = draw(st.integers(1, 12))
    whole = draw(st.booleans())
    phases = []
    first = 0
    for _ in range(draw(st.integers(1, 3))):
        kinds = draw(st.lists(st.sampled_from(["weight", "repeat", "choose"]), min_size=n, max_size=n))
        rules: list[tuple[str, float]] = []
        for kind in kinds:
            if kind == "weight":
                rules.append(("weight", draw(st.sampled_from([0.1, 0.3, 0.5, 0.7, 1.0, 2.0, 3.0]))))
            elif kind == "repeat":
                rules.append(("repeat", draw(st.sampled_from([0.25, 0.5, 1.0, 1.5, 4.0]))))
            else:
                rules.append(("choose", draw(st.integers(1, 60))))
        spe = draw(st.none() | st.integers(60, 150)) if "weight" in kinds else None
        try:
            counts = epoch_counts(sizes, rules, spe, batch_size, whole)
        except ValueError:
            continue
        phases.append((first, tuple(int(c) for c in counts)))
        first += draw(st.integers(1, 3))
    if not phases:
        phases = [(0, tuple(-(-x // batch_size) * batch_size if whole else x for x in sizes))]
    return {"sizes": sizes, "batch_size": batch_size, "whole": whole, "schedule": Schedule(tuple(phases))}


# ---- the module equals the model --------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None, database=None)
@given(mix=mixes(), epoch=st.integers(0, 7))
def test_the_order_equals_the_model(mix: dict[str, Any], epoch: int) -> None:
    sizes, b, whole, schedule = mix["sizes"], mix["batch_size"], mix["whole"], mix["schedule"]
    counts, starts = schedule.counts(epoch).tolist(), schedule.starts(epoch)
    model = MixModel(sizes, b, whole)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
    got = _module_order(sizes, counts, starts, b, whole)
    assert got.tolist() == model.order(counts, starts, offsets)
    if not whole:
        assert batch_counts(counts, b).tolist() == model.rows(counts)


@settings(max_examples=60, deadline=None, database=None)
@given(mix=mixes())
def test_where_each_stream_starts_is_the_sum_of_the_epochs_before(mix: dict[str, Any]) -> None:
    schedule: Schedule = mix["schedule"]
    running = [0] * len(mix["sizes"])
    for epoch in range(10):
        assert schedule.starts(epoch) == running
        running = [a + c for a, c in zip(running, schedule.counts(epoch).tolist())]
    again = Schedule.from_list(schedule.to_list(), len(mix["sizes"]))
    assert again == schedule


# ---- the promises, on the module's output -----------------------------------------------------------------------------


def _streams_of(order: np.ndarray, sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    s = np.searchsorted(bounds, order, side="right") - 1
    return s, order - bounds[s]


@settings(max_examples=80, deadline=None, database=None)
@given(mix=mixes(), epoch=st.integers(0, 5))
def test_exact_counts_and_every_batch_within_rounding(mix: dict[str, Any], epoch: int) -> None:
    sizes, b, whole, schedule = mix["sizes"], mix["batch_size"], mix["whole"], mix["schedule"]
    counts = schedule.counts(epoch)
    order = _module_order(sizes, counts.tolist(), schedule.starts(epoch), b, whole)
    total = int(counts.sum())
    assert len(order) == total
    stream, _ = _streams_of(order, sizes)
    assert np.bincount(stream, minlength=len(sizes)).tolist() == counts.tolist()  # exact proportions
    for lo in range(0, total, b):
        batch = stream[lo : lo + b]
        got = np.bincount(batch, minlength=len(sizes))
        if whole:
            assert len(set(batch.tolist())) == 1, "a whole batch holds one stream"
        else:
            m = len(batch)
            assert (got >= counts * m // total).all() and (got <= -(-counts * m // total)).all(), (got, counts, m)


@settings(max_examples=60, deadline=None, database=None)
@given(mix=mixes())
def test_no_sample_twice_within_a_pass_and_every_sample_seen_in_time(mix: dict[str, Any]) -> None:
    """Walking 12 epochs: stream s's items, concatenated, are its passes one after another (so within a pass every
    item once); a stream that takes c < n per epoch has seen all n after the first ceil(n / c) epochs, and each of
    its later passes spans at most ceil(n / c) + 1 epochs (with the counts of one phase)."""
    sizes, b, whole, schedule = mix["sizes"], mix["batch_size"], mix["whole"], mix["schedule"]
    epochs = [_module_order(sizes, schedule.counts(e).tolist(), schedule.starts(e), b, whole) for e in range(12)]
    per_stream: list[list[list[int]]] = [[] for _ in sizes]
    for order in epochs:
        stream, local = _streams_of(order, sizes)
        for s in range(len(sizes)):
            per_stream[s].append(local[stream == s].tolist())
    for s, n in enumerate(sizes):
        flat = [i for epoch in per_stream[s] for i in epoch]
        for p in range(len(flat) // n):
            assert sorted(flat[p * n : (p + 1) * n]) == list(range(n)), f"stream {s}, pass {p}: a sample twice"
        tail = flat[len(flat) // n * n :]
        assert len(set(tail)) == len(tail)
    # rotation, over a constant phase from epoch 0
    first_phase = schedule.counts(0)
    constant = schedule.phases[1][0] if len(schedule.phases) > 1 else 12
    for s, n in enumerate(sizes):
        c = int(first_phase[s])
        if not 0 < c < n:
            continue
        k = -(-n // c)
        if k <= constant:
            seen = {i for e in range(k) for i in per_stream[s][e]}
            assert seen == set(range(n)), f"stream {s}: not every sample in the first {k} epochs"
        for p in range(constant * c // n):  # pass p: positions p*n .. (p+1)*n - 1, in epochs p*n // c .. ((p+1)*n - 1) // c
            first, last = p * n // c, ((p + 1) * n - 1) // c
            assert last - first + 1 <= k + 1
            seen = {i for e in range(first, last + 1) for i in per_stream[s][e]}
            assert seen == set(range(n))


def test_a_seventy_thirty_mix_in_batches_of_ten() -> None:
    """The example of the docs: weights 0.7 and 0.3 over 100 + 30 samples, batches of 10: 7 + 3 in every batch."""
    counts = epoch_counts([100, 30], [("weight", 0.7), ("weight", 0.3)])
    assert counts.tolist() == [91, 39]  # the default epoch: as long as both datasets end to end (130)
    assert batch_counts(counts, 10).tolist() == [[7, 3]] * 13
    assert sample_layout([7, 3], 10).tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]  # interleaved evenly
    assert batch_layout([70, 30], 10).tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]  # 7 batches of one, 3 of the other


def test_counts_from_weights_repeat_and_choose() -> None:
    sizes = [1000, 50, 20]
    assert epoch_counts(sizes, [("weight", 1.0), ("repeat", 4.0), ("choose", 5)]).tolist() == [1000, 200, 5]
    assert epoch_counts(sizes, [("weight", 1.0), ("repeat", 4.0), ("choose", 5)], samples_per_epoch=300).tolist() == [95, 200, 5]
    assert epoch_counts(sizes, [("repeat", 1.0)] * 3).tolist() == sizes  # no weight: the datasets end to end
    assert epoch_counts(sizes, [("weight", 2), ("weight", 1), ("weight", 1)], 10).tolist() == [5, 3, 2]
    # whole batches: absolute counts rounded up to batches, weighted ones share whole batches
    assert epoch_counts(sizes, [("weight", 1.0), ("repeat", 4.0), ("choose", 5)], 300, 8, True).tolist() == [96, 200, 8]
    assert apportion(7, [1, 1]).tolist() == [4, 3]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (([10, 10], [("choose", 5), ("choose", 5)], 20), r"every stream has an absolute count .* sum to 10"),
        (([10, 10], [("choose", 50), ("weight", 1)], 20), r"less than the 50 samples"),
        (([10, 10], [("weight", 0), ("weight", 0)], None), "sum to 0"),
        (([0, 10], [("choose", 3), ("weight", 1)], None), "stream 0 has no sample"),
    ],
)
def test_counts_that_cannot_be_met_are_refused(args: tuple[Any, ...], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        epoch_counts(*args)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"weight": 0.5, "repeat": 2}, "at most one of weight, repeat and choose"),
        ({"weight": -1}, "weight must be a finite number >= 0"),
        ({"weight": float("nan")}, "weight must be a finite number >= 0"),
        ({"repeat": 0}, "repeat must be a finite number > 0"),
        ({"choose": 2.5}, "choose must be an int >= 1"),
        ({"weight": "0.5"}, "weight must be a finite number"),
    ],
)
def test_invalid_streams_are_refused(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Stream("a/", **kwargs)


def test_a_schedule_changes_between_epochs_only() -> None:
    schedule = Schedule.constant([6, 4]).change([2, 8], 3)
    assert schedule.to_list() == [[0, [6, 4]], [3, [2, 8]]]
    assert schedule.starts(5) == [6 * 3 + 2 * 2, 4 * 3 + 8 * 2]
    assert schedule.change([6, 4], 3) == Schedule.constant([6, 4])  # back to the counts before: one phase
    for bad, words in (([[1, [1, 1]]], "start at epoch 0"), ([[0, [1]]], "2 counts"), ([[0, [0, 0]]], "not all 0"), ("x", "list")):
        with pytest.raises(ValueError, match=words):
            Schedule.from_list(bad, 2)


def test_stream_slices_cross_passes() -> None:
    passes = {0: np.array([2, 0, 1]), 1: np.array([1, 2, 0]), 2: np.array([0, 1, 2])}
    assert stream_slice(passes.__getitem__, 3, 2, 5).tolist() == [1, 1, 2, 0, 0]
    assert Counter(stream_slice(passes.__getitem__, 3, 0, 9).tolist()) == {0: 3, 1: 3, 2: 3}
