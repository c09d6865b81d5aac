"""The schedule of a dataset's shards in object storage: which shards the coming epoch reads, downloaded ahead in order.

The loader tells :meth:`ShardSchedule.schedule` the samples of the coming
epoch, in order. Downloader threads fetch the shards in the order of their
first use, at most ``ahead`` shards beyond the one the batches have reached
(the first batch's shards before any other: no download ahead shares the link
with them until they are here), pinned *weakly* until a batch reads them: a download that a batch waits for (of
this process or another sharing the cache) may evict them, and downloads ahead
wait while they would take the room of one (see :mod:`stoker.remote._cache`). A
shard is pinned while a batch reads it (:meth:`ShardSchedule.begin` ..
:meth:`ShardSchedule.done`); the cache evicts the shards not needed again this
epoch first, then those needed latest. :meth:`ShardSchedule.interrupt` and
:meth:`ShardSchedule.close` stop every download at once.

:class:`ShardSchedule` is the part of :class:`stoker.dataset._remote.RemoteShards`
that plans and pins; the rest of that class opens the manifest, the heads and
the cache, and checks what is read.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from stoker._threads import start_thread
from stoker.errors import DatasetFormatError, RemoteError, StokerError

if TYPE_CHECKING:
    from stoker.remote._cache import ShardCache

__all__ = ["ShardSchedule", "ShardStore"]

#: a download ahead that found no room tries again after this long, or when a batch is done with a shard [seconds]
_AHEAD_RETRY = 0.2
#: how long close() waits for the downloader threads, whose requests it has stopped [seconds]
_CLOSE_WAIT = 5.0

# every dataset whose shards are being downloaded: at exit their downloads stop before the loaders' epochs are stopped
_LIVE: weakref.WeakSet[ShardSchedule] = weakref.WeakSet()


def _stop_at_exit() -> None:
    """At exit: every download stops at once (a stopped download deletes its partial file), and the downloader
    threads end, before the loaders' producer threads are joined (which would otherwise wait for their downloads)."""
    live = list(_LIVE)
    for remote in live:
        with contextlib.suppress(Exception):
            remote.interrupt()
    for remote in live:
        with contextlib.suppress(Exception):
            remote._join_downloaders()


def _stop_first_at_exit() -> None:
    """Make :func:`_stop_at_exit` the next exit function to run (atexit runs the last registered first)."""
    atexit.unregister(_stop_at_exit)
    atexit.register(_stop_at_exit)


class ShardStore(Protocol):
    """What the shards of a dataset (or of a mix's datasets) need of their store: a :class:`stoker.remote.Store`, or the
    stores of a mix behind one (:class:`stoker.dataset.mixed.MixedShards`). ``url`` prefixes every key in messages; the
    shard cache downloads with :meth:`download`; :meth:`interrupt` stops every read in flight until :meth:`resume`."""

    url: str

    def download(self, key: str, dest: Path, size: int | None = None) -> int: ...

    def stats(self) -> dict[str, int | float]: ...

    def interrupt(self) -> None: ...

    def resume(self) -> None: ...

    @property
    def interrupted(self) -> bool: ...


