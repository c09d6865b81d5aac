"""The Loader's side of a mix (``Loader([Stream(...), Stream(...)], ...)``): its streams, schedule, state, extras and figures.

The order itself is :mod:`stoker.loader.mixing` (pure functions); the datasets
are read as one by :class:`stoker.dataset.mixed.MixedReader`. What the Loader
does over a single dataset's global order (ranks, elastic resume, per-position
augmentation seeds) it does unchanged over the mixed epoch's global order: this
module only says what that order is, how long each epoch is, and what a state
must hold besides (the schedule of counts, which weights changed between epochs).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker.errors import StokerError
from stoker.loader._extras import BatchExtras, output_names
from stoker.loader.mixing import Schedule, Stream, check_weights, epoch_counts, mixed_order, stream_seed
from stoker.loader.order import OrderOption, epoch_order

if TYPE_CHECKING:
    from stoker.dataset.mixed import MixedReader
    from stoker.fields.base import Field
    from stoker.format.reader import Reader
    from stoker.loader._graph import FieldPipeline

#: how a mixed epoch fills its batches: every batch holds each stream's share, or each batch is one stream's
MIX_MODES = ("samples", "batches")
#: the key of each sample's stream in named batches (``return_source=True``)
SOURCE_KEY = "source"


def streams_of(fname: Any) -> list[Stream] | None:
    """The streams when ``fname`` is a list of :class:`Stream` (a mix), else ``None``.

    Raises:
        TypeError: a list mixing streams and paths.
    """
    if not isinstance(fname, (list, tuple)) or not any(isinstance(s, Stream) for s in fname):
        return None
    if not all(isinstance(s, Stream) for s in fname):
        raise TypeError(
            "a list given as the dataset holds Streams and other things: give a list of files (one dataset), or a list of "
            "Stream(...) (a mix), e.g. [Stream('a/', weight=0.7), Stream('b/', weight=0.3)]"
        )
    if len({s.label for s in fname}) != len(fname):
        raise ValueError(f"every Stream of a mix needs its own name; got {[s.label for s in fname]} (pass name=...)")
    return list(fname)


def check_options(streams: list[Stream] | None, indices: Any, samples_per_epoch: Any, mix: Any, return_source: Any) -> None:
    """The Loader's mix-only arguments: given with streams only, and of the right kinds.

    Raises:
        ValueError: a mix-only argument without streams, ``indices=`` with streams, or a value out of range.
    """
    if streams is None:
        given = [n for n, v, default in (("samples_per_epoch", samples_per_epoch, None), ("mix", mix, "samples"),
                                         ("return_source", return_source, False)) if v != default]  # fmt: skip
        if given:
            raise ValueError(
                f"{', '.join(given)} are for a mix of datasets: Loader([Stream('a/', weight=0.7), Stream('b/', weight=0.3)], ...)"
            )
        return
    if indices is not None:
        raise ValueError("indices= selects samples of one dataset; for a mix, give each stream its own: Stream('a/', indices=...)")
    if samples_per_epoch is not None and (
        isinstance(samples_per_epoch, bool) or not isinstance(samples_per_epoch, (int, np.integer)) or samples_per_epoch < 1
    ):
        raise ValueError(f"samples_per_epoch must be an int >= 1 or None; got {samples_per_epoch!r}")
    if mix not in MIX_MODES:
        raise ValueError(
            f"mix must be 'samples' (every batch holds each stream's share) or 'batches' (each batch one stream's); got {mix!r}"
        )
    if not isinstance(return_source, (bool, np.bool_)):
        raise ValueError(f"return_source must be True or False; got {return_source!r}")


def check_ranks(mode: str, world_size: int, drop_last: bool) -> None:
    """Whole batches on several ranks need ``drop_last``: the ranks' blocks of the global order must be whole batches.

    Raises:
        ValueError: ``mix="batches"`` with ``world_size > 1`` and ``drop_last=False``.
    """
    if mode == "batches" and world_size > 1 and not drop_last:
        raise ValueError(
            f"mix='batches' on {world_size} ranks needs drop_last=True: without it each rank's block of the epoch is "
            "padded to an equal length that is not a whole number of batches, and a batch would hold two streams"
        )


def open_streams(
    streams: list[Stream],
    custom_fields: Mapping[str, type] | None,
    bounded: bool,
    storage_options: Mapping[str, Any] | None,
    cache_dir: Any,
    cache_limit: int | None,
    verify: bool,
    ahead: int | None,
    cache_shared: bool = False,
) -> MixedReader:
    """Open the streams' datasets as one :class:`~stoker.dataset.mixed.MixedReader` (their fields checked alike)."""
    from stoker.dataset.mixed import open_mixed
    from stoker.loader._checks import check_fname

    for s in streams:
        if not (isinstance(s.source, str) and "://" in s.source):
            check_fname(s.source)
    options = [s.storage_options if s.storage_options is not None else
               (storage_options if isinstance(s.source, str) and "://" in s.source else None) for s in streams]  # fmt: skip
    return open_mixed([s.source for s in streams], [s.label for s in streams], custom_fields, bounded=bounded,  # type: ignore[arg-type]
                      storage_options=options, cache_dir=cache_dir, cache_limit=cache_limit, verify=verify, ahead=ahead,
                      cache_shared=cache_shared)  # fmt: skip


