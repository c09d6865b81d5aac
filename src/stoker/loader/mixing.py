"""Mixing datasets: the order of an epoch drawn from several datasets ("streams"), as pure functions.

Nothing here reads a file or knows the Loader: every function maps integers to
integers, so the mixed order depends only on ``(seed, epoch, the streams' sizes,
their counts)`` and is the same in every process, for any number of threads or ranks.

The model, for streams ``s = 0 .. S-1`` of ``n_s`` samples each::

    stream s, forever:  | pass 0 of s | pass 1 of s | pass 2 of s | ...     (each pass: a permutation of the
                        |<- epoch 0 ->|<-- epoch 1 -->|<- epoch 2 ->| ...     stream's samples in its own order)
                         c_s samples   c_s samples     c_s samples

* **Counts.** Epoch ``e`` takes ``c_s(e)`` samples of stream ``s`` (:func:`epoch_counts`: from
  weights, ``repeat`` or ``choose``), the next ones of the stream's infinite sequence of
  passes: a stream that runs out starts its next pass, a fresh permutation (upsampling); a
  stream that takes fewer samples than it has goes on where the last epoch stopped, so every
  sample is seen before any is seen twice (down-sampling rotates). Where each stream stands
  at the start of an epoch follows from the counts of the epochs before it (:class:`Schedule`:
  the counts may change between epochs).
* **Layout.** ``L = sum c_s`` positions, cut into batches of ``batch_size``. Each batch holds
  every stream's share of it to within rounding (:func:`sample_layout`: ``floor`` or ``ceil`` of
  ``c_s * m / L`` for a batch of ``m``), the streams interleaved evenly inside the batch; or,
  with ``whole_batches``, each batch is one stream's (:func:`batch_layout`). A stream's samples
  fill its positions in the order of its sequence, so each stream is read in its own order
  (``QUASI_RANDOM``'s windows stay windows).
* :func:`mixed_order` puts the two together: the epoch's global order, as indices into the
  streams laid end to end (``offsets[s] + index within stream s``).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, TypeVar

import numpy as np

from stoker.loader._checks import check_bool, check_int, check_seed

T = TypeVar("T")

__all__ = [
    "Schedule",
    "Stream",
    "apportion",
    "batch_layout",
    "epoch_counts",
    "mix_sequences",
    "mixed_order",
    "sample_layout",
    "stream_seed",
    "stream_slice",
]


#: integers, one per stream: a list or an int64 array
Counts = Sequence[int] | np.ndarray


def _number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _check_weight(value: Any, name: str = "Stream weight") -> float:
    """``value`` is a weight: a finite number >= 0 (never a bool); as a float.

    Raises:
        ValueError: naming ``name``, the rule and the value.
    """
    if not _number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0; got {value!r}")
    return float(value)


def check_weights(weights: Any, names: Sequence[str], caller: str) -> list[float]:
    """``weights`` gives one weight (:func:`_check_weight`) per stream of ``names``; as floats.

    Args:
        weights: the weights given.
        names: the streams' names, one per stream (for the message).
        caller: what takes the weights (``"set_weights"``, ``"mix_sequences"``), for the message.

    Raises:
        ValueError: not a sequence of ``len(names)`` weights, or a weight out of range (naming its index).
    """
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence | np.ndarray) or len(weights) != len(names):
        raise ValueError(f"{caller} needs one weight per stream ({len(names)}: {list(names)}); got {weights!r}")
    return [_check_weight(w, f"weights[{s}]") for s, w in enumerate(weights)]


@dataclass(frozen=True, eq=False)
class Stream:
    """One dataset of a mix, and how much of each epoch it takes.

    Give at most one of ``weight``, ``repeat`` and ``choose``; with none, the
    stream takes each of its samples once per epoch (``repeat=1``).

    Args:
        source: the dataset, anything ``Loader`` takes: a file, a folder of
            shards, a glob pattern, a list of files, or a URL (``s3://``,
            ``gs://``, ``az://``, ``https://``).
        weight: a relative share of the epoch: the weighted streams share
            the epoch's samples (after those of ``repeat``/``choose`` streams)
            in proportion to their weights, exactly up to rounding. Any
            number >= 0 (``0.7`` and ``0.3``, or ``7`` and ``3``).
        repeat: an absolute count: ``round(repeat * len(stream))`` samples
            per epoch (``repeat=4``: each sample four times an epoch;
            ``0.5``: half of them, the other half the next epoch).
        choose: an absolute count: this many samples per epoch.
        indices: the samples of this dataset to use (default: all), as
            ``Loader(indices=)``: integer indices (repeats allowed) or a
            boolean mask.
        name: how stats, reports and errors name the stream (default: the
            source's last path component).
        storage_options: for a URL: credentials and endpoint of its store
            (default: the Loader's ``storage_options``).

    Raises:
        ValueError: two of ``weight``/``repeat``/``choose`` given, or a value out of range.

    Example:
        >>> Stream("s3://bucket/web/", weight=0.7)  # doctest: +SKIP
        >>> Stream("/data/curated", repeat=4)  # doctest: +SKIP
    """

    source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
    weight: float | None = None
    repeat: float | None = None
    choose: int | None = None
    indices: Sequence[int] | np.ndarray | None = None
    name: str | None = None
    storage_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("weight", "repeat", "choose") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(
                f"a Stream takes at most one of weight, repeat and choose; got {', '.join(f'{k}={getattr(self, k)!r}' for k in given)} "
                "(weight: a relative share of the epoch; repeat/choose: an absolute number of samples)"
            )
        if self.weight is not None:
            _check_weight(self.weight)
        if self.repeat is not None and (not _number(self.repeat) or not math.isfinite(self.repeat) or self.repeat <= 0):
            raise ValueError(
                f"Stream repeat must be a finite number > 0 (samples per epoch = repeat * the stream's size); got {self.repeat!r}"
            )
        if self.choose is not None and (not isinstance(self.choose, (int, np.integer)) or isinstance(self.choose, bool) or self.choose < 1):
            raise ValueError(f"Stream choose must be an int >= 1 (samples per epoch); got {self.choose!r}")
        if self.name is not None and not isinstance(self.name, str):
            raise ValueError(f"Stream name must be a str or None; got {self.name!r}")

    @property
    def label(self) -> str:
        """The stream's name: ``name``, or the source's last path component."""
        if self.name is not None:
            return self.name
        source = self.source
        if isinstance(source, (list, tuple)):
            return f"{os.fspath(source[0])}+{len(source) - 1}" if len(source) > 1 else os.fspath(source[0]) if source else "[]"
        text = os.fspath(source).rstrip("/")  # type: ignore[arg-type]
        return text.rsplit("/", 1)[-1] or text

    def rule(self) -> tuple[str, float]:
        """``("weight", w)``, ``("repeat", r)`` or ``("choose", k)`` (``("repeat", 1)`` when none is given)."""
        if self.weight is not None:
            return "weight", float(self.weight)
        if self.choose is not None:
            return "choose", int(self.choose)
        return "repeat", float(self.repeat if self.repeat is not None else 1)


# ---- counts -------------------------------------------------------------------------------------------------------------


def apportion(total: int, weights: Sequence[float]) -> np.ndarray:
    """``total`` split in proportion to ``weights``: each part is the floor or the ceiling of its quota, the parts sum to ``total``.

    Largest remainders (Hamilton's method), in exact rational arithmetic: each
    part gets the floor of ``total * w / sum(w)``, and the units left go to the
    largest remainders, the lower index first among equal ones.

    Example:
        >>> apportion(10, [0.7, 0.3]).tolist()
        [7, 3]
        >>> apportion(10, [1, 1, 1]).tolist()
        [4, 3, 3]
    """
    w = [Fraction(float(x)) for x in weights]
    whole = sum(w, Fraction(0))
    if total < 0 or whole <= 0:
        raise ValueError(f"apportion needs a total >= 0 and weights of positive sum; got {total}, {list(weights)}")
    quotas = [total * x / whole for x in w]
    parts = [math.floor(q) for q in quotas]
    left = total - sum(parts)
    for s in sorted(range(len(w)), key=lambda s: (-(quotas[s] - parts[s]), s))[:left]:
        parts[s] += 1
    return np.array(parts, dtype=np.int64)


def epoch_counts(
    sizes: Sequence[int],
    rules: Sequence[tuple[str, float]],
    samples_per_epoch: int | None = None,
    batch_size: int = 1,
    whole_batches: bool = False,
    names: Sequence[str] | None = None,
) -> np.ndarray:
    """The samples each stream contributes to an epoch.

    * ``("repeat", r)``: ``round(r * size)`` (halves up); ``("choose", k)``: ``k``.
    * ``("weight", w)``: the weighted streams share ``samples_per_epoch`` minus the
      absolute counts, by :func:`apportion`; without ``samples_per_epoch`` they share the
      sum of their own sizes (so that weights alone give an epoch as long as the
      datasets laid end to end).
    * ``whole_batches``: counts in whole batches: an absolute count is rounded up to a
      multiple of ``batch_size``; the weighted streams share ``ceil(pool / batch_size)``
      batches by :func:`apportion`.

    Args:
        sizes: each stream's samples (after its ``indices``).
        rules: each stream's :meth:`Stream.rule`.
        samples_per_epoch: the epoch's length; ``None``: as above.
        batch_size: samples per batch (``whole_batches`` only).
        whole_batches: each batch comes from one stream.
        names: the streams' names, for messages.

    Raises:
        ValueError: a ``samples_per_epoch`` the counts cannot meet, weights that sum to 0,
            an empty stream given a share, or an epoch of no sample.
    """
    names = list(names) if names is not None else [f"stream {s}" for s in range(len(sizes))]
    b = int(batch_size) if whole_batches else 1
    counts = np.zeros(len(sizes), dtype=np.int64)
    weighted = [s for s, (kind, _) in enumerate(rules) if kind == "weight"]
    for s, (kind, value) in enumerate(rules):
        if kind == "repeat":
            counts[s] = math.floor(Fraction(value) * int(sizes[s]) + Fraction(1, 2))
        elif kind == "choose":
            counts[s] = int(value)
        elif kind != "weight":
            raise ValueError(f"unknown rule {kind!r} for {names[s]}")
        counts[s] = -(-int(counts[s]) // b) * b
    fixed = int(counts.sum())
    if weighted:
        if samples_per_epoch is None:
            pool = sum(int(sizes[s]) for s in weighted)
        else:
            pool = int(samples_per_epoch) - fixed
            if pool < 0:
                raise ValueError(
                    f"samples_per_epoch={samples_per_epoch} is less than the {fixed} samples the streams with repeat/choose take "
                    "alone; raise samples_per_epoch, or lower their counts"
                )
        weights = [float(rules[s][1]) for s in weighted]
        if sum(weights) <= 0:
            raise ValueError(f"the weights of {', '.join(names[s] for s in weighted)} sum to 0: give at least one a weight > 0")
        parts = apportion(-(-pool // b), weights) * b
        counts[weighted] = parts
    elif samples_per_epoch is not None and int(samples_per_epoch) != fixed:
        raise ValueError(
            f"samples_per_epoch={samples_per_epoch}, but every stream has an absolute count (repeat/choose, or none: repeat=1) "
            f"and they sum to {fixed}; give some streams a weight to fill the epoch, or leave samples_per_epoch out"
        )
    for s in range(len(sizes)):
        if counts[s] > 0 and int(sizes[s]) == 0:
            raise ValueError(f"{names[s]} has no sample (its indices select none) but takes {counts[s]} samples of each epoch")
    if int(counts.sum()) == 0:
        raise ValueError("the mixed epoch has no sample: give a stream a weight > 0, a repeat or a choose")
    return counts


# ---- where each stream stands, epoch after epoch ------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """The streams' counts, epoch by epoch: phases of constant counts.

    Attributes:
        phases: ``((first_epoch, counts), ...)``: from ``first_epoch`` on (until the next
            phase), each epoch takes ``counts[s]`` samples of stream ``s``. The first phase
            starts at epoch 0; ``first_epoch`` increases.
    """

    phases: tuple[tuple[int, tuple[int, ...]], ...]

    @classmethod
    def constant(cls, counts: Counts) -> Schedule:
        """The same counts in every epoch."""
        return cls(((0, tuple(int(c) for c in counts)),))

    def _phase(self, epoch: int) -> int:
        i = 0
        for j, (first, _) in enumerate(self.phases):
            if first <= epoch:
                i = j
        return i

    def counts(self, epoch: int) -> np.ndarray:
        """Each stream's samples in ``epoch``."""
        return np.array(self.phases[self._phase(epoch)][1], dtype=np.int64)

    def length(self, epoch: int) -> int:
        """The samples of ``epoch``."""
        return int(sum(self.phases[self._phase(epoch)][1]))

    def starts(self, epoch: int) -> list[int]:
        """Where each stream stands in its sequence of passes when ``epoch`` starts: the samples the epochs before took."""
        out = [0] * len(self.phases[0][1])
        for j, (first, counts) in enumerate(self.phases):
            stop = self.phases[j + 1][0] if j + 1 < len(self.phases) else None
            epochs = max(0, (epoch if stop is None else min(epoch, stop)) - first)
            for s, c in enumerate(counts):
                out[s] += epochs * c
        return out

    def change(self, counts: Counts, epoch: int) -> Schedule:
        """This schedule with ``counts`` from ``epoch`` on (the phases of earlier epochs kept)."""
        counts = tuple(int(c) for c in counts)
        kept = [(first, c) for first, c in self.phases if first < epoch]
        if kept and kept[-1][1] == counts:
            return Schedule(tuple(kept))
        return Schedule((*kept, (int(epoch), counts)))

    def to_list(self) -> list[list[Any]]:
        """As a state holds it: ``[[first_epoch, [counts...]], ...]``."""
        return [[first, list(counts)] for first, counts in self.phases]

    @classmethod
    def from_list(cls, value: Any, streams: int) -> Schedule:
        """A schedule from :meth:`to_list`, checked.

        Raises:
            ValueError: not a list of ``[first_epoch, counts]`` with ``streams`` counts >= 0 each, the first at
                epoch 0 and increasing, or an epoch of no sample.
        """
        try:
            phases = tuple((_int(first), tuple(_int(c) for c in counts)) for first, counts in value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"phases must be a list of [first_epoch, [count per stream]]; got {value!r} ({exc})") from None
        if not phases or phases[0][0] != 0 or any(b[0] <= a[0] for a, b in itertools.pairwise(phases)):
            raise ValueError(f"phases must start at epoch 0 and increase; got {[p[0] for p in phases]}")
        for first, counts in phases:
            if len(counts) != streams or min(counts) < 0 or sum(counts) == 0:
                raise ValueError(f"phase at epoch {first} must give {streams} counts >= 0, not all 0; got {list(counts)}")
        return cls(phases)


def _int(value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"an int; got {type(value).__name__} {value!r}")
    return int(value)


def stream_seed(seed: int, stream: int) -> int:
    """The seed of stream ``stream``'s passes: its own, so that its order does not depend on the other streams."""
    from stoker._splitmix import mix64_int

    return mix64_int(mix64_int(int(seed)) ^ mix64_int(0x5EED_0000 + int(stream)))


def stream_slice(pass_order: Callable[[int], np.ndarray], size: int, start: int, count: int) -> np.ndarray:
    """Items ``start .. start + count - 1`` of a stream's sequence of passes (pass ``p``: ``pass_order(p)``, ``size`` items)."""
    out = []
    p, at, need = start // size if size else 0, start % size if size else 0, count
    while need > 0:
        taken = np.asarray(pass_order(p), dtype=np.int64)[at : at + need]
        out.append(taken)
        need -= len(taken)
        p, at = p + 1, 0
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


# ---- the layout of an epoch -----------------------------------------------------------------------------------------------


def _coprime_step(n: int) -> int:
    """A step near ``n / golden ratio`` that is coprime to ``n``: ``j -> j * step % n`` spreads consecutive ``j`` evenly."""
    if n <= 2:
        return 1 % max(n, 1)
    g = max(1, round(n * 0.6180339887498949))
    while math.gcd(g, n) != 1:
        g += 1
    return g


def _label_dtype(streams: int) -> np.dtype[Any]:
    return np.dtype(np.uint8) if streams <= 256 else np.dtype(np.uint16) if streams <= 65536 else np.dtype(np.int64)


def _interleave(counts: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """``counts[s]`` copies of each ``s``, spread evenly: item ``k`` of ``s`` at about ``(k + 1/2) / counts[s]`` of the way."""
    counts = np.asarray(counts, dtype=np.int64)
    labels = np.repeat(np.arange(len(counts)), counts)
    if len(labels) == 0:
        return labels.astype(dtype)
    k = np.arange(len(labels)) - np.repeat(np.cumsum(counts) - counts, counts)
    keys = (2 * k + 1) / (2 * counts[labels])
    return labels[np.lexsort((labels, keys))].astype(dtype)


def batch_counts(counts: Counts, batch_size: int) -> np.ndarray:
    """How many samples of each stream each batch holds: a ``(batches, streams)`` int64 array.

    Every batch of ``m`` samples holds ``floor`` or ``ceil`` of ``counts[s] * m / L`` of
    stream ``s`` (``L = sum(counts)``), and the columns sum to ``counts``:

    * the last batch, if partial, by :func:`apportion` of its ``m`` samples;
    * each full batch holds ``floor(counts[s] * batch_size / L)`` of every stream, plus one
      more for ``R`` streams (``R``: what the floors leave of the batch); stream ``s`` gets
      its ``E_s`` extra samples (what its floors and the last batch leave of its count) in
      ``E_s`` different batches: the streams take turns ``j = 0, 1, ...`` round the full
      batches (McNaughton's wrap-around: each ``j`` is taken ``R`` times, by different
      streams), turn ``j`` going to batch ``j * g mod F`` (``F`` full batches, ``g`` coprime
      to ``F`` near ``F / golden ratio``) so that a stream's extras spread over the epoch.
    """
    c = np.asarray(counts, dtype=np.int64)
    total, b = int(c.sum()), int(batch_size)
    full, m = divmod(total, b)
    last = np.zeros(len(c), dtype=np.int64)
    if m:
        last = c * m // total
        rem = c * m % total
        extra = m - int(last.sum())
        last[np.lexsort((np.arange(len(c)), -rem))[:extra]] += 1
    rows = np.tile(c * b // total, (full, 1)) if full else np.zeros((0, len(c)), dtype=np.int64)
    if full:
        extras = c - full * (c * b // total) - last
        step, turn = _coprime_step(full), 0
        for s, e in enumerate(extras.tolist()):
            j = (turn + np.arange(e, dtype=np.int64)) % full
            rows[j * step % full, s] += 1
            turn += e
    return np.concatenate([rows, last[None, :]]) if m else rows


def _patterns(counts: np.ndarray, batch_size: int) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, int]:
    """:func:`batch_counts`, each distinct full batch's interleaving, each full batch's pattern, and the number of full batches.

    A full batch is the floors plus at most one extra sample per stream, so the distinct rows are found by
    their extras as bits (``np.unique`` over rows is 8x slower on 10^7 samples).
    """
    dtype = _label_dtype(len(counts))
    rows = batch_counts(counts, batch_size)
    full = int(counts.sum()) // int(batch_size)
    if full == 0:
        return rows, [], np.zeros(0, dtype=np.int64), 0
    extras = rows[:full] - rows[:full].min(axis=0)
    if len(counts) <= 62 and extras.max() <= 1:
        keys = extras @ (np.int64(1) << np.arange(len(counts), dtype=np.int64))
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        unique = rows[:full][first]
    else:
        unique, inverse = np.unique(rows[:full], axis=0, return_inverse=True)
    return rows, [_interleave(row, dtype) for row in unique], np.asarray(inverse).ravel(), full


def sample_layout(counts: Counts, batch_size: int) -> np.ndarray:
    """The stream of each position of an epoch mixed within batches (see :func:`batch_counts`).

    Inside a batch the streams are interleaved evenly (:func:`_interleave`), so that a run
    of positions cut out of a batch (a rank's block boundary) is mixed too.
    """
    c = np.asarray(counts, dtype=np.int64)
    rows, patterns, inverse, full = _patterns(c, batch_size)
    parts = [np.stack(patterns)[inverse].ravel()] if full else []
    if len(rows) > full:
        parts.append(_interleave(rows[-1], _label_dtype(len(c))))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=_label_dtype(len(c)))


def _stream_positions(counts: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Each stream's positions in an epoch mixed within batches, in order (those of :func:`sample_layout`'s labels), found
    batch by batch from the distinct batches' patterns rather than by sorting the epoch's labels."""
    b = int(batch_size)
    rows, patterns, inverse, full = _patterns(counts, b)
    last = _interleave(rows[-1], _label_dtype(len(counts))) if len(rows) > full else None
    out = []
    for s in range(len(counts)):
        parts = []
        if full:
            where = [np.flatnonzero(p == s) for p in patterns]
            table = np.zeros((len(patterns), max(1, max(len(w) for w in where))), dtype=np.int64)
            for u, w in enumerate(where):
                table[u, : len(w)] = w
            d = rows[:full, s]
            batch = np.repeat(np.arange(full, dtype=np.int64), d)
            k = np.arange(len(batch), dtype=np.int64) - np.repeat(np.cumsum(d) - d, d)
            parts.append(batch * b + table[inverse[batch], k])
        if last is not None:
            parts.append(full * b + np.flatnonzero(last == s))
        out.append(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
    return out


def batch_layout(counts: Counts, batch_size: int) -> np.ndarray:
    """The stream of each batch of an epoch of whole batches: ``counts[s] / batch_size`` batches of each stream, spread
    evenly (:func:`_interleave`).

    Raises:
        ValueError: a count that is not a multiple of ``batch_size``.
    """
    c = np.asarray(counts, dtype=np.int64)
    if (c % int(batch_size)).any():
        raise ValueError(f"whole batches need counts that are multiples of batch_size {batch_size}; got {c.tolist()}")
    return _interleave(c // int(batch_size), _label_dtype(len(c)))


def mixed_order(
    counts: Counts,
    starts: Counts,
    sizes: Counts,
    offsets: Counts,
    pass_order: Callable[[int, int], np.ndarray],
    batch_size: int,
    whole_batches: bool = False,
) -> np.ndarray:
    """An epoch's global order: ``offsets[s] + i`` for item ``i`` of stream ``s``, in the order loaded.

    Args:
        counts: each stream's samples this epoch.
        starts: where each stream stands in its sequence of passes (:meth:`Schedule.starts`).
        sizes: each stream's items per pass.
        offsets: each stream's first index in the global index space.
        pass_order: ``pass_order(s, p)``: pass ``p`` of stream ``s``, ``sizes[s]`` indices within the stream.
        batch_size: samples per batch.
        whole_batches: each batch from one stream (:func:`batch_layout`) instead of every batch
            holding each stream's share (:func:`sample_layout`).
    """
    c = np.asarray(counts, dtype=np.int64)
    b = int(batch_size)
    if whole_batches:
        batches = batch_layout(c, b)
        where = [(np.flatnonzero(batches == s)[:, None] * b + np.arange(b)).ravel() for s in range(len(c))]
    else:
        where = _stream_positions(c, b)
    out = np.empty(int(c.sum()), dtype=np.int64)
    for s, n in enumerate(c.tolist()):
        if n:
            items = stream_slice(lambda p, s=s: pass_order(s, p), int(sizes[s]), int(starts[s]), n)  # type: ignore[misc]
            out[where[s]] = int(offsets[s]) + items
    return out


def mix_sequences(
    sequences: Sequence[Sequence[T]],
    weights: Sequence[float] | None = None,
    *,
    seed: int,
    epoch: int = 0,
    samples_per_epoch: int | None = None,
    batch_size: int = 1,
    shuffle: bool = True,
) -> list[tuple[int, T]]:
    """One epoch of several Python sequences mixed by weight, as ``(stream, item)`` pairs: a :mod:`stoker.flow` source.

    The rules of a Loader's mix over plain sequences (file lists, URLs, rows): each
    sequence's share of the epoch exactly (:func:`epoch_counts`), each drawn without
    replacement from its own passes (a fresh permutation per pass, from ``seed``; in
    order with ``shuffle=False``), going on where the epoch before stopped, every run
    of ``batch_size`` items holding each sequence's share of it (:func:`sample_layout`).
    The result is a list: a flow over it resumes at the item its state records.

    Args:
        sequences: the items of each stream.
        weights: each stream's weight (default: each item once per epoch).
        seed: the seed of the passes' permutations.
        epoch: the epoch.
        samples_per_epoch: the epoch's length (default: the sequences' total).
        batch_size: the runs within which every stream holds its share.
        shuffle: permute each pass (``False``: each sequence in order).

    Raises:
        ValueError: not one weight per sequence, a weight that is not a finite number >= 0, a
            ``seed`` outside [0, 2**64), an ``epoch`` that is not an int >= 0, a ``batch_size`` or
            ``samples_per_epoch`` that is not an int >= 1, a ``shuffle`` that is not a bool, or
            counts that cannot be met (:func:`epoch_counts`).
        TypeError: a ``seed`` that is not an integer (``None`` included).

    Example:
        >>> mix_sequences([["a0", "a1", "a2"], ["b0"]], [2, 1], seed=0, samples_per_epoch=3, shuffle=False)
        [(0, 'a0'), (1, 'b0'), (0, 'a1')]
        >>> mix_sequences([["a0", "a1", "a2"], ["b0"]], [2, 1], seed=0, samples_per_epoch=3, epoch=1, shuffle=False)
        [(0, 'a2'), (1, 'b0'), (0, 'a0')]
    """
    sizes = [len(x) for x in sequences]
    names = [f"stream {s}" for s in range(len(sizes))]
    rules = [("repeat", 1.0)] * len(sizes) if weights is None else [("weight", w) for w in check_weights(weights, names, "mix_sequences")]
    if seed is None:
        raise TypeError("mix_sequences needs seed= an integer in [0, 2**64) (it draws each pass's permutation); got None")
    seed = check_seed(seed)
    check_int("epoch", epoch, 0)
    check_int("samples_per_epoch", samples_per_epoch, none_ok=True)
    check_int("batch_size", batch_size)
    check_bool("shuffle", shuffle)
    counts = epoch_counts(sizes, rules, samples_per_epoch, names=names)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)

    def pass_order(s: int, p: int) -> np.ndarray:
        if not shuffle:
            return np.arange(sizes[s], dtype=np.int64)
        key = stream_seed(seed, s)
        return np.random.default_rng([key & 0xFFFFFFFF, key >> 32, p]).permutation(sizes[s])

    order = mixed_order(counts, [epoch * int(c) for c in counts], sizes, offsets, pass_order, batch_size)
    stream = np.searchsorted(offsets, order, side="right") - 1
    local = order - offsets[stream]
    return [(s, sequences[s][i]) for s, i in zip(stream.tolist(), local.tolist())]
