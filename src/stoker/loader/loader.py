"""The :class:`Loader`: compiled per-field pipelines, on threads, into preallocated batches."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import mmap
import os
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from stoker._threads import available_cpus, interrupts_blocked
from stoker.dataset.sharded import ShardedReader, open_dataset
from stoker.errors import DatasetFormatError, StokerError
from stoker.format import _verify
from stoker.format.reader import Reader
from stoker.loader import _accounting, _checks, _engine, _mix, _planner
from stoker.loader._epoch import Epoch, _Producers, _register_atexit, compiles_here, producer_pool
from stoker.loader._extras import BatchExtras
from stoker.loader._graph import FieldPipeline, build_pipeline
from stoker.loader.distributed import check_intervals, elastic_share, resolve_rank, seen_after, share_batches
from stoker.loader.order import PREPARED_ORDER_MAX, OrderOption, PreparedOrder, epoch_order
from stoker.observe import _report, _trace
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.threads import prefer_tbb

if TYPE_CHECKING:
    from stoker.dataset._remote import RemoteReader, RemoteShards
    from stoker.dataset.mixed import MixedReader

_STATE_VERSION = 4  # 3: RANDOM orders from the compiled shuffle (a version-2 position would resume another order); 4: elastic
_READ_VERSIONS = (3, 4)  # a version-3 state is a version-4 one with its world size in the config and nothing seen before
#: kept batches (slots given fresh memory because the user still held them) before a warning
HELD_BATCHES_WARNING = 128
STATS_SECTIONS = ("loader", "accounting", "remote", "mix")  # stats()'s keys that are not fields (a field of such a name: "field:<name>")
_PAGE = mmap.PAGESIZE
#: why a second iter() is refused while an epoch runs or starts
_ALREADY_ITERATED = (
    "this Loader is already being iterated: an iterator from an earlier iter() is still alive and not exhausted "
    "(a nested loop over the same Loader, or two threads iterating it). Finish or delete that iterator, or call "
    "loader.close(); use one Loader per thread"
)


class HeldBatchesWarning(UserWarning):
    """Many batches were still held by the user when their memory was due for reuse."""


class RemoteOrderWarning(UserWarning):
    """``order=RANDOM`` over a dataset in object storage that is larger than its cache."""


def _check_seed(seed: Any) -> int:
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an integer in [0, 2**64) or None; got {type(seed).__name__} {seed!r} (pass an int, e.g. seed=0)")
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64) or None; got {seed}")
    return int(seed)


def _check_indices(indices: Any, n: int, path: Any) -> np.ndarray:
    """``indices`` as int64 dataset indices: integers, or a boolean mask of one entry per sample."""
    arr = np.asarray(indices)
    if arr.ndim != 1:
        raise ValueError(f"indices must be one-dimensional (a list of sample indices or a boolean mask); got shape {arr.shape}")
    if arr.dtype == np.bool_:
        if len(arr) != n:
            raise ValueError(f"indices given as a boolean mask need one entry per sample of {path} ({n}); got {len(arr)}")
        return np.flatnonzero(arr).astype(np.int64)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"indices must be integers or a boolean mask; got dtype {arr.dtype} (first value {arr[0]!r})")
    bad = (arr < 0) | (arr >= n)
    if bad.any():
        raise IndexError(f"indices must lie in [0, {n}) for {path}; got {arr[bad][0]} at position {int(np.argmax(bad))}")
    return arr.astype(np.int64)


def _indices_sha256(indices: np.ndarray | None, n: int) -> str:
    """The digest of the int64 indices (``None``: ``0 .. n - 1``, hashed a piece at a time, never made whole)."""
    digest = hashlib.sha256()
    if indices is not None:
        digest.update(np.ascontiguousarray(indices, dtype=np.int64).tobytes())
    for start in range(0, n if indices is None else 0, 1 << 20):
        digest.update(np.arange(start, min(n, start + (1 << 20)), dtype=np.int64).tobytes())
    return digest.hexdigest()[:32]


def _file_identity(path: Any) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _dataset_files(reader: Reader | ShardedReader) -> list[Any]:
    """The file of a Reader, or every shard of a ShardedReader (none of a dataset in object storage: its heads are
    files of the shard cache, never rewritten in place and maybe evicted, and its data is read, not mapped; a mix's
    local files only)."""
    remote_shard = getattr(reader, "remote_shard", None)
    if remote_shard is not None:  # a mix (stoker.dataset.mixed.MixedReader)
        return [p for p, j in zip(reader.paths, remote_shard.tolist()) if j < 0]  # type: ignore[union-attr]
    if getattr(reader, "remote", None) is not None:
        return []
    return list(getattr(reader, "paths", [reader.path]))


#: the default ``batches_ahead``: at least this many batches ahead, at most ``_MOST_AHEAD``, within ``_AHEAD_BYTES``
_LEAST_AHEAD, _MOST_AHEAD, _AHEAD_BYTES = 3, 8, 4 << 20


def default_batches_ahead(batch_bytes: int, producers: int = 1) -> int:
    """``batches_ahead`` when none is given: 3, up to 8 per producer thread for batches small enough
    that they take at most 4 MiB per producer.

    Handing a batch from a producer thread to your loop costs a thread wake-up (tens of
    microseconds on a virtual machine) whatever the batch's size; with small batches
    (a table's rows) more of them queued keeps the producers from waiting for tokens.
    Measured on Otto (batch 1024, 389 KB): 3 -> 8 ahead made an epoch 13-15% faster, 32 slower
    (one producer); with two producers 16 ahead was 3-6% faster than 8, 32 slower.
    """
    producers = max(1, producers)
    if batch_bytes <= 0:
        return _MOST_AHEAD * producers
    return max(_LEAST_AHEAD, min(_MOST_AHEAD * producers, _AHEAD_BYTES * producers // batch_bytes))


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
            (best when it fits in RAM). ``False``: read each batch's bytes into a
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
        # a Reader, or a ShardedReader (same reading API) for shards or os_cache=False; a URL: a RemoteReader (always bounded)
        remote = isinstance(fname, str) and "://" in fname
        _checks.check_int("cache_limit", cache_limit, none_ok=True)
        _checks.check_int("download_ahead", download_ahead, none_ok=True)
        _checks.check_bool("cache_shared", cache_shared)
        options = {"storage_options": storage_options, "cache_dir": cache_dir, "cache_limit": cache_limit, "ahead": download_ahead,
                   "cache_shared": cache_shared or None}  # fmt: skip
        if remote:
            options["verify"] = _verify.env_enabled() if check_data is None else bool(check_data)
            os_cache = False
        self.reader: Reader | ShardedReader
        if streams is not None:  # a mix: the streams' datasets read as one (any in object storage: all bounded)
            self.reader = _mix.open_streams(streams, custom_fields, not os_cache, storage_options, cache_dir, cache_limit,
                                            _verify.env_enabled() if check_data is None else bool(check_data), download_ahead,
                                            bool(cache_shared))  # fmt: skip
            os_cache = os_cache and not self.reader.bounded
        else:
            self.reader = open_dataset(fname, custom_fields=custom_fields, bounded=not os_cache, **options)
        #: the dataset's store and cache (a URL: :class:`stoker.dataset._remote.RemoteShards`), else None
        self.remote: RemoteShards | None = getattr(self.reader, "remote", None)
        if self.remote is not None:
            self._warn_random_order(order)
        # big metadata tables: validated block by block as batches first reach them (Reader.validate_samples)
        self.reader.validate_metadata(lazy=True)
        self._identity = [_file_identity(p) for p in _dataset_files(self.reader)]
        self.batch_size = int(batch_size)
        self.num_workers = available_cpus() if num_workers == -1 else int(num_workers)
        self.os_cache = bool(os_cache)
        self.order = order
        self.drop_last = bool(drop_last)
        self._batches_ahead_given = None if batches_ahead is None else int(batches_ahead)
        self.batches_ahead = 3  # made final with the pipelines (see _build)
        self.recompile = bool(recompile)
        self._explicit_seed = seed is not None
        self.seed = int(np.random.SeedSequence().generate_state(1, np.uint64)[0] >> 1) if seed is None else _check_seed(seed)
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
        self._mix = _mix.Mix(streams, self.reader, self.batch_size, mix, samples_per_epoch, _check_indices) if streams else None  # type: ignore[arg-type]
        if self._mix is not None:
            indices = self._mix.global_indices()
        self._indices = None if indices is None else _check_indices(indices, n, self.reader.path)  # None: every sample
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
        self._data_check: _verify.DataCheck | None = None  # made at the first epoch (see _start_epoch)
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
        self._made_by_loop = [0]  # batches your loop made itself instead of waiting for a producer (compiled epochs)
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
        # Pipelines whose operations keep no per-thread state can prepare several batches at once:
        # one producer thread per worker, each running its batches' compiled code on one thread.
        # Otherwise one producer spreads each batch's samples over the workers.
        # (only the heads count: the tails run on the loop's thread, one batch at a time)
        reentrant = self._reentrant = all(getattr(s.op, "reentrant", False) for p in self.pipelines for s in p.steps[: p.head])
        self._producers = max(1, min(self.num_workers, 2)) if reentrant else 1
        if self._batches_ahead_given is not None:
            self.batches_ahead = self._batches_ahead_given
        else:
            self.batches_ahead = default_batches_ahead(sum(p.slot_bytes(self._slot_batch) for p in self.pipelines), self._producers)
        self._tokens_per_producer = max(1, -(-self.batches_ahead // self._producers))
        self._num_slots = self._slots_needed()
        # stage times and waits, one dict per producer, every key created here: producers only add to
        # values, so stats() can read them while an epoch runs
        self._producer_seconds: list[dict[str, dict[str, float]]] = [
            {p.name: dict.fromkeys(p.stage_names, 0.0) for p in self.pipelines} for _ in range(self._producers)
        ]
        self._producer_wait = [{"producer_waiting_for_consumer": 0.0} for _ in range(self._producers)]
        # the same, for batches the loop's own thread made (compiled epochs: while it waited, batches no producer had started)
        self._loop_seconds: dict[str, dict[str, float]] = {p.name: dict.fromkeys(p.stage_names, 0.0) for p in self.pipelines}
        self._allocated = False
        # how epochs make the heads of batches (decided at the first epoch, after memory is allocated)
        self._plan: _planner.Plan | None = None

    def _warn_random_order(self, order: OrderOption) -> None:
        """``RANDOM`` over a remote dataset larger than its cache: every batch may need another shard."""
        remote = self.remote
        if remote is None:
            return
        total = sum(remote.sizes)
        if order is OrderOption.RANDOM and remote.limit is not None and total > remote.limit:
            where = remote.url or f"the mix's datasets in object storage {[p.url for p in getattr(remote, 'parts', [])]}"
            warnings.warn(
                f"order=RANDOM over {where} ({total} bytes in {len(remote.sizes)} shards) with cache_limit={remote.limit}: "
                "the dataset does not fit in the cache, so every batch may need a different shard and shards are downloaded "
                "again and again. Use order=OrderOption.QUASI_RANDOM (windows within shards; see docs/remote.md), or a "
                "cache_limit of the dataset's size",
                RemoteOrderWarning,
                stacklevel=3,
            )

    def _slots_needed(self) -> int:
        """Batches in flight: the two the loop may hold, those a bounded consumer holds, the queued ones, one per producer."""
        return self._producers * (self._tokens_per_producer + 1) + 2 + self._consumer_holds

    def _resize_slots(self) -> None:
        """Take a new slot count from the next epoch on (memory is allocated again then)."""
        if self._slots_needed() != self._num_slots:
            self._num_slots = self._slots_needed()
            self._allocated = False
            self._plan = None

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
        return share_batches(self._positions(epoch), self._seen_in(epoch), self.world_size, self.batch_size, self.drop_last)

    def _positions(self, epoch: int) -> int:
        """The global positions of ``epoch`` (every rank together): the samples used, or a mix's epoch length."""
        return self._num_indices if self._mix is None else self._mix.length(epoch)

    def _seen_in(self, epoch: int) -> np.ndarray:
        """The global positions of ``epoch`` handed out before this run (elastic resume), as intervals; usually none."""
        if self._seen is not None and self._seen[0] == epoch:
            return self._seen[1]
        return _NOTHING_SEEN

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
        """This rank's samples of ``epoch`` and their global positions (``Share.runs``: the augmentation keys).

        An epoch resumed on another number of ranks: this rank's share of the positions left (``distributed.elastic_share``).

        ``prepared``: the epoch is starting (no producer is running): use the order prepared for it, if any.
        """
        order = self._take_prepared_order(epoch) if prepared else None
        if self._mix is not None:  # the streams' samples, laid out in exact proportions (loader.mixing)
            order = self._mix.order(epoch, self.seed, self.order, self.chunk_size, self.window_chunks, self.window_shards)
        if order is None:
            shards = getattr(self.reader, "shard_starts", None)  # QUASI_RANDOM windows stay within shards
            order = epoch_order(self.order, self.indices, self.seed, epoch, self.chunk_size, self.window_chunks, shards,
                                self.window_shards)  # fmt: skip
        share = elastic_share(len(order), self._seen_in(epoch), self.rank, self.world_size, self.batch_size, self.drop_last)
        return share.samples(order), share.runs()

    def _order_args(self, epoch: int) -> tuple[Any, ...]:
        """What ``epoch_order(RANDOM, ...)`` depends on (the indices by identity: they are never changed in place)."""
        return (self.order, self.seed, epoch, id(self.indices), len(self.indices))

    def _prepare_order(self, epoch: int) -> PreparedOrder | None:
        """Start ``epoch``'s order, for producers to shuffle while they wait (``RANDOM``, small enough); else ``None``."""
        if self.order is not OrderOption.RANDOM or self._num_indices > PREPARED_ORDER_MAX or self._mix is not None:
            return None
        self._prepared_order = PreparedOrder.start(self.indices, self.seed, epoch, self._order_args(epoch))
        return self._prepared_order

    def _take_prepared_order(self, epoch: int) -> np.ndarray | None:
        prepared, self._prepared_order = self._prepared_order, None
        if prepared is None or prepared.args != self._order_args(epoch):
            return None
        return prepared.finish()

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run epoch ``epoch`` from its start (as the DataLoader samplers' ``set_epoch``)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0; got {epoch!r}")
        self._next_epoch, self._skip_batches = int(epoch), 0
        self._position = (int(epoch), 0)
        self._seen = None

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
        if self._mix is None:
            raise StokerError("set_weights is for a mix of datasets: Loader([Stream(...), Stream(...)], ...)")
        if self._still_iterating():
            epoch, consumed = self._position
            raise StokerError(
                f"set_weights was called within epoch {epoch} (after {consumed} of its {self._batches_in(epoch)} batches): the weights of an "
                "epoch never change while it runs. Call it between epochs (after the for loop over the loader); it then applies "
                "from the next epoch"
            )
        at_start = self._skip_batches == 0 and len(self._seen_in(self._next_epoch)) == 0
        self._mix.set_weights(weights, samples_per_epoch, self._next_epoch if at_start else self._next_epoch + 1)

    def _config(self) -> dict[str, Any]:
        """What the position in an epoch depends on, besides the seed (and a mix's counts: its state's ``mix``)."""
        if self._mix is not None:
            return {
                **self._mix.config(),
                "batch_size": self.batch_size,
                "order": self.order.name,
                "drop_last": self.drop_last,
                "chunk_size": self.chunk_size,
                "window_chunks": self.window_chunks,
                **({"window_shards": self.window_shards} if self.window_shards != 1 else {}),
            }
        if self._indices_digest is None:
            self._indices_digest = _indices_sha256(self._indices, self._num_indices)
        files = [shard for shard in getattr(self.reader, "shards", [self.reader])]
        dataset: dict[str, Any] = {
            "num_samples": len(self.reader),
            "file_size": sum(r.file_size for r in files),
            "field_table_crc": files[0].field_table_crc,
            "checksum_table_crc": files[0].checksum_table_crc,
        }
        if len(files) > 1:  # every shard: its samples, size and checksum-table CRC, in order
            dataset["shards"] = [[len(r), r.file_size, r.checksum_table_crc] for r in files]
        return {
            "dataset": dataset,
            "batch_size": self.batch_size,
            "order": self.order.name,
            "drop_last": self.drop_last,
            "indices": {"count": self._num_indices, "sha256": self._indices_digest},
            "chunk_size": self.chunk_size,
            "window_chunks": self.window_chunks,
            **({"window_shards": self.window_shards} if self.window_shards != 1 else {}),  # (states saved before it read as 1)
        }

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
        epoch, consumed = self._position
        if isinstance(unseen, bool) or not isinstance(unseen, (int, np.integer)) or not 0 <= unseen <= consumed:
            raise ValueError(f"unseen must be an int in [0, {consumed}] (the batches handed out in epoch {epoch}); got {unseen!r}")
        if not self._loop_running() and not (self._ran_to_end and consumed >= self._batches_in(epoch)):
            # no loop runs: where the next `for` starts, the next epoch after one left early (break, close(), an error,
            # with its batches ahead of a consumer). One that ran to its end counts `unseen` back below (a consumer that
            # read its end ahead still holds them)
            epoch, consumed = self._next_epoch, self._skip_batches
        else:
            consumed -= int(unseen)
        if consumed >= self._batches_in(epoch):
            epoch, consumed = epoch + 1, 0
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "epoch": epoch,
            "batches_consumed": consumed,
            "world_size": self.world_size,
            "rank": self.rank,
            "seen": self._seen_in(epoch).tolist(),
            "config": self._config(),
            "path": str(self.reader.path),
            **({"mix": self._mix.state()} if self._mix is not None else {}),
        }

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
        if not isinstance(state, Mapping):
            raise StokerError(f"load_state_dict needs the dict returned by state_dict(); got {type(state).__name__}")
        version = state.get("version")
        if version not in _READ_VERSIONS:
            raise StokerError(
                f"loader state of version {version!r}; this stoker reads versions {list(_READ_VERSIONS)} (save it again with state_dict())"
            )
        missing = {"seed", "epoch", "batches_consumed", "config"} - set(state)
        if missing:
            raise StokerError(f"loader state lacks {sorted(missing)}")
        for key in ("seed", "epoch", "batches_consumed"):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise StokerError(f"loader state: {key} must be an int >= 0; got {value!r}")
        saved_ranks = state.get("world_size", state["config"].get("world_size") if isinstance(state["config"], Mapping) else None)
        schedule = self._mix.saved_schedule(state) if self._mix is not None else None  # a mix: the counts of every epoch
        n = self._num_indices if schedule is None else schedule.length(int(state["epoch"]))
        try:
            saved_ranks = resolve_rank(True, 0, saved_ranks)[1]
            seen = check_intervals(state.get("seen", []), n)
        except (TypeError, ValueError) as exc:
            raise StokerError(f"loader state: {exc}") from None
        n_batches = share_batches(n, seen, saved_ranks, self.batch_size, self.drop_last)
        if state["batches_consumed"] > n_batches:
            raise StokerError(
                f"loader state: batches_consumed is {state['batches_consumed']}, more than the {n_batches} batches of an epoch"
                + (f" on {saved_ranks} ranks" if saved_ranks > 1 else "")
            )
        seed = _check_seed(state["seed"])
        differences = _differences(state["config"], self._config())
        saved_config = state["config"] if isinstance(state["config"], Mapping) else {}
        if not self._chunk_size_given and saved_config.get("chunk_size") == 8 * _int_or(saved_config.get("batch_size"), -1):
            # both the default, 8 batches: it differs only because batch_size does (named above), which the user set
            differences = [d for d in differences if not d.startswith("chunk_size: ")]
        elif not self._chunk_size_given:
            differences = [d + " (the default: 8 batches)" if d.startswith("chunk_size: ") else d for d in differences]
        saved_shards = state["config"].get("window_shards", 1) if isinstance(state["config"], Mapping) else 1
        if saved_shards != self.window_shards and self.window_shards == 1:  # (a loader with window_shards > 1 compares it above)
            differences.append(f"window_shards: saved {saved_shards!r}, this loader 1")
        if self._explicit_seed and seed != self.seed:
            differences.append(f"seed: saved {seed}, this loader {self.seed}")
        if differences:
            raise StokerError(
                "loader state was saved by a loader that yields other batches: " + "; ".join(differences)
                + " (build the Loader with the same dataset and arguments, or start afresh)"
            )  # fmt: skip
        self.close()
        self.seed = seed
        epoch, consumed = int(state["epoch"]), int(state["batches_consumed"])
        if consumed == n_batches and (consumed > 0 or saved_ranks == self.world_size):  # the saved run had finished the epoch
            epoch, consumed, seen = epoch + 1, 0, _NOTHING_SEEN
        elif saved_ranks != self.world_size:  # every rank of the saved run handed out `consumed` batches of its share
            seen = seen_after(n, seen, saved_ranks, self.batch_size, self.drop_last, [consumed] * saved_ranks)
            consumed = 0
        if self._mix is not None and schedule is not None:  # the counts of every epoch, as the saved run had them
            self._mix.adopt(schedule)
        self._seen = (epoch, seen) if len(seen) else None
        self._next_epoch, self._skip_batches = epoch, consumed
        self._position = (epoch, consumed)
        self._ran_to_end = False

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
        if isinstance(batches, bool) or not isinstance(batches, (int, np.integer)) or batches < 0:
            raise ValueError(f"expect_held needs an int >= 0 (the batches the consumer holds); got {batches!r}")
        if int(batches) > self._consumer_holds:
            self._consumer_holds = int(batches)
            self._resize_slots()

    # ---- iteration -------------------------------------------------------------------------
    def _allocate(self) -> None:
        if self._allocated:
            return
        cuda_devices = {s.op.device for p in self.pipelines for s in p.steps if getattr(s.op, "is_cuda", False)}  # type: ignore[attr-defined]
        pinned = False
        if len(cuda_devices) > 1:
            raise StokerError(
                f"pipelines copy to several CUDA devices {sorted(map(str, cuda_devices))}; one Loader feeds one device "
                "(make one Loader per device)"
            )
        if cuda_devices:
            import torch

            if not torch.cuda.is_available():
                raise StokerError(f"a pipeline has ToDevice({sorted(map(str, cuda_devices))}) but CUDA is not available")
            from stoker.device._stream import StreamTransfer

            self._transfer = StreamTransfer(next(iter(cuda_devices)), self._num_slots, ahead=self._copy_ahead)
            pinned = True
        for p in self.pipelines:
            p.allocate(self._num_slots, self._slot_batch, pinned and p.wants_pinned)
        self._allocated = True

    def _check_file(self) -> None:
        """Refuse a file (any shard) changed in place since it was opened (reading it could kill the process with SIGBUS)."""
        for path, opened in zip(_dataset_files(self.reader), self._identity):
            try:
                now = _file_identity(path)
            except OSError:
                continue  # removed or renamed: the mapping still holds the file we opened
            if now[:2] == opened[:2] and now != opened:
                raise DatasetFormatError(
                    path,
                    "changed on disk since this Loader opened it; a file rewritten in place while it is mapped can kill the "
                    "process (SIGBUS). Write a new file and rename it over the old one (DatasetWriter does), then make a new Loader",
                )

    def _iterating(self) -> bool:
        active = self._active() if self._active is not None else None
        return active is not None and not active.finished

    def _loop_running(self) -> bool:
        """Whether an epoch is being iterated, whether or not the collector has run since a ``break``.

        Only an ``iter()`` or ``next()`` that compiled leaves garbage that can hold an epoch after ``break``
        (:func:`~stoker.loader._epoch.compiles_here`): then the first call collects once (a fraction of a second);
        otherwise an epoch left by ``break`` is gone at once (CPython frees it with the loop's last reference).
        """
        if self._iterating() and self._compile_garbage:
            self._compile_garbage = False
            return self._still_iterating()
        return self._iterating()

    def _still_iterating(self) -> bool:
        """Whether an epoch is being iterated, garbage collected first (for a refusal: it costs a collection).

        An epoch left by ``break`` is gone with its iterator, unless garbage holds it: the epoch whose first
        batch compiled the loop is on that compile's stack, which Numba's typing keeps in a reference cycle
        (a failed overload's exception, its traceback, their frames) until the collector runs.
        """
        if not self._iterating():
            return False
        gc.collect()
        return self._iterating()

    def __iter__(self) -> Iterator[tuple[Any, ...] | dict[str, Any]]:
        if self._recorder is not None:  # (report()'s first batch is timed from the first iter(), as the user waits)
            self._recorder.note_iter()
        # the check and the start of the epoch are one step: a second thread's iter() while the first one is still
        # starting its epoch (which releases the GIL: the shuffle, the compiled claims) is refused, never run beside it
        if not self._starting.acquire(blocking=False):
            raise StokerError(_ALREADY_ITERATED)
        it: Epoch | None = None
        running = self._pool.current if self._pool is not None else None
        try:
            # one step for Ctrl-C too: SIGINT/SIGTERM wait until the epoch has started (a fraction of a millisecond, once
            # compiled), and one that arrived meanwhile ends the epoch it interrupted before it reaches you
            compiled = compiles_here()
            with interrupts_blocked():
                it = self._start_epoch()
            if compiles_here() != compiled:  # its garbage may hold the epoch after break (see _loop_running)
                self._compile_garbage = True
            return it
        except BaseException:
            if it is not None:
                it.close()
            elif self._pool is not None and self._pool.current is not running:  # this call had started the producers
                self._pool.stop_epoch()
            raise
        finally:
            self._starting.release()

    def _start_epoch(self) -> Epoch:
        if self._still_iterating():  # (no reference to the running epoch here: the error's traceback would keep it alive)
            raise StokerError(_ALREADY_ITERATED)
        self._check_file()
        if self._pool is not None and self._pool.busy():  # the producers of an epoch dropped without close() (break)
            self._pool.stop_epoch()
        if self.recompile and self._allocated:
            self._build()
        self._allocate()
        epoch, skip = self._next_epoch, self._skip_batches
        self._next_epoch, self._skip_batches = epoch + 1, 0
        self._position = self._run_start = (epoch, skip)
        self._ran_to_end = False
        slot_base = self._slot_counter
        self._slot_counter += max(0, self._batches_in(epoch) - skip)
        _register_atexit()
        if self._plan is None:
            with Compiler.enabled(Compiler.is_enabled() if self._compile is None else self._compile), Compiler.debug(self._debug):
                self._plan = _planner.plan(self)
        plan = self._plan
        if self.check_data and self._data_check is None and self.remote is None:
            self._data_check = _verify.DataCheck(self.reader, [p.name for p in self.pipelines])
        elif self.check_data and self.remote is not None:  # the reader checks each block as it reads it (a mix: local ones too)
            cast("RemoteReader | MixedReader", self.reader).check_data([p.name for p in self.pipelines])
        if plan.loop is not None and not self.reader._metadata_valid:
            # the compiled loop reads the metadata without the per-batch validation of a big, lazily validated index
            plan = _planner.python_plan("metadata validated per batch")
        it: Epoch = _engine.CompiledEpoch(self, plan, epoch, skip, slot_base, producer_pool(self))
        self._active = weakref.ref(it)
        return it

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
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        self._active = None
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            stopped = getattr(self.reader, "downloads_stopped", None)  # (an epoch dropped unclosed: its producers may download)
            with stopped() if stopped is not None else contextlib.nullcontext():
                pool.shutdown()
        remote = getattr(self, "remote", None)
        if remote is not None:  # no download ahead, no shard pinned (a later epoch schedules its own)
            remote.close()

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
        if not self._warned_held and self._held[0] >= HELD_BATCHES_WARNING:
            self._warned_held = True
            warnings.warn(
                f"{self._held[0]} batches were still in use when the loader was about to reuse their memory; each got fresh "
                "memory (a kept batch is never overwritten), so memory grows with every batch kept. Keep only what you "
                "need (e.g. model outputs, or .clone() a slice) if this is not on purpose",
                HeldBatchesWarning,
                stacklevel=3,
            )

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
        while it waited (compiled epochs).

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
        key = {p.name: f"field:{p.name}" if p.name in STATS_SECTIONS else p.name for p in self.pipelines}
        out: dict[str, dict[str, Any]] = {k: {} for k in key.values()}
        for producer in [*self._producer_seconds, self._loop_seconds]:
            for field, stages in producer.items():
                for stage, seconds in list(stages.items()):
                    out[key[field]][stage] = out[key[field]].get(stage, 0.0) + seconds
        loader = dict(self.wait_seconds)
        transfer = self._transfer
        loader["consumer_waiting_for_device"] = transfer.waited_ns / 1e9 if transfer is not None else 0.0
        loader["producer_waiting_for_consumer"] = sum(w["producer_waiting_for_consumer"] for w in self._producer_wait)
        loader["kept_batches"] = float(self._held[0])
        loader["batches_made_by_loop"] = float(self._made_by_loop[0])
        out["loader"] = loader
        out["accounting"] = _report.summarize(self._recorder) if self._recorder is not None else {}
        if self.remote is not None:  # a dataset in object storage: downloads, cache hits, retries, the cache's size [bytes]
            out["remote"] = self.remote.stats()
        if self._mix is not None:  # per stream: samples handed out, the time measured for it (see docs/mixing.md)
            out["mix"] = _mix.stats(self._mix, self._position[0])
            if self.remote is not None:
                out["remote"]["streams"] = {name: {k[7:]: v for k, v in row.items() if k.startswith("remote_")}
                                            for name, row in out["mix"].items() if "remote_downloads" in row}  # fmt: skip
        return out

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
        if self._recorder is None:
            return f"{self!r}: accounting is off (STOKER_ACCOUNTING=0)"
        summary = _report.summarize(self._recorder)
        text = _report.render(summary, _report.gather(summary) if gather else None)
        if self._mix is not None:
            text = text.rstrip("\n") + "\n" + _mix.report_lines(self._mix, self._position[0])
        if self.remote is not None:  # a dataset in a store: its downloads and the retries of its faults
            text = text.rstrip("\n") + "\n" + self.remote.summary()
        return text

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
        return _trace.tracing(self._recorder, path)

    def __repr__(self) -> str:
        ranks = f", rank={self.rank}, world_size={self.world_size}" if self.world_size > 1 else ""
        return (
            f"Loader({str(self.reader.path)!r}, batch_size={self.batch_size}, order={self.order.name}, fields={self.fields}, "
            f"batches={len(self)}{ranks})"
        )


_NOTHING_SEEN = np.zeros((0, 2), dtype=np.int64)


def _int_or(value: Any, default: int) -> int:
    """``value`` if it is an int (not a bool), else ``default`` (a saved state's field, not yet checked)."""
    return int(value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else default


def _differences(saved: Any, current: Mapping[str, Any], prefix: str = "") -> list[str]:
    if not isinstance(saved, Mapping):
        return [f"{prefix or 'config'}: saved {saved!r}, this loader {dict(current)!r}"]
    out = []
    for key, value in current.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.extend(_differences(saved.get(key), value, name + "."))
        elif saved.get(key) != value:
            out.append(f"{name}: saved {saved.get(key)!r}, this loader {value!r}")
    return out