def _indices_digest(indices: np.ndarray | None, n: int) -> str:
    digest = hashlib.sha256()
    if indices is None:
        digest.update(f"all {n}".encode())
    else:
        digest.update(np.ascontiguousarray(indices, dtype=np.int64).tobytes())
    return digest.hexdigest()[:32]


class Mix:
    """A Loader's streams: their samples, the schedule of counts, and each epoch's global order.

    Args:
        streams: the :class:`Stream` of each dataset.
        reader: the datasets read as one.
        batch_size: samples per batch.
        mode: ``"samples"`` or ``"batches"`` (see :data:`MIX_MODES`).
        samples_per_epoch: the epoch's length (``None``: see :func:`~stoker.loader.mixing.epoch_counts`).
        check_indices: the Loader's check of an ``indices`` argument, ``(indices, n, path) -> int64 array``.
    """

    def __init__(self, streams: list[Stream], reader: MixedReader, batch_size: int, mode: str, samples_per_epoch: int | None,
                 check_indices: Any) -> None:  # fmt: skip
        self.streams = streams
        self.reader = reader
        self.names = [s.label for s in streams]
        self.batch_size = int(batch_size)
        self.whole_batches = mode == "batches"
        self.mode = mode
        starts = reader.stream_starts
        self.offsets = [int(x) for x in starts[:-1]]
        self.lengths = [int(b - a) for a, b in itertools.pairwise(starts)]  # each dataset's samples
        self.indices: list[np.ndarray | None] = [
            None if s.indices is None else check_indices(s.indices, n, f"stream {i} ({self.names[i]!r})")
            for i, (s, n) in enumerate(zip(streams, self.lengths))
        ]
        self.sizes = [n if idx is None else len(idx) for idx, n in zip(self.indices, self.lengths)]  # samples per pass
        shard_starts = reader.shard_starts
        self.boundaries = [shard_starts[reader.stream_shards[s] : reader.stream_shards[s + 1] + 1] - starts[s] for s in range(len(streams))]
        self.samples_per_epoch = samples_per_epoch
        self.requested = epoch_counts(
            self.sizes, [s.rule() for s in streams], samples_per_epoch, batch_size, self.whole_batches, self.names
        )
        self.schedule = Schedule.constant(self.requested)
        self.samples = np.zeros(len(streams), dtype=np.int64)  # samples handed to the loop, per stream
        self.batch_seconds = np.zeros(len(streams), dtype=np.float64)  # whole batches: their making time, per stream [s]

    # ---- the order -----------------------------------------------------------------------------
    def global_indices(self) -> np.ndarray:
        """Every sample the streams use, as global indices (each stream's ``indices`` moved by its offset)."""
        parts = [
            off + (np.arange(n, dtype=np.int64) if idx is None else idx) for off, n, idx in zip(self.offsets, self.lengths, self.indices)
        ]
        return np.concatenate(parts)

    def length(self, epoch: int) -> int:
        """The samples of ``epoch`` (every rank together)."""
        return self.schedule.length(epoch)

    def order(self, epoch: int, seed: int, order: OrderOption, chunk_size: int, window_chunks: int, window_shards: int) -> np.ndarray:
        """``epoch``'s global order: each stream's samples in its own order (``order`` over its ``indices``, its own seed
        per pass, ``QUASI_RANDOM`` windows within its shards), laid out by :func:`~stoker.loader.mixing.mixed_order`."""

        def pass_order(s: int, p: int) -> np.ndarray:
            idx = self.indices[s] if self.indices[s] is not None else np.arange(self.lengths[s], dtype=np.int64)
            return epoch_order(order, idx, stream_seed(seed, s), p, chunk_size, window_chunks, self.boundaries[s], window_shards)  # type: ignore[arg-type]

        return mixed_order(self.schedule.counts(epoch), self.schedule.starts(epoch), self.sizes, self.offsets, pass_order,
                           self.batch_size, self.whole_batches)  # fmt: skip

    # ---- weights between epochs ----------------------------------------------------------------
    def set_weights(self, weights: Sequence[float], samples_per_epoch: int | None, from_epoch: int) -> np.ndarray:
        """New counts from ``from_epoch`` on: every stream weighted; the epoch as long as it was unless given.

        Raises:
            ValueError: not one weight (a number >= 0) per stream, or counts that cannot be met.
        """
        checked = check_weights(weights, self.names, "set_weights")
        if samples_per_epoch is not None and (
            isinstance(samples_per_epoch, bool) or not isinstance(samples_per_epoch, (int, np.integer)) or samples_per_epoch < 1
        ):
            raise ValueError(f"samples_per_epoch must be an int >= 1 or None; got {samples_per_epoch!r}")
        total = self.schedule.length(from_epoch) if samples_per_epoch is None else int(samples_per_epoch)
        counts = epoch_counts(self.sizes, [("weight", w) for w in checked], total, self.batch_size, self.whole_batches, self.names)
        self.requested = counts
        self.schedule = self.schedule.change(counts, from_epoch)
        return counts

    # ---- state ---------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """What a position in a mixed epoch depends on besides the counts and the seed: each stream's dataset and samples
        (every shard's checksum-table CRC: the heads not read yet are read first)."""
        self.reader.read_heads()
        out = []
        for s in range(len(self.streams)):
            lo, hi = int(self.reader.stream_shards[s]), int(self.reader.stream_shards[s + 1])
            files = self.reader.shards[lo:hi]
            out.append({
                "name": self.names[s],
                "num_samples": self.lengths[s],
                "shards": [[len(r), r.file_size, r.checksum_table_crc] for r in files],
                "field_table_crc": files[0].field_table_crc,
                "indices": {"count": self.sizes[s], "sha256": _indices_digest(self.indices[s], self.lengths[s])},
            })  # fmt: skip
        return {"streams": out, "mix": self.mode}

    def state(self) -> dict[str, Any]:
        """The part of ``state_dict()`` a mix adds: the counts of every epoch (the weights' history)."""
        return {"phases": self.schedule.to_list()}

    def saved_schedule(self, state: Mapping[str, Any]) -> Schedule:
        """The schedule a state recorded.

        Raises:
            StokerError: a state of a single dataset, or an invalid schedule.
        """
        mix = state.get("mix")
        if not isinstance(mix, Mapping) or "phases" not in mix:
            raise StokerError("loader state was saved by a loader of one dataset, not of a mix of streams (start afresh)")
        try:
            schedule = Schedule.from_list(mix["phases"], len(self.streams))
            if self.whole_batches:
                for first, counts in schedule.phases:
                    if any(c % self.batch_size for c in counts):
                        raise ValueError(f"phase at epoch {first}: counts {list(counts)} are not whole batches of {self.batch_size}")
        except ValueError as exc:
            raise StokerError(f"loader state: mix: {exc}") from None
        return schedule

    def adopt(self, saved: Schedule) -> None:
        """Go on with the counts a state recorded: those of every epoch before it, the ones in force, and any set for
        later epochs (the weights given to the constructor are those of a fresh start; :meth:`set_weights` changes them)."""
        self.schedule = saved
        self.requested = np.array(saved.phases[-1][1], dtype=np.int64)


class MixExtras(BatchExtras):
    """A mixed batch's extras: each sample's index within its stream's dataset (``return_indices``), its stream
    (``return_source``); and the samples of each stream handed out (always counted)."""

    def __init__(self, reader: Reader, fields: Mapping[str, Field], with_lengths: Sequence[str], return_indices: bool,
                 return_source: bool, mix: Mix, recorder: Any) -> None:  # fmt: skip
        super().__init__(reader, fields, with_lengths, return_indices)
        self.return_source = return_source
        self.mix = mix
        self.starts = mix.reader.stream_starts
        self.recorder = recorder

    def __bool__(self) -> bool:
        return True  # every batch counts its streams' samples

    def names(self, fields: Sequence[str]) -> list[str]:
        return output_names(fields, self.with_lengths, self.return_indices) + ([SOURCE_KEY] if self.return_source else [])

    def add(self, pipelines: Sequence[FieldPipeline], outputs: Sequence[Any], indices: np.ndarray) -> list[Any]:
        import torch

        idx = np.asarray(indices, dtype=np.int64)
        stream = np.searchsorted(self.starts, idx, side="right") - 1
        mix = self.mix
        mix.samples += np.bincount(stream, minlength=len(mix.samples))
        rec = self.recorder
        if mix.whole_batches and rec is not None and len(stream):  # one stream's batch: its producer's time is that stream's
            from stoker.observe._recorder import M_DONE, M_START, ROWS

            row = rec.marks[rec.count % ROWS]
            if row[M_DONE] > row[M_START] > 0:
                mix.batch_seconds[stream[0]] += (row[M_DONE] - row[M_START]) * 1e-9
        out: list[Any] = []
        for pipeline, value in zip(pipelines, outputs):
            out.append(value)
            if pipeline.name in self.columns:
                out.append(self.lengths(pipeline, idx))
        if self.return_indices:
            out.append(torch.from_numpy(idx - self.starts[stream]))
        if self.return_source:
            out.append(torch.from_numpy(stream.astype(np.int64)))
        return out


def stats(mix: Mix, epoch: int) -> dict[str, Any]:
    """``stats()["mix"]``: per stream, its samples handed out, their share, its samples in ``epoch``, the time measured for it [s]."""
    reader = mix.reader
    total = max(1, int(mix.samples.sum()))
    counts = mix.schedule.counts(epoch)
    parts = reader.remote.part_stats() if reader.remote is not None else []  # type: ignore[attr-defined]
    remote_of = [s for s in range(len(mix.streams)) if isinstance(mix.streams[s].source, str) and "://" in str(mix.streams[s].source)]
    out: dict[str, Any] = {}
    for s, name in enumerate(mix.names):
        row: dict[str, Any] = {"samples": int(mix.samples[s]), "share": float(mix.samples[s]) / total, "epoch_samples": int(counts[s])}
        if reader.bounded:
            row["read_s"] = float(reader.read_seconds[s])
        if mix.whole_batches:
            row["batch_s"] = float(mix.batch_seconds[s])
        if s in remote_of:
            row.update({f"remote_{k}": v for k, v in parts[remote_of.index(s)].items()})
        out[name] = row
    return out


def report_lines(mix: Mix, epoch: int) -> str:
    """A line per stream for ``report()``: its share of the samples, and the time measured for it per sample."""
    figures = stats(mix, epoch)
    lines = ["streams:"]
    slowest, worst = None, -1.0
    for name, row in figures.items():
        parts = [f"{row['samples']:,} samples ({row['share']:.1%})"]
        seconds = row.get("batch_s", 0.0) + row.get("read_s", 0.0)
        for key, what in (("read_s", "read"), ("batch_s", "batches made"), ("remote_download_s", "downloading")):
            if key in row:
                parts.append(f"{what} {row[key]:.2f} s")
        if row["samples"] and seconds > 0:
            per = seconds / row["samples"]
            parts.append(f"{per * 1e6:.0f} us/sample")
            if per > worst:
                slowest, worst = name, per
        lines.append(f"  {name}: " + ", ".join(parts))
    if slowest is not None and len(figures) > 1:
        lines.append(f"  slowest per sample: {slowest}")
    return "\n".join(lines)
