"""The writer's write-behind thread: writes and flushes in the order given, while the caller encodes.

A conversion spends its time in two places that do not depend on each other:
encoding samples (Python: reading files, parsing headers) and putting bytes
on disk (``pwritev``, ``fdatasync``). Both system calls release the GIL, so a
thread of their own runs them beside the encoding. It also flushes what it
wrote every ``flush_every`` bytes, so that the writer's final ``fsync`` waits
only for the tail instead of the whole file. The checksums stay with the
caller (``writer.BlockCrcs``, on bytes just encoded and still in cache): the
thread makes one call per write, since each return from a call waits for the
GIL that the encoding holds most of the time.

The thread never outlives the sink: :meth:`WriteBehind.close` waits for every
write and raises the thread's error, :meth:`WriteBehind.abort` drops what is
pending and joins. A write error (a full disk) reaches the caller at its next
:meth:`~WriteBehind.write` or at :meth:`~WriteBehind.close`.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Sequence

from stoker._threads import start_thread

#: bytes queued and not yet written, past which :meth:`WriteBehind.write` waits
MAX_PENDING = 64 << 20
#: bytes written between two ``fdatasync`` calls of the thread
FLUSH_EVERY = 32 << 20


def flush(fd: int) -> None:
    """``fdatasync`` where the system has it (not macOS), else ``fsync``."""
    getattr(os, "fdatasync", os.fsync)(fd)


#: buffers per ``pwritev`` call (Linux's IOV_MAX is 1024)
_IOV_MAX = 1024


def pwrite_all(fd: int, pieces: Sequence[bytes | memoryview], offset: int) -> None:
    """Write ``pieces`` one after the other at ``offset``, however many bytes each call takes."""
    vectored = hasattr(os, "pwritev")
    for start in range(0, len(pieces), _IOV_MAX if vectored else 1):
        group = pieces[start : start + _IOV_MAX] if vectored else pieces[start : start + 1]
        done = os.pwritev(fd, group, offset) if vectored else os.pwrite(fd, group[0], offset)
        offset += done
        for piece in group:  # what a short write left, piece by piece
            if done >= len(piece):
                done -= len(piece)
                continue
            view = memoryview(piece)[done:]
            done = 0
            while view:
                wrote = os.pwrite(fd, view, offset)
                view, offset = view[wrote:], offset + wrote


class WriteBehind:
    """Write ``(data, offset)`` to ``fd`` on a thread, in the order given (the checksums are the caller's).

    Args:
        fd: an open file descriptor, kept open by the caller until :meth:`close`
            or :meth:`abort` returned.
        max_pending: bytes queued at most; :meth:`write` waits beyond it.
        flush_every: ``fdatasync`` after this many bytes written (0: never).
    """

    def __init__(self, fd: int, max_pending: int = MAX_PENDING, flush_every: int = FLUSH_EVERY) -> None:
        self.fd = fd
        self.max_pending = max_pending
        self.flush_every = flush_every
        self.flushes = 0  # fdatasync calls made by the thread (for tests and reports)
        self._jobs: deque[tuple[Sequence[bytes | memoryview], int, int]] = deque()
        self._pending = 0
        self._stopping = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        # started by the first write: the writer's worker processes start on the first chunk asked for, and are forked
        # (quick) only while this process runs no other thread (see stoker.format._workers)
        self._thread: threading.Thread | None = None
        self._done = False  # set by the thread as it ends (under _cond)

    def write(self, data: bytes | memoryview | Sequence[bytes], offset: int) -> None:
        """Queue ``data`` (a buffer, or buffers to write one after the other) for ``offset``.

        Waits while ``max_pending`` bytes are queued.

        Raises:
            OSError: an earlier write or flush of the thread failed.
        """
        pieces: Sequence[bytes | memoryview] = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
        size = sum(len(p) for p in pieces)
        if not size:
            return
        with self._cond:
            while self._error is None and self._jobs and self._pending + size > self.max_pending:
                self._cond.wait()
            self._raise_error()
            if self._thread is None:
                self._thread = start_thread(self._run, name="stoker-write-behind")  # once started: one that never ran is never waited for
            self._jobs.append((pieces, size, offset))
            self._pending += size
            self._cond.notify_all()

    def close(self) -> None:
        """Wait until every queued write is done, then stop the thread.

        Raises:
            OSError: a write or flush failed.
        """
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._wait_done()
        self._raise_error()

    def abort(self) -> None:
        """Drop the queued writes and stop the thread (after the write in progress).

        Returns only once the thread has ended, whatever interrupts the wait
        (a second Ctrl-C is raised after it): the caller closes the descriptor
        next, and a write of the thread after that would land in whatever file
        reuses the number.
        """
        with self._cond:
            self._jobs.clear()
            self._pending = 0
            self._stopping = True
            self._cond.notify_all()
        interrupted: BaseException | None = None
        while True:
            try:
                self._wait_done()
                break
            except BaseException as exc:  # raised below, once the thread is gone
                interrupted = exc
        if interrupted is not None:
            raise interrupted

    def _wait_done(self) -> None:
        """Wait for the thread to end. Not ``Thread.join()`` alone: in CPython 3.11 a join interrupted by a signal
        marks the thread as stopped, and every later join returns at once while it still runs."""
        if self._thread is None:
            return
        with self._cond:
            while not self._done:
                self._cond.wait()
        self._thread.join()  # returns at once or soon: the thread only unwinds

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _loop(self) -> None:
        unflushed = 0
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    return
                pieces, size, offset = self._jobs[0]
            try:
                pwrite_all(self.fd, pieces, offset)  # one call, one wait for the GIL after it: the caller holds it most of the time
                unflushed += size
                if self.flush_every and unflushed >= self.flush_every:
                    flush(self.fd)
                    self.flushes += 1
                    unflushed = 0
            except BaseException as exc:  # handed to the caller, raised by its next write or close
                with self._cond:
                    self._error = exc
                    self._jobs.clear()
                    self._pending = 0
                    self._cond.notify_all()
                return
            with self._cond:
                if self._jobs:  # abort() may have cleared it meanwhile
                    self._jobs.popleft()
                    self._pending -= size
                self._cond.notify_all()