class ShardSchedule:
    """The coming epoch's shards, downloaded ahead in order of first use and pinned while batches read them.

    A mixin of :class:`stoker.dataset._remote.RemoteShards`, which sets the
    attributes below and calls :meth:`_init_schedule` once its cache is open.
    """

    url: str
    store: ShardStore
    cache: ShardCache
    entries: list[dict[str, Any]]
    names: list[str]
    sizes: list[int]
    idents: list[str]
    _index: dict[str, int]  # a shard's key in the cache -> the shard
    limit: int
    ahead: int
    download_threads: int

    def shard_url(self, k: int) -> str:  # (RemoteShards')
        raise NotImplementedError

    def _init_schedule(self) -> None:
        """The schedule's state, empty (no epoch planned)."""
        self._lock = threading.Condition()
        self._remaining = np.zeros(len(self.entries), dtype=np.int64)
        self._next_use = np.zeros(len(self.entries), dtype=np.int64)
        self._first_order: list[int] = []  # shards by first use in the epoch
        self._lead_wait: set[int] = set()  # the first batch's shards not yet here: no other is downloaded ahead before them
        self._rank_of = np.zeros(len(self.entries), dtype=np.int64)  # shard -> its place in _first_order
        self._reached = -1  # the furthest place in _first_order that a batch has asked for
        self._pinned: dict[int, Path] = {}  # shard -> its cached file, pinned once by this process while batches read it
        self._ahead: dict[int, Path] = {}  # shard -> its cached file, downloaded ahead: pinned weakly until the epoch is done with it
        self._readers: dict[int, int] = {}  # shard -> batches reading it now (between begin() and done())
        self._active: set[int] = set()  # shards read this epoch that later batches read again
        self._fds: dict[int, int] = {}
        self._retired: dict[int, list[int]] = {}  # shard -> descriptors of files refetched while batches read them
        self._fd_files: dict[int, tuple[int, ...]] = {}  # an open descriptor of a shard -> its file's _identity()
        self._generation = 0  # bumped by every schedule(): an old downloader stops
        self._place = 0  # the next place in _first_order for a downloader thread
        self._retry_at = 0.0  # a download ahead found no room: none before then (time.monotonic())
        self._inflight: set[int] = set()  # shards a downloader thread is fetching
        self._failed: dict[int, BaseException] = {}  # shard -> why its download ahead failed this epoch (a hint for its batch)
        self._stopped = False  # interrupt() (a loader closing) until the next schedule(): batches fetch nothing (see begin())
        self._fetching: dict[int, int] = {}  # thread -> the batches' shard fetches (begin()) it runs now
        self._downloaders: list[threading.Thread] = []

    def schedule(self, shard_of_sample: np.ndarray, batch_size: int, skip: int = 0) -> None:
        """Plan the coming epoch: ``shard_of_sample`` is the shard of each sample of this rank's order (-1: none of these).

        Shards needed by batches ``skip ...`` are downloaded in the order of
        their first use; shards this process pinned that the new epoch does not
        need are let go.
        """
        shards = np.asarray(shard_of_sample, dtype=np.int64)[skip * batch_size :]
        n = len(self.entries)
        batch = np.arange(len(shards), dtype=np.int64) // max(1, batch_size)
        if len(shards) and shards.min() < 0:  # samples of no shard of this store (a mix's local datasets): not scheduled
            mine = shards >= 0
            shards, batch = shards[mine], batch[mine]
        # per shard: the number of batches that need it, and the first one
        pairs = np.unique(batch * n + shards)
        pb, ps = pairs // n, pairs % n
        remaining = np.bincount(ps, minlength=n).astype(np.int64)
        first = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(first, ps, pb)
        order = [int(k) for k in np.argsort(first, kind="stable") if remaining[k] > 0]
        lead = int(np.count_nonzero(first[order] == first[order[0]])) if order else 0  # the first batch's shards
        self.store.resume()  # (after a close(): reads are accepted again)
        with self._lock:
            self._generation += 1
            self._stopped = False
            self._failed.clear()
            self._remaining = remaining
            self._next_use = first
            self._first_order = order
            self._lead_wait = {k for k in order[:lead] if k not in self._pinned and k not in self._ahead}
            self._rank_of = np.full(n, len(order), dtype=np.int64)
            self._rank_of[order] = np.arange(len(order), dtype=np.int64)
            self._reached = -1
            self._place = 0
            self._retry_at = 0.0
            self._active.clear()
            for k in [k for k in self._pinned if remaining[k] == 0 and self._readers.get(k, 0) <= 0]:
                self._unpin(k)
            for k in [k for k in self._ahead if remaining[k] == 0]:
                self._let_go(k)
            generation = self._generation
            self._lock.notify_all()
        _LIVE.add(self)
        _stop_first_at_exit()  # (after the loader's producers registered theirs: this one runs before)
        self._downloaders = [t for t in self._downloaders if t.is_alive()]  # (an earlier epoch's finish their fetch, then stop)
        self._downloaders += [
            start_thread(self._download_ahead, generation, name=f"stoker-download-{i}") for i in range(self.download_threads)
        ]

    def _priority(self, key: str, ident: str) -> float:
        """Eviction order for the cache: heads and shards not needed again this epoch first, then by latest next use."""
        k = self._index.get(key)
        if k is None or ident != self.idents[k] or self._remaining[k] <= 0:
            return float("-inf")
        return -float(self._next_use[k])

    def _download_ahead(self, generation: int) -> None:
        """One of the downloader threads: fetch the epoch's shards in order of first use, ``ahead`` beyond the
        furthest one a batch has asked for (the threads share the next place; several streams fill a link that one
        TCP stream does not: 106 MB/s with one, 166 MB/s with two, 186 MB/s with four on the loopback store capped
        at 200 MB/s). A download that finds no room in the cache (it would take the room of one that a batch waits
        for) is tried again later: downloads ahead are the first to wait."""
        while True:
            with self._lock:
                while self._generation == generation and self._place < len(self._first_order):
                    pause = self._retry_at - time.monotonic()
                    if (pause <= 0 and self._place <= self._reached + self.ahead and self._fits_ahead(self._place)
                            and (not self._lead_wait or self._first_order[self._place] in self._lead_wait)):  # fmt: skip
                        break
                    self._lock.wait(min(0.5, pause) if pause > 0 else 0.5)
                if self._generation != generation or self._place >= len(self._first_order):
                    return
                k = self._first_order[self._place]
                self._place += 1
                if k in self._pinned or k in self._ahead or k in self._inflight or self._remaining[k] <= 0:
                    continue
                self._inflight.add(k)
            path: Path | None = None
            failed = False
            try:
                path = self.cache.pin_ahead(self.names[k], self.sizes[k], self.idents[k])
            except BaseException as exc:  # a hint for the batch that needs the shard: it tries itself (see begin())
                failed = True
                with self._lock:
                    if self._generation == generation and isinstance(exc, StokerError) and not self.store.interrupted:
                        self._failed[k] = exc  # the retries are spent, or the shard was refused: not fetched ahead again
            with self._lock:
                self._inflight.discard(k)
                if self._generation == generation and (failed or path is not None):  # (here, or the batch's own try next)
                    self._lead_wait.discard(k)
                if path is None and not failed and self._generation == generation:  # no room now: this place again, later
                    self._place = min(self._place, int(self._rank_of[k]))
                    self._retry_at = time.monotonic() + _AHEAD_RETRY
                elif path is not None:
                    if self._generation != generation or k in self._ahead or self._remaining[k] <= 0:
                        self.cache.unpin(self.names[k], self.idents[k], ahead=True)
                    else:
                        self._ahead[k] = path
                self._lock.notify_all()

    def _fits_ahead(self, place: int) -> bool:
        """Whether the shard at ``place`` fits beside the shards this process uses (pinned, downloaded ahead, or read
        and needed again), leaving room for one more that a batch reads on demand; with none in use, it always does."""
        from stoker.remote._cache_room import disk_bytes

        used = self._active.union(self._pinned, self._inflight, self._ahead)
        if not used:
            return True
        sizes = self.sizes
        return sum(disk_bytes(sizes[k]) for k in used) + disk_bytes(sizes[self._first_order[place]]) + self.cache.headroom <= self.limit

    def begin(self, k: int) -> None:
        """A batch is about to read shard ``k``: it is downloaded (or waited for) and pinned while batches read it.

        The batch's download has its own retries (the store's ``retry_budget``
        and ``max_attempts``): a download ahead of the same shard that failed
        (its retries spent, the store down then) is a hint, not a verdict; the
        batch tries again, and its error, if it fails too, says both. A shard
        whose bytes were *refused* ahead (downloaded twice, and both times not
        the manifest's: :class:`~stoker.errors.DatasetFormatError`) is not
        downloaded a third and fourth time: the stored object is wrong, not the
        link. After :meth:`interrupt` (a loader closing, from any thread) and
        until the next :meth:`schedule`, it raises at once, and a wait or a
        download in progress ends within milliseconds.

        Raises:
            RemoteError: the store failed this batch's download (naming the attempts, and the download ahead's failure),
                or the loader was closed.
            DatasetFormatError: the shard's bytes were refused (now, or by its download ahead this epoch).
            CacheFullError: no room for it.
        """
        me = threading.get_ident()
        with self._lock:
            if k < len(self._rank_of):
                self._reached = max(self._reached, int(self._rank_of[k]))
                self._lock.notify_all()
            self._readers[k] = self._readers.get(k, 0) + 1
            while k in self._inflight and k not in self._pinned and not self._stopped:
                self._lock.wait(0.5)  # a downloader thread fetches it: its outcome is this batch's, if it succeeds
            if k in self._pinned:
                self._lead_wait.discard(k)
                return
            if self._stopped:
                self._readers[k] -= 1
                raise self._closed_error(k)
            failed = self._failed.get(k)
            self._fetching[me] = self._fetching.get(me, 0) + 1  # (close() lets the store resume only once it ends)
        try:  # a hit when it was downloaded ahead (unless a batch's download evicted it since)
            if isinstance(failed, DatasetFormatError):
                raise DatasetFormatError(
                    self.shard_url(k),
                    f"{failed.problem} (found by its download ahead this epoch; not downloaded again: the stored object is "
                    "not the manifest's)",
                ) from failed
            try:
                path = self.cache.pin(self.names[k], self.sizes[k], self.idents[k])  # its own retries, its own error
            except RemoteError as exc:
                if failed is None or self._stopped:
                    raise
                ahead = failed.problem if isinstance(failed, RemoteError) else f"{type(failed).__name__}: {failed}"
                error = type(exc)(exc.url, exc.key, f"{exc.problem}. Before that, its download ahead had failed: {ahead}")
                error.__notes__ = list(getattr(exc, "__notes__", []))
                raise error from exc
        except BaseException:
            with self._lock:
                self._readers[k] -= 1
                self._lead_wait.discard(k)  # (the batch fails: the downloads ahead need not wait for it)
                self._lock.notify_all()
            raise
        finally:
            with self._lock:
                self._fetching[me] -= 1
                if not self._fetching[me]:
                    del self._fetching[me]
                self._lock.notify_all()
        with self._lock:
            self._failed.pop(k, None)
            if k in self._pinned:
                self.cache.unpin(self.names[k], self.idents[k])
            else:
                self._pinned[k] = path
            self._lead_wait.discard(k)
            self._lock.notify_all()

    def local(self, shards: Iterable[int]) -> bool:
        """Whether :meth:`begin` of each of ``shards`` would not wait for a download now (each one pinned by a batch
        or downloaded ahead)."""
        with self._lock:
            return all(k in self._pinned or k in self._ahead for k in shards)

    def done(self, k: int) -> None:
        """A batch has read what it needs of shard ``k`` into memory: unpinned once no batch is reading it.

        A shard that later batches need again stays cached while room allows
        (the cache evicts it after those no batch needs again), and counts as
        in use for the download-ahead.
        """
        with self._lock:
            self._remaining[k] -= 1
            self._readers[k] -= 1
            if self._remaining[k] > 0:
                self._active.add(k)
            else:
                self._active.discard(k)
                if k in self._ahead:
                    self._let_go(k)
            if self._readers[k] <= 0 and k in self._pinned:
                self._unpin(k)
            self._lock.notify_all()

    def _unpin(self, k: int) -> None:
        for fd in [self._fds.pop(k, -1), *self._retired.pop(k, [])]:
            if fd >= 0:
                self._fd_files.pop(fd, None)
                os.close(fd)
        del self._pinned[k]
        self.cache.unpin(self.names[k], self.idents[k])

    def _let_go(self, k: int) -> None:
        del self._ahead[k]
        self.cache.unpin(self.names[k], self.idents[k], ahead=True)

    def stopped(self) -> bool:
        """Whether downloads are stopped (:meth:`interrupt`, a loader's close) until the next :meth:`schedule`."""
        return self._stopped

    def start_worker(self, target: Any, name: str) -> threading.Thread | None:
        """Start a thread that reads from the store ahead of the batches for the reader (the heads no batch has asked
        for): it ends once :meth:`stopped` (its requests in flight fail from :meth:`interrupt` on), and :meth:`close`
        and exit wait for it as for the downloader threads. ``None``: downloads are stopped now."""
        with self._lock:
            if self._stopped:
                return None
            thread = start_thread(target, name=name)
            self._downloaders.append(thread)
            return thread

    def interrupt(self) -> None:
        """Stop every download now (the downloads ahead, and the batches' own: they raise), whatever the store's speed.

        A loader's ``close()`` calls it once its epoch has ended (from any
        thread); :meth:`close` or the end of :meth:`downloads_stopped` accepts
        the store's requests again, once the batches' fetches in progress have
        ended; a batch's :meth:`begin` raises until the next :meth:`schedule`.
        A wait for a downloader thread, for room, or for another process's
        download, ends too.
        """
        with self._lock:
            self._generation += 1
            self._stopped = True
            self._lock.notify_all()
        self.store.interrupt()
        self.cache.cancel()

    def _closed_error(self, k: int) -> RemoteError:
        return RemoteError(self.url, self.names[k], "not downloaded: the loader was closed (downloads stop until its next epoch)")

    def _settle(self) -> None:
        """After :meth:`interrupt`: wait until the batches' fetches that began before it have ended (each one raises within
        milliseconds: its store requests are refused, its waits in the cache cancelled), at most ``_CLOSE_WAIT`` seconds,
        so that the store accepts requests again only once none of them can start one (a fetch of the calling thread
        itself, interrupted by a signal handler that closes the loader, is not waited for)."""
        me = threading.get_ident()
        deadline = time.monotonic() + _CLOSE_WAIT
        with self._lock:
            while any(t != me for t in self._fetching) and time.monotonic() < deadline:
                self.cache.cancel()  # (a fetch that took its mark in the cache after interrupt()'s cancel)
                self._lock.wait(0.02)

    @contextlib.contextmanager
    def downloads_stopped(self) -> Iterator[None]:
        """Downloads stop at once inside the block (:meth:`interrupt`) and are accepted again after it."""
        self.interrupt()
        try:
            yield
        finally:
            self._settle()
            self.store.resume()

    def close(self) -> None:
        """Stop downloading (at once: requests in flight are stopped) and let go of every pinned shard.

        Waits for the downloader threads at most a few seconds; one that is
        still waiting then (on another process's lock) stops by itself.
        Nothing partial is published: a stopped download's file is deleted.
        """
        self.interrupt()
        with self._lock:
            for k in list(self._pinned):
                self._unpin(k)
            for k in list(self._ahead):
                self._let_go(k)
            self._lock.notify_all()
        self._join_downloaders()
        self._settle()
        self.store.resume()
        _LIVE.discard(self)

    def _join_downloaders(self) -> None:
        """Wait for the downloader threads (stopped: a few milliseconds), at most ``_CLOSE_WAIT`` seconds in all."""
        downloaders, self._downloaders = self._downloaders, []
        deadline = time.monotonic() + _CLOSE_WAIT
        for thread in downloaders:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        self._downloaders = [t for t in downloaders if t.is_alive()]
