"""Virtual storage: several files, or a bounded cache of them, seen as one ``uint8`` array.

Two kinds of storage share one layout, in which file ``k`` starts at
``bases[k]``, a multiple of the page size (:func:`layout`):

* :func:`map_files`: every file memory-mapped read-only at its base inside one
  reserved address range (an anonymous ``PROT_NONE`` mapping, then each file
  mapped over it with ``MAP_FIXED``). Heap pointers of file ``k`` plus
  ``bases[k]`` address its bytes in the one array.
* :class:`PageCache`: anonymous memory (``MAP_PRIVATE | MAP_ANONYMOUS |
  MAP_NORESERVE``) of the same size, in which nothing is resident until
  :meth:`PageCache.acquire` reads the pages that a batch needs (``preadv``,
  nearby ranges coalesced into one read) and :meth:`PageCache.release` frees
  them again (``madvise(MADV_DONTNEED)``) once no running batch needs them.
  :meth:`PageCache.drop` forgets every page of a file whose bytes changed
  (a cached shard downloaded again): those no batch holds at once, the others
  when released, and a batch that held one while it was dropped is marked
  (:attr:`Ticket.stale`): its bytes may be the old file's, it must not be used.

Lifetime: an address range is unmapped only when the object that owns it is
garbage collected, and every numpy array made from it keeps that object alive
through its ``base`` chain: no array, and so no compiled code, can ever read
an unmapped address.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stoker.errors import DatasetFormatError

PAGE = mmap.PAGESIZE
_MAP_FIXED = 0x10  # Linux and macOS
_PROT_NONE = 0
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
_MAP_FAILED = ctypes.c_void_p(-1).value
_LOADING, _READY = 1, 2
#: a read of more than this many bytes is split (Linux returns at most about 2 GiB per call)
_MAX_READ = 1 << 30
_libc: Any = None


def _lib() -> Any:
    """libc's ``mmap`` and ``munmap``, loaded on first use (nothing happens at import)."""
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = lib
    return _libc


def align_up(n: int, to: int = PAGE) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


def layout(sizes: Sequence[int]) -> tuple[np.ndarray, int]:
    """Page-aligned bases of files of these sizes [bytes], back to back, and the total size."""
    bases = np.zeros(len(sizes), dtype=np.int64)
    end = 0
    for k, size in enumerate(sizes):
        bases[k] = end
        end = align_up(end + int(size))
    return bases, end


