"""The :class:`Loader`: compiled per-field pipelines, on threads, into preallocated batches.

This module is the Loader's API: its arguments checked (``_checks``), the dataset opened (``_open``), the
fields' pipelines built, and one method per thing a user asks. Each concept behind a method lives in a module of its
own, a function of the Loader: one epoch at a time (``iter``, ``close``: ``_iteration``), the saved state
(``_state``), the figures (``stats``, ``report``, ``trace``: ``_stats``), each epoch's samples on this rank
(``_share``), batch memory (``_memory``). See docs/ARCHITECTURE.md ("Inside the Loader").
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from stoker._threads import available_cpus
from stoker.dataset.sharded import ShardedReader
from stoker.format import _verify
from stoker.format.reader import Reader
from stoker.loader import _accounting, _checks, _iteration, _memory, _mix, _open, _planner, _share, _state, _stats, _tuning
from stoker.loader._epoch import Epoch, _Producers
from stoker.loader._extras import BatchExtras
from stoker.loader._graph import FieldPipeline, build_pipeline
from stoker.loader.distributed import resolve_rank
from stoker.loader.order import OrderOption, PreparedOrder
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.threads import prefer_tbb

# isort: split
# this module's names defined in its parts: the warnings, the thresholds, the default of batches_ahead
from stoker.loader._memory import default_batches_ahead as default_batches_ahead
from stoker.loader._open import RemoteOrderWarning as RemoteOrderWarning
from stoker.loader._stats import HELD_BATCHES_WARNING as HELD_BATCHES_WARNING
from stoker.loader._stats import STATS_SECTIONS as STATS_SECTIONS
from stoker.loader._stats import HeldBatchesWarning as HeldBatchesWarning

__all__ = [
    "HELD_BATCHES_WARNING",
    "STATS_SECTIONS",
    "HeldBatchesWarning",
    "Loader",
    "OrderOption",
    "RemoteOrderWarning",
    "default_batches_ahead",
]

if TYPE_CHECKING:
    from stoker.dataset._remote import RemoteShards


class Loader:
    """Iterate over a stoker file in batches of torch tensors.

    Each field runs its pipeline (a decoder, then transforms). The compiled part
    of every pipeline runs on ``num_workers`` threads without the GIL, writing
    into memory allocated once; producer threads prepare ``batches_ahead``
    batches ahead of your loop.

    Args:
        fname: the stoker file, or a sharded dataset: a folder (its manifest's
            shards, or its ``*.stoker`` files), a glob pattern or a list of
            files (see ``docs/scale.md``); or a mix of datasets, a list of
            :class:`~stoker.loader.mixing.Stream` (see ``docs/mixing.md``).
        batch_size: samples per batch.
        num_workers: threads for the compiled parts; ``-1`` for every CPU this
            process may use (its affinity set).
        os_cache: ``True``: memory-map and let the OS page cache keep the file
            (best when it fits in RAM); a file of at most 64 MiB
            (``STOKER_IN_MEMORY_BYTES``) is read once into the loader's own memory
            instead, where random rows read faster (huge pages). ``False``: read each batch's bytes into a
            bounded cache of the loader's own and free them when the batch is
            done, so the process's memory stays bounded for files larger than
            RAM (about three batches' pages; see ``docs/scale.md``); use it with
            ``QUASI_RANDOM`` so that reads stay within a region of the file.
        order: :class:`OrderOption`.
        distributed: load this rank's share of every epoch (see
            :mod:`stoker.loader.distributed`): all ranks derive the epoch's
            global order from the same seed and each takes an equal
            contiguous block of it; every rank has ``len(loader)`` batches.
            Rank and world size come from ``rank`` and ``world_size``, or from
            the initialized ``torch.distributed`` process group.
        seed: the seed of orders and random augmentations, an integer in
            [0, 2**64); ``None`` draws one (see :attr:`seed`). The same seed
            gives the same batches whatever ``num_workers``.
        indices: the samples to use (default: all): integer indices (repeats
            allowed; each occurrence gets its own random augmentation) or a
            boolean mask with one entry per sample.
        pipelines: field name -> list of operations; a field mapped to
            ``None`` is skipped; missing fields get their default decoder and
            ``ToTensor()``.
        custom_fields: field name -> Field class, for fields of types this
            stoker does not know.
        drop_last: drop the last incomplete batch (``False``, as the
            DataLoader; FFCV's default is ``True``).
        batches_ahead: batches prepared ahead of your loop. ``None`` (the
            default): 3, or more for small batches (up to 8 per producer thread,
            while they take at most 4 MiB per producer): waking a thread costs the
            same for a small batch as for a big one, so small batches need more
            of them queued.
        recompile: rebuild the pipelines at the start of every epoch, so that
            changes to operations' parameters between epochs (progressive
            resizing: ``decoder.output_size = (res, res)``) take effect.
        compile: compile pipelines with Numba (default: on; see
            :class:`~stoker.pipeline.compiler.Compiler`).
        debug: compile with bounds checks (and without parallel loops), so
            that an operation indexing out of bounds raises a ``LoaderError``
            instead of corrupting memory; slower. ``None``: as set by
            ``Compiler.debug()`` / ``NUMBA_BOUNDSCHECK=1`` (default off).
        chunk_size: samples per chunk for ``QUASI_RANDOM`` (default: 8 batches).
        window_chunks: chunks shuffled together in ``QUASI_RANDOM``.
        window_shards: shards whose chunks a ``QUASI_RANDOM`` window mixes
            (default 1: a window stays within its shard, and a batch reads one
            or two shards). Over shards written in an order that matters, mix
            ``k`` of them: the epoch then reads groups of ``k`` shards one after
            another (a dataset in object storage needs a cache of a little more
            than ``2 * k`` shards). See ``docs/remote.md``.
        named: yield each batch as a dict, field name -> output, in the
            file's field order (skipped fields absent), instead of a tuple.
        rank: this process's rank, in [0, world_size) (with ``distributed=True``).
        world_size: the number of ranks (with ``distributed=True``).
        return_indices: also yield the batch's samples' indices in the file,
            a ``(B,)`` int64 CPU tensor: last in a tuple, ``"index"`` in a dict
            (a field named ``index`` is then refused with ``named=True``).
            Join per-sample metadata with it after shuffling.
        return_lengths: also yield the lengths of variable-size fields (bytes
            and JSON: bytes; ragged arrays: rows), a ``(B,)`` int64 CPU tensor
            right after each such field in a tuple, ``"<field>_lengths"`` in
            a dict. ``True``: every loaded bytes, JSON and ragged field; or a
            list of their names. A length counts the entries the padded batch
            holds (``RaggedArrayDecoder(max_length=m)`` cuts at ``m``).
            :attr:`output_names` lists a batch's outputs in order.
        check_data: check every data block (16 MiB of columns or heap) a batch
            reads against the CRC-32 the file stores, the first time this
            process reads it (shared by the process's Loaders of the same,
            unchanged files); a mismatch ends the epoch with
            ``DatasetFormatError`` naming the file, the block's bytes and its
            samples. Once every block is checked a batch costs nothing more.
            ``False`` reads without the check (for storage you trust);
            ``None``: on unless the environment sets ``STOKER_VERIFY=0``. For a
            dataset in object storage, each shard is checked whole when it is
            downloaded (a shard that fails is downloaded once more, then
            refused), and every block read from a shard this process did not
            download (an earlier run's, another process's) is checked as above.
        storage_options: for a URL (``s3://``, ``gs://``, ``az://``,
            ``https://``; see ``docs/remote.md``): credentials and endpoint,
            passed to the store (default: as the AWS tools read them,
            ``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, profiles).
        cache_dir: for a URL: the local folder that caches its shards, shared
            by every process that names it (default: ``~/.cache/stoker/remote``
            or ``$STOKER_CACHE_DIR/remote``). Made ``0700``; a folder that
            belongs to another user or that others can write is refused (see
            ``cache_shared``).
        cache_limit: for a URL: the most disk the cache takes (shards, heads,
            downloads in progress: as ``du`` counts), all processes sharing
            ``cache_dir`` together [bytes] (default: half the space its disk
            has for it when the Loader opens). At least one shard per batch
            that the processes sharing it read at once, plus one: see
            ``docs/remote.md`` for the sizing rule.
        cache_shared: for a URL: ``cache_dir`` is shared with other users on
            purpose (a group's cache on a node): it may belong to another user
            and be writable by its group; every file is still checked before
            use. Default ``False``: such a folder is refused.
        download_ahead: for a URL: shards downloaded ahead of the batches, in
            the order the epoch first needs them (default 4).
        samples_per_epoch: a mix: the samples of an epoch, every stream
            together (default: the weighted streams' sizes plus the other
            streams' counts; see ``docs/mixing.md``).
        mix: a mix: ``"samples"`` (default): every batch holds each stream's
            share of it, to within rounding; ``"batches"``: each batch is one
            stream's (for streams whose samples differ in shape), each stream's
            count a whole number of batches.
        return_source: a mix: also yield each sample's stream (its place in
            the list), a ``(B,)`` int64 CPU tensor, after the indices
            (``"source"`` in a dict). With a mix ``return_indices`` yields each
            sample's index within its stream's dataset.

    Raises:
        ValueError: an argument of the wrong type or value (the message names
            it and says what to pass).
        TypeError: ``fname``, ``pipelines`` or ``custom_fields`` of the wrong type.
        PipelineError: a pipeline that cannot be built (an unknown field, a
            class instead of an instance, no decoder first, two decoders, an
            operation in the wrong place or on the wrong data).
        DatasetNotFoundError: a path that does not exist (a file, a shard, a
            folder, a pattern that matches nothing); a ``FileNotFoundError``
            too, and a ``DatasetFormatError``.
        DatasetFormatError: a file that is not a stoker file (and, from
            ``next()``, a data block whose checksum does not match).
        StokerError: ``ToDevice('cuda')`` without CUDA.

    Iteration: each ``iter(loader)`` (each ``for`` loop) runs one epoch, the
    epoch after the previous one (or the one set by :meth:`set_epoch` or
    :meth:`load_state_dict`); an epoch left early by ``break`` still counts.
    One epoch runs at a time: a second ``iter()`` while an iterator is alive
    and not exhausted raises, as does calling ``next()`` from two threads at once.

    Batches live in memory the loader reuses, but a batch you still hold is
    never overwritten: before reusing a batch's memory the loader checks
    whether anything still refers to it, and gives the slot fresh memory if
    so. Keeping every batch (``list(loader)``) is correct; it costs memory, as
    it would with the DataLoader.

    Example:
        >>> loader = Loader("data.stoker", batch_size=1024, order=OrderOption.RANDOM, seed=0)  # doctest: +SKIP
        >>> for x, y in loader:  # doctest: +SKIP
        ...     loss = criterion(model(x), y.flatten())
    """

    def __init__(
        self,
        fname: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        batch_size: int,
        num_workers: int = -1,
        os_cache: bool = True,
        order: OrderOption = OrderOption.SEQUENTIAL,
        distributed: bool = False,
        seed: int | None = None,
        indices: Sequence[int] | np.ndarray | None = None,
        pipelines: Mapping[str, Sequence[Any] | None] | None = None,
        custom_fields: Mapping[str, type] | None = None,
        drop_last: bool = False,
        batches_ahead: int | None = None,
        recompile: bool = False,
        compile: bool | None = None,
        debug: bool | None = None,
        chunk_size: int | None = None,
        window_chunks: int = 8,
        window_shards: int = 1,
        named: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        return_indices: bool = False,
        return_lengths: bool | Sequence[str] = False,
        check_data: bool | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        download_ahead: int | None = None,
        cache_shared: bool = False,
        samples_per_epoch: int | None = None,
        mix: str = "samples",
        return_source: bool = False,
    ) -> None:
        # every argument is checked before the file is opened (see _checks; docs/misuse.md lists the messages)
        streams = _mix.streams_of(fname)
        if streams is None:
            fname = _checks.check_fname(fname)
        _mix.check_options(streams, indices, samples_per_epoch, mix, return_source)
        _checks.check_int("batch_size", batch_size)
        _checks.check_order(order)
        _checks.check_int("batches_ahead", batches_ahead, none_ok=True)
        _checks.check_num_workers(num_workers)
        _checks.check_int("window_chunks", window_chunks)
        _checks.check_int("window_shards", window_shards)
        _checks.check_int("chunk_size", chunk_size, none_ok=True)
        for flag, value in (("os_cache", os_cache), ("distributed", distributed), ("drop_last", drop_last), ("recompile", recompile),
                            ("named", named), ("return_indices", return_indices)):  # fmt: skip
            _checks.check_bool(flag, value)
        _checks.check_bool("compile", compile, none_ok=True)
        _checks.check_bool("debug", debug, none_ok=True)
        _checks.check_bool("check_data", check_data, none_ok=True)
        custom_fields = _checks.check_custom_fields(custom_fields)
        self.rank, self.world_size = resolve_rank(bool(distributed), rank, world_size)
        if self.world_size > 1 and seed is None:
            raise ValueError(
                f"seed must be given with distributed=True and world_size {self.world_size} > 1: every rank derives the "
                "epoch's order from it, so all ranks need the same seed; got seed=None (pass seed=...)"
            )
        if streams is not None:
            _mix.check_ranks(mix, self.world_size, bool(drop_last))
        prefer_tbb()
        # a Reader, or a ShardedReader for shards or os_cache=False; a URL: a RemoteReader (always bounded); a mix's streams
        self.reader: Reader | ShardedReader
        self.reader, os_cache = _open.open_reader(fname, streams, custom_fields, os_cache, check_data, storage_options, cache_dir,
                                                  cache_limit, download_ahead, cache_shared)  # fmt: skip
        #: the dataset's store and cache (a URL: :class:`stoker.dataset._remote.RemoteShards`), else None
        self.remote: RemoteShards | None = getattr(self.reader, "remote", None)
        if self.remote is not None:
            _open.warn_random_order(self.remote, order)
        # big metadata tables: validated block by block as batches first reach them (Reader.validate_samples)
        self.reader.validate_metadata(lazy=True)
        self._identity = _open.identity(self.reader)
        self.batch_size = int(batch_size)
        self.num_workers = available_cpus() if num_workers == -1 else int(num_workers)
        self.os_cache = bool(os_cache)
        self.order = order
        self.drop_last = bool(drop_last)
        self._batches_ahead_given = None if batches_ahead is None else int(batches_ahead)
        self.batches_ahead = 3  # made final with the pipelines (see _build)
        self.recompile = bool(recompile)
        self._explicit_seed = seed is not None
        self.seed = (
            int(np.random.SeedSequence().generate_state(1, np.uint64)[0] >> 1) if seed is None else _checks.check_seed(seed, none_ok=True)
        )
        self.chunk_size = int(chunk_size) if chunk_size else 8 * self.batch_size
        self._chunk_size_given = chunk_size is not None  # (else it follows batch_size: a state's mismatch names batch_size only)
        self.window_chunks = int(window_chunks)
        self.window_shards = int(window_shards)
        if isinstance(self.reader, ShardedReader) and self.reader.cache is not None and order is OrderOption.QUASI_RANDOM:
            # samples smaller than a page: the bounded cache keeps a window's pages, which its batches share
            windows = len(streams) if streams is not None else 1  # (a mix reads a window of every stream at a time)
            self.reader.cache.keep_bytes = windows * self.reader.keep_for_window(self.chunk_size * self.window_chunks)
        self.named = bool(named)
        n = len(self.reader)
        #: a mix's streams, schedule and figures (``Loader([Stream(...), ...])``), else None
        self._mix = _mix.Mix(streams, self.reader, self.batch_size, mix, samples_per_epoch, _checks.check_indices) if streams else None  # type: ignore[arg-type]
        if self._mix is not None:
            indices = self._mix.global_indices()
        self._indices = None if indices is None else _checks.check_indices(indices, n, self.reader.path)  # None: every sample
        self._num_indices = n if self._indices is None else len(self._indices)
        self._indices_digest: str | None = None
        # memory is allocated for the samples a batch can hold: a batch_size larger than the selection costs nothing
        self._slot_batch = min(self.batch_size, max(1, self._num_indices)) if self._mix is None else self.batch_size
        pipelines = _checks.check_pipelines(pipelines, self.reader.fields, self.reader.path)
        self._pipeline_spec = pipelines
        self._compile = compile
        self._debug = debug
        self.pipelines: list[FieldPipeline] = []
        self._consumer_holds = 0  # batches a bounded consumer keeps besides the loop's own (expect_held)
        self._build()
        _checks.check_devices(self.pipelines)
        with_lengths = _checks.check_lengths(return_lengths, self.pipelines, self.reader.fields)
        #: check each data block a batch reads against its stored CRC-32, the first time in this process (format._verify)
        self.check_data = _verify.env_enabled() if check_data is None else bool(check_data)
        self._data_check: _verify.DataCheck | None = None  # made at the first epoch (see _iteration)
        self._data_covered = False  # every data block of this loader's samples checked (after its first whole epoch)
        self._recorder = _accounting.new_recorder(self)  # per-step accounting (stoker.observe); None: STOKER_ACCOUNTING=0
        self._extras: BatchExtras
        if self._mix is not None:
            self._extras = _mix.MixExtras(cast(Reader, self.reader), self.reader.fields, with_lengths, bool(return_indices),
                                          bool(return_source), self._mix, self._recorder)  # fmt: skip
        else:
            self._extras = BatchExtras(cast(Reader, self.reader), self.reader.fields, with_lengths, bool(return_indices))
        if self.named:
            _checks.check_output_names(self.output_names)
        self._next_epoch = 0
        self._skip_batches = 0
        self._seen: tuple[int, np.ndarray] | None = None  # (epoch, its positions handed out before this run: elastic resume)
        self._position = (0, 0)  # (epoch, batches handed to the user in it)
        self._run_start = (0, 0)  # (epoch, batches skipped) of the epoch iterated last: its first batch's place
        self._ran_to_end = False  # the epoch iterated last ended by StopIteration, not left early (state_dict)
        self._compile_garbage = False  # an iter() or next() compiled: garbage may hold an epoch left by break
        self._slot_counter = 0  # batches ever assigned a slot: slots continue across epochs
        self._held = [0]  # slots given fresh memory because a kept batch still used them
        self._ring_memory: Any = None  # what epochs keep from one to the next (_ring.RingMemory: semaphores, addresses)
        self._last_slots: tuple[int | None, int | None] = (None, None)  # the slots of the last two batches handed out
        self._prepared_order: PreparedOrder | None = None  # the next epoch's order, being shuffled (compiled epochs)
        self._order_buffers: list[np.ndarray | None] = [None, None]  # [the running epoch's prepared order, a free one] (_share)
        self._made_by_loop = [0]  # batches your loop made itself instead of waiting for a producer (compiled epochs)
        self._tuner = _tuning.Tuner()  # each epoch's producers and batches ahead, chosen at its start (STOKER_TUNING=0: as set)
        self._warned_held = False
        self._active: weakref.ref[Epoch] | None = None
        self._starting = threading.Lock()  # held by the iter() that starts an epoch
        self._pool: _Producers | None = None  # producer threads, started by the first epoch, kept until close()
        self._transfer: Any = None  # the CUDA transfer of pipelines ending in ToDevice('cuda') (stoker.device._stream)
        # copies queued as soon as producers make a batch, ahead of the loop (off: queued when the loop takes the batch,
        # behind the user's stream: the earlier behaviour, kept to compare; STOKER_COPY_AHEAD=0)
        self._copy_ahead = os.environ.get("STOKER_COPY_AHEAD", "1") != "0"
        self.wait_seconds = {"consumer_waiting_for_producer": 0.0}

    def _build(self) -> None:
        """Build every field's pipeline (declare, compile, fuse); memory is allocated at the first epoch."""
        with Compiler.enabled(Compiler.is_enabled() if self._compile is None else self._compile), Compiler.debug(self._debug):
            built: list[FieldPipeline] = []
            for position, (name, field) in enumerate(self.reader.fields.items()):
                ops = self._pipeline_spec.get(name, "default")
                if ops is None:
                    continue
                if ops == "default":
                    from stoker.transforms import ToTensor

                    ops = [field.default_decoder(), ToTensor()]
                built.append(build_pipeline(name, field, list(ops), cast(Reader, self.reader), position, self._slot_batch))
        self.pipelines = built
        self._reentrant, self._producers, self.batches_ahead, self._tokens_per_producer = _memory.sizes(
            built, self.num_workers, self._batches_ahead_given, self._slot_batch
        )
        self._num_slots = _memory.slots_needed(self._producers, self._tokens_per_producer, self._consumer_holds)
        # stage times and waits, per producer and for the loop's own batches (see _stats.counters)
        self._producer_seconds, self._producer_wait, self._loop_seconds = _stats.counters(built, self._producers)
        self._allocated = False
        # how epochs make the heads of batches (decided at the first epoch, after memory is allocated)
        self._plan: _planner.Plan | None = None

    # ---- sizes and state -------------------------------------------------------------------
    def __len__(self) -> int:
        """The batches still to come in this epoch: those the next ``for`` over the loader yields (on each rank: the
        same on every rank).

        A fresh epoch: all its batches. After :meth:`load_state_dict` of a state saved in the middle of an
        epoch: the batches left of it, on as many ranks as saved it or on another number (this rank's share of
        what is left). Once an epoch is over (every batch handed out, or left by ``break``): the next epoch's
        (a mix's epochs may differ in length). While a ``for`` loop runs: the batches that loop yields in all,
        the same at every step (the iterator's ``len()`` counts down).
        """
        running = self._run_start if self._iterating() else None
        epoch, skip = running if running is not None else (self._next_epoch, self._skip_batches)
        return max(0, self._batches_in(epoch) - skip)

    def _batches_in(self, epoch: int) -> int:
        """This rank's batches in ``epoch`` (in a resumed one: of its share of the positions left)."""
        return _share.batches_in(self, epoch)

    @property
    def indices(self) -> np.ndarray:
        """The samples this loader uses, as int64 dataset indices (all of them made on first use when not given)."""
        if self._indices is None:
            self._indices = np.arange(self._num_indices, dtype=np.int64)
        return self._indices

    @property
    def fields(self) -> list[str]:
        """Names of the fields the loader yields, in order."""
        return [p.name for p in self.pipelines]

    @property
    def output_names(self) -> list[str]:
        """What each batch holds, in order (the keys of named batches).

        The fields, each variable-size field's ``"<name>_lengths"`` after it
        (``return_lengths``), and ``"index"`` last (``return_indices``).
        """
        return self._extras.names(self.fields)

    def __reduce__(self) -> Any:
        """Refuse pickling (a Loader holds threads, memory maps and compiled code), saying what to do instead."""
        raise TypeError(
            "a Loader cannot be pickled (it holds threads, a memory-mapped file and compiled code): build the Loader inside "
            "each worker process instead (pass the file path and the arguments), and use state_dict() to carry its position"
        )

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """The samples this loader (this rank) loads in ``epoch``, in order (after ``drop_last`` and padding)."""
        return self._epoch_share(epoch)[0]

    def _epoch_share(self, epoch: int, prepared: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """This rank's samples of ``epoch`` and their global positions (see :func:`stoker.loader._share.epoch_share`)."""
        return _share.epoch_share(self, epoch, prepared)

    def _prepare_order(self, epoch: int) -> PreparedOrder | None:
        """Start ``epoch``'s order, for producers to shuffle while they wait (``RANDOM``, small enough); else ``None``."""
        return _share.prepare_order(self, epoch)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run epoch ``epoch`` from its start (as the DataLoader samplers' ``set_epoch``)."""
        _share.set_epoch(self, epoch)

    def set_weights(self, weights: Sequence[float], samples_per_epoch: int | None = None) -> None:
        """A mix: give the streams new weights, from the next epoch that starts from its beginning on.

        Every stream becomes a weighted one (``repeat``/``choose`` counts are replaced);
        each stream goes on in its sequence of passes where the epochs before left it.
        The state (:meth:`state_dict`) records the counts of every epoch, so a resume
        anywhere gives the same batches. Weights never change within an epoch.

        Args:
            weights: one weight (a number >= 0) per stream, in the streams' order.
            samples_per_epoch: the new epoch length (default: the length of the epoch the weights start at).

        Raises:
            StokerError: not a mix, or called while an epoch is being iterated (call it between epochs).
            ValueError: not one weight per stream, or weights that sum to 0.
        """
        _share.set_weights(self, weights, samples_per_epoch)

    def state_dict(self, unseen: int = 0) -> dict[str, Any]:
        """Where the loader is: restore it with :meth:`load_state_dict` to continue exactly.

        Inside a running loop (an iterator alive whose epoch is not over, even
        one paused between ``next()`` calls) the position is that of the last
        batch handed to you, not of the producer threads: call it there to save
        a position mid-epoch. Once no loop runs it is where the next ``for``
        starts, as the loader would go on: after an epoch left early (``break``,
        ``close()``, an error or an interrupt ends the epoch) the next epoch's
        first batch, the rest of the epoch left is not resumed. The state also records what the position depends
        on (the dataset, batch size, order, ``drop_last``, indices, seed), so
        that it cannot be restored into a loader that would yield other batches.

        Distributed: ``batches_consumed`` counts the batches this rank handed out
        in ``epoch``; with ``world_size`` (the ranks of this run) and ``seen``
        (the epoch's global positions handed out by earlier runs, if it was
        resumed on another number of ranks) it says which samples of the epoch
        every rank has seen when the ranks step in lockstep (DDP), so one rank's
        state resumes the job on any number of ranks. Ranks that do not step
        together: merge every rank's state with
        :func:`stoker.loader.distributed.combine_states`. See ``docs/remote.md``.

        Args:
            unseen: batches handed out that your training loop has not received
                yet (a wrapper that reads ahead, such as :func:`stoker.prefetch`,
                passes how many it holds): the state is that of the batch before
                them, so that a resume yields them again. At most the batches
                handed out in the current epoch. After an epoch left early it
                is ignored: those batches went with the epoch.

        Raises:
            ValueError: ``unseen`` negative or more than the batches handed out in this epoch.
        """
        return _state.state_dict(self, unseen)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next iteration yields the batch after it.

        The state may come from a job on another number of ranks (elastic
        resume): one rank's state when the ranks stepped in lockstep (DDP), or
        :func:`~stoker.loader.distributed.combine_states` of all of them. On as
        many ranks as saved it, each rank continues its own share of the epoch;
        on another number, the ranks split the epoch's global positions nobody
        has handed out yet into equal blocks (``len(self)`` batches each, for the
        rest of this epoch), so every sample of the epoch is loaded once and
        keeps its random augmentation. The next epoch is a whole one.

        Raises:
            StokerError: a state of another version, with invalid values, or
                saved by a loader of another configuration (the message names
                each difference). A loader built with ``seed=None`` takes the
                saved seed; one built with another explicit seed refuses it.
        """
        _state.load_state_dict(self, state)

    def expect_held(self, batches: int) -> None:
        """Say that the consumer of this loader keeps up to ``batches`` batches alive besides the one its loop uses.

        A consumer that reads ahead by a bounded number of batches (:func:`stoker.prefetch`,
        a flow whose queues hold batches) calls this once: the loader then keeps that
        many more batch slots, so that in steady state it reuses their memory instead of
        giving fresh memory to slots that are still held, and no :class:`HeldBatchesWarning`
        fires for them. Takes effect at the next epoch; the largest value given counts.

        Raises:
            ValueError: ``batches`` not an int >= 0.
        """
        _memory.expect_held(self, batches)

    # ---- iteration -------------------------------------------------------------------------
    def _allocate(self) -> None:
        """Give the pipelines memory for ``_num_slots`` batches (at the first epoch, and when the slot count changed)."""
        if not self._allocated:
            transfer = _memory.allocate(self.pipelines, self._num_slots, self._slot_batch, self._copy_ahead)
            if transfer is not None:
                self._transfer = transfer
            self._allocated = True

    def _iterating(self) -> bool:
        """Whether the last epoch is alive and not over (garbage not collected: see :mod:`stoker.loader._iteration`)."""
        return _iteration.iterating(self)

    def _loop_running(self) -> bool:
        """Whether an epoch is being iterated, whether or not the collector has run since a ``break``."""
        return _iteration.loop_running(self)

    def _still_iterating(self) -> bool:
        """Whether an epoch is being iterated, garbage collected first (for a refusal: it costs a collection)."""
        return _iteration.still_iterating(self)

    def __iter__(self) -> Iterator[tuple[Any, ...] | dict[str, Any]]:
        return _iteration.start(self)

    def compile(self) -> float:
        """Compile now everything this loader's epochs run, into the disk caches; the seconds it took.

        A job in a new environment compiles the code of its pipelines on its first
        batch (the library's own kernels come prebuilt; the producer loop compiles in
        the background meanwhile). Call this ahead of the job, for instance when
        building a container image, so that the job compiles nothing: it makes the first
        batch of the next epoch (read, decoded and dropped) and waits for the loop. The
        loader's position is left as it was. ``stoker warmup`` does the same from the
        command line. See ``docs/loader.md`` ("Cold start").
        """
        from stoker.loader.warmup import compile_loader

        return compile_loader(self)

    def close(self) -> None:
        """Stop the running epoch, if any, and the producer threads (safe to call any number of times).

        The threads are kept from one epoch to the next; they also stop when the
        Loader is collected, when an epoch fails, and at exit. A later epoch starts them again.
        """
        _iteration.close(self)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # no module globals (contextlib): at interpreter exit they may be None already; and a Loader whose __init__ was
        # interrupted (Ctrl-C while it opened the file) has nothing to close
        try:
            if "_active" in self.__dict__:
                self.close()
        except Exception:
            pass

    def _note_held(self) -> None:
        """Consumer side, at the start of ``next()``: warn once when kept batches keep piling up."""
        _stats.note_held(self)

    # ---- where time goes ---------------------------------------------------------------------
    def stats(self) -> dict[str, dict[str, Any]]:
        """Seconds spent so far, per field and stage, and waiting on either side; and the per-step accounting.

        ``compiled[...]`` is the fused compiled part (reading the file and every
        compiled operation); other keys are Python stages run once per batch.
        A field named as one of the sections below (``loader``, ``accounting``,
        ``remote``, ``mix``) is keyed ``field:<name>``.
        ``loader`` holds the time producers waited for your loop to take a
        batch and the time your loop waited for a batch, the time your loop
        waited for the GPU (``consumer_waiting_for_device``: a copy out of a
        slot's page-locked memory still queued behind your GPU work when the
        slot came round again), ``kept_batches``:
        slots given fresh memory because a batch you kept still used them, and
        ``batches_made_by_loop``: batches your loop's thread made itself, the
        one it asked for or later ones, because no producer had started them
        while it waited (compiled epochs), and ``producers_last_epoch`` and
        ``batches_ahead_last_epoch`` (in all): what the last epoch ran, chosen
        at its start (``nan`` before the first; ``docs/loader.md``, Threads).

        ``remote`` (a dataset in object storage): the shard cache's and the
        store's counters: ``downloads``, ``hits``, ``evictions``,
        ``refetches``, ``requests``, ``retries`` (of transient errors: all,
        and ``retries_throttled``, ``retries_server``, ``retries_cut``,
        ``retries_connection``, ``retries_changed`` by kind),
        ``retry_wait_s`` [seconds], ``resumed_downloads``,
        ``bytes_downloaded`` [bytes], ``cache_bytes`` and
        ``cache_peak_bytes`` [bytes]. :meth:`report` sums them up in a line.

        ``mix`` (a mix of streams, see ``docs/mixing.md``): per stream, by name,
        ``samples`` handed to your loop, their ``share``, ``epoch_samples`` (its
        count in the current epoch), and the time measured for it: ``read_s``
        (bounded cache), ``batch_s`` (``mix="batches"``), ``remote_download_s``...;
        ``remote["streams"]`` holds each remote stream's downloads.

        ``accounting`` holds what :meth:`report` says, as numbers with their
        units in their keys (``stall_s``, ``stall_share``, ``stall_p95_ms``, and
        per stage ``stall_s``, ``p50_ms``, ``items``...: see
        ``docs/observability.md``); it is empty with ``STOKER_ACCOUNTING=0``.
        """
        return _stats.stats(self)

    def report(self, gather: bool = False) -> str:
        """Whether training is data-bound, in a few lines: the share of its time the loop waited for batches, the verdict,
        the stage that caused most of the waiting (with its time per batch) and one suggestion.

        Args:
            gather: with ``torch.distributed`` initialised, gather every rank's figures (one collective call:
                every rank must call ``report(gather=True)``) and name the rank that waits most.

        Returns:
            The report's text (``stats()["accounting"]`` holds its numbers).

        Example:
            >>> for x, y in loader:  # doctest: +SKIP
            ...     train_step(x, y)
            >>> print(loader.report())  # doctest: +SKIP
        """
        return _stats.report(self, gather)

    def trace(self, path: str | os.PathLike[str]) -> AbstractContextManager[None]:
        """Record a timeline of this loader while the block runs, streamed to ``path`` (complete when the block ends).

        The file is Chrome trace-event JSON (open it in https://ui.perfetto.dev or
        ``chrome://tracing``): a track per producer thread (each batch and its
        stages), the loop's track (its waits for batches, its steps, the Python
        stages and copies to the device it runs), and spans lower layers record
        with :func:`stoker.observe.record_span` (downloads). The events are written
        as the run goes (memory does not grow with it), and the file is valid JSON
        however the block ends (an exception, Ctrl-C).

        Example:
            >>> with loader.trace("run.json"):  # doctest: +SKIP
            ...     for x, y in loader:
            ...         train_step(x, y)
        """
        return _stats.trace(self, path)

    def __repr__(self) -> str:
        ranks = f", rank={self.rank}, world_size={self.world_size}" if self.world_size > 1 else ""
        return (
            f"Loader({str(self.reader.path)!r}, batch_size={self.batch_size}, order={self.order.name}, fields={self.fields}, "
            f"batches={len(self)}{ranks})"
        )