class _Region:
    """An address range mapped with ``mmap`` through libc; unmapped when this object is collected.

    Numpy sees it through ``__array_interface__`` (read-only ``uint8``), and
    every array made from it keeps it alive.
    """

    def __init__(self, size: int) -> None:
        lib = _lib()
        self.size = max(int(size), PAGE)
        addr = lib.mmap(None, self.size, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot reserve {self.size} bytes of address space: {os.strerror(err)}")
        self.addr = int(addr)
        finalizer = weakref.finalize(self, lib.munmap, self.addr, self.size)
        finalizer.atexit = False  # at exit a producer thread may still read it; the process unmaps it anyway

    def map_file(self, offset: int, fd: int, length: int) -> None:
        """Map ``length`` bytes of the open file ``fd`` read-only at ``offset`` inside the range."""
        addr = _lib().mmap(self.addr + offset, length, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        if addr is None or addr == _MAP_FAILED or addr != self.addr + offset:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {"data": (self.addr, True), "shape": (self.size,), "typestr": "|u1", "version": 3}


def map_files(paths: Sequence[Path], sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Memory-map the files, each at its page-aligned base, as one read-only ``uint8`` array.

    Returns:
        ``(storage, bases)``: the array (``bases[-1] + sizes[-1]`` bytes long)
        and the offset of each file in it.

    Raises:
        DatasetFormatError: a file cannot be opened or mapped (names it).
    """
    bases, total = layout(sizes)
    region = _Region(total)
    for path, base, size in zip(paths, bases.tolist(), sizes):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise DatasetFormatError(path, f"cannot be read: {exc.strerror or exc}") from exc
        try:
            region.map_file(base, fd, int(size))
        except OSError as exc:
            raise DatasetFormatError(path, f"cannot be memory-mapped: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)  # the mapping keeps the file
    end = int(bases[-1]) + int(sizes[-1]) if len(sizes) else 0
    return np.asarray(region)[:end], bases


def page_runs(starts: np.ndarray, ends: np.ndarray, max_gap: int) -> tuple[np.ndarray, np.ndarray]:
    """The runs of pages ``[first, stop)`` that cover the byte ranges ``[starts, ends)``.

    Ranges are sorted and merged; two runs less than ``max_gap`` pages apart
    become one (the pages between are read too: one larger read instead of two).
    Empty ranges are ignored.
    """
    s, e = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    keep = e > s
    s, e = s[keep], e[keep]
    if len(s) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    first, stop = s // PAGE, -(-e // PAGE)
    order = np.argsort(first, kind="stable")
    first, stop = first[order], np.maximum.accumulate(stop[order])
    breaks = np.flatnonzero(first[1:] > stop[:-1] + max_gap) + 1  # a new run begins past the gap
    return first[np.concatenate(([0], breaks))], stop[np.concatenate((breaks - 1, [len(first) - 1]))]


class Ticket(list):  # type: ignore[type-arg]
    """The pages a batch holds (a list of page numbers, for :meth:`PageCache.release`), and when it took them.

    ``parts`` holds, per :meth:`PageCache.acquire` it gathers, the cache's drop
    count at that acquire and its first and last page; ``+=`` of another
    ticket gathers its parts too. :meth:`PageCache.release` sets :attr:`stale`
    when a page was dropped (:meth:`PageCache.drop`) while the ticket held it:
    the batch may have read the replaced file's bytes and must be made again.
    """

    def __init__(self, pages: Sequence[int] = (), parts: Sequence[tuple[int, int, int]] = ()) -> None:
        super().__init__(pages)
        self.parts: list[tuple[int, int, int]] = list(parts)
        #: set by :meth:`PageCache.release`: a page of this ticket was dropped while it was held
        self.stale = False

    def __iadd__(self, other: Any) -> Ticket:  # type: ignore[misc]  # (list += keeps the object: RemoteReader gathers its parts)
        self.extend(other)
        self.parts += getattr(other, "parts", [])
        return self


class PageCache:
    """Anonymous memory laid out as the files, holding only the pages that running batches need.

    Each page has a count of the running batches that need it, kept under a
    lock: :meth:`acquire` counts a batch's pages and reads those not yet
    present; :meth:`release` frees a page (``MADV_DONTNEED``, after which it
    reads as zeros) only when its count falls to zero. A page being read by
    one thread is waited for, not read again, by another. So at most the
    pages of the batches between their ``acquire`` and ``release`` are
    resident, plus up to ``keep_bytes`` of pages that no batch holds, kept
    (least recently released first out) because a later batch may need them
    again (the batches of a ``QUASI_RANDOM`` window read one region):
    :attr:`peak_bytes` is the most there ever were.

    A file whose bytes changed (a cached shard downloaded again after a failed
    check) has every page :meth:`drop`-ped: none is read from memory again
    (a page a running batch holds is read again by the next batch that needs
    it, and freed, not kept, when released), and the tickets that held one
    are marked :attr:`Ticket.stale`.

    Args:
        paths: the files, in layout order.
        sizes: their sizes [bytes].
        max_gap: runs of needed pages at most this many pages apart are read
            in one call (the pages between are read and held too).
        keep_bytes: pages that no batch holds any more are kept up to this
            many bytes [bytes] before they are freed, oldest first.
        source: where file ``k``'s bytes are read from instead of
            ``paths[k]`` (which is then not opened): an object with ``fd(k)``
            (a descriptor of a file with the same bytes, e.g. a downloaded
            shard whose ``paths[k]`` holds only its head) and ``name(k)``
            (for messages).
    """

    def __init__(self, paths: Sequence[Path], sizes: Sequence[int], max_gap: int = 8, keep_bytes: int = 0, source: Any = None) -> None:
        self.paths = [Path(p) for p in paths]
        self.sizes = [int(s) for s in sizes]
        self.bases, total = layout(self.sizes)
        self.max_gap = int(max_gap)
        self.keep_bytes = int(keep_bytes)
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident pages no batch holds, oldest first
        self._mm = mmap.mmap(-1, max(total, PAGE), flags=mmap.MAP_PRIVATE | _MAP_NORESERVE)
        self._view = memoryview(self._mm)
        end = int(self.bases[-1]) + self.sizes[-1] if self.sizes else 0
        storage = np.frombuffer(self._mm, dtype=np.uint8, count=end)
        storage.flags.writeable = False  # compiled decoders read it; only this class writes
        self.storage = storage
        self._fds: list[int] = []
        weakref.finalize(self, _close_all, self._fds)
        for p in self.paths if source is None else []:
            try:
                self._fds.append(os.open(p, os.O_RDONLY))
            except OSError as exc:
                raise DatasetFormatError(p, f"cannot be read: {exc.strerror or exc}") from exc
        self._count: dict[int, int] = {}  # page -> batches holding it
        self._state: dict[int, int] = {}  # page -> _LOADING or _READY (absent: not resident)
        self._cond = threading.Condition()
        self._stale: set[int] = set()  # resident pages of a file since replaced: read again before a batch uses them
        self._drops: list[tuple[int, int, int]] = []  # (drop count after it, first page, stop page) of recent drops
        self._drop_count = 0
        self._live: dict[int, int] = {}  # drop count at acquire -> parts of tickets not yet released
        self.peak_bytes = 0
        self.bytes_read = 0  # pages read so far [bytes]
        #: where file ``k``'s bytes are read from, when not from ``paths[k]`` (see ``source`` above)
        self.source: Any = source

    @property
    def resident_bytes(self) -> int:
        """Bytes of the resident pages now: held by running batches, or kept."""
        return (len(self._count) + len(self._idle)) * PAGE

    def ticket(self) -> Ticket:
        """An empty ticket, to gather the tickets of several :meth:`acquire` calls with ``+=`` (one batch's)."""
        return Ticket()

    def acquire(self, starts: np.ndarray, ends: np.ndarray) -> Ticket:
        """Make the bytes ``[starts[i], ends[i])`` present; returns the pages held (a :class:`Ticket`), for :meth:`release`.

        Raises:
            DatasetFormatError: a file cannot be read, or is shorter than when
                it was opened (names the file and the bytes).
        """
        firsts, stops = page_runs(starts, ends, self.max_gap)
        lengths = stops - firsts
        offsets = np.cumsum(lengths) - lengths  # where each run starts in the flat list of pages
        pages = Ticket((np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(firsts - offsets, lengths)).tolist())
        count, state, cond, stale = self._count, self._state, self._cond, self._stale
        with cond:
            if pages:
                pages.parts.append((self._drop_count, pages[0], pages[-1]))
                self._live[self._drop_count] = self._live.get(self._drop_count, 0) + 1
            idle = self._idle
            for p in pages:
                count[p] = count.get(p, 0) + 1
                if p in idle:  # kept since an earlier batch: present, and held again
                    del idle[p]
            self.peak_bytes = max(self.peak_bytes, (len(count) + len(idle)) * PAGE)
        try:
            while True:
                with cond:  # (a stale page is read again once no other batch reads it into place)
                    mine = [p for p in pages if p not in state or (p in stale and state[p] == _READY)]
                    for p in mine:
                        state[p] = _LOADING
                        stale.discard(p)
                    if not mine:
                        if all(state[p] == _READY for p in pages):
                            return pages
                        cond.wait()
                        continue
                try:
                    self._read(mine)
                except BaseException:
                    with cond:
                        for p in mine:
                            del state[p]  # another batch waiting for them reads them itself
                        cond.notify_all()
                    raise
                with cond:
                    for p in mine:
                        state[p] = _READY
                    self.bytes_read += len(mine) * PAGE
                    cond.notify_all()
        except BaseException:
            self.release(pages)
            raise

    def release(self, pages: list[int]) -> None:
        """Let go of pages from :meth:`acquire`; free those that no running batch holds any more.

        A :class:`Ticket` that held a page while it was dropped (:meth:`drop`) is marked :attr:`Ticket.stale`.
        """
        freed = []
        with self._cond:
            count, idle, state, stale = self._count, self._idle, self._state, self._stale
            parts = getattr(pages, "parts", ())
            if parts:
                if any(n > at and first <= hi - 1 and lo <= last for at, first, last in parts for n, lo, hi in self._drops):
                    pages.stale = True  # type: ignore[attr-defined]
                live = self._live
                for at, _, _ in parts:
                    live[at] -= 1
                    if not live[at]:
                        del live[at]
                oldest = min(live, default=self._drop_count)
                self._drops = [d for d in self._drops if d[0] > oldest]  # (only a ticket older than a drop needs it)
            for p in pages:
                c = count[p] - 1
                if c:
                    count[p] = c
                else:
                    del count[p]
                    if state.get(p) == _READY and self.keep_bytes and p not in stale:
                        idle[p] = None  # kept: present, held by no batch
                    else:
                        state.pop(p, None)
                        stale.discard(p)
                        freed.append(p)
            while idle and len(idle) * PAGE > self.keep_bytes:
                p, _ = idle.popitem(last=False)
                del state[p]
                freed.append(p)
            # under the lock: a page freed after another thread re-read it would read as zeros
            for a, b in _runs(freed):
                self._mm.madvise(mmap.MADV_DONTNEED, a * PAGE, (b - a) * PAGE)

    def drop(self, k: int) -> None:
        """File ``k``'s bytes changed (a cached shard downloaded again): no page of it is read from memory again.

        Pages no batch holds are freed now; those a batch holds are read again
        by the next batch that needs them, and freed when released; a ticket
        that holds one (or is reading one in) becomes :attr:`Ticket.stale` at
        its :meth:`release`. Call it once the new file is what :meth:`acquire`
        reads from.
        """
        first = int(self.bases[k]) // PAGE
        stop = align_up(int(self.bases[k]) + self.sizes[k]) // PAGE
        freed = []
        with self._cond:
            self._drop_count += 1
            if self._live:
                self._drops.append((self._drop_count, first, stop))
            count, idle, state, stale = self._count, self._idle, self._state, self._stale
            for p in [p for p in state if first <= p < stop]:
                if count.get(p, 0) > 0:
                    stale.add(p)  # held (or being read in): read again by the next batch, freed at release
                else:
                    idle.pop(p, None)
                    del state[p]
                    freed.append(p)
            for a, b in _runs(freed):
                self._mm.madvise(mmap.MADV_DONTNEED, a * PAGE, (b - a) * PAGE)
            self._cond.notify_all()

    def _read(self, pages: list[int]) -> None:
        """Read these (sorted) pages from their files into place."""
        for a, b in _runs(pages):
            lo, hi = a * PAGE, b * PAGE
            k = int(np.searchsorted(self.bases, lo, side="right")) - 1
            while lo < hi and k < len(self.sizes):  # a run may cross into the next file
                base, size = int(self.bases[k]), self.sizes[k]
                stop = min(hi, base + size)
                if stop > lo:
                    self._read_file(k, lo - base, lo, stop - lo)
                k += 1
                lo = int(self.bases[k]) if k < len(self.sizes) else hi

    def _read_file(self, k: int, offset: int, at: int, length: int) -> None:
        done = 0
        source = self.source
        fd, name = (self._fds[k], self.paths[k]) if source is None else (source.fd(k), source.name(k))
        while done < length:
            n = min(length - done, _MAX_READ)
            try:
                got = os.preadv(fd, [self._view[at + done : at + done + n]], offset + done)
            except OSError as exc:
                raise DatasetFormatError(name, f"cannot read bytes {offset + done}..{offset + done + n}: {exc}") from exc
            if got == 0:
                raise DatasetFormatError(
                    name,
                    f"ends at byte {offset + done}, before the {self.sizes[k]} bytes it had when opened: the file was "
                    "truncated or rewritten in place; write a new file and rename it over the old one, then make a new Loader",
                )
            done += got


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted page numbers as runs ``[first, stop)`` of consecutive pages."""
    out: list[tuple[int, int]] = []
    for p in sorted(pages):
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
