"""The writer's worker processes: how they start, and what goes through their pipes.

Each worker has a pipe of its own; no lock is shared between processes, so
stopping the workers at any moment cannot block the writer
(``multiprocessing.Pool.terminate`` can hang when a worker dies holding its
result queue's lock).

::

    writer                                    worker (one per process)
      (pos, task) ----------------------->    source.encode(task)
                  <-- ("chunk", rows, cols, heap)   one or more
                  <-- ("done",) or ("error", exception)

**Start method.** A worker is forked when that is safe: this process runs no
other thread and Numba has not started its thread pool. Once it has (a
:class:`~stoker.loader.Loader` ran), forking makes Numba's TBB layer print
"Attempted to fork from a non-main thread" and can leave locks held by the
loader's threads locked in the child; the workers are then fresh interpreters
(``python -c``, started with ``posix_spawn``/``vfork``, which run no fork
handlers) that receive the pickled source. A source that a fresh interpreter
cannot rebuild (it does not pickle, or it refers to classes or functions
defined in ``__main__``, which is not imported there) is forked all the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import multiprocessing as mp
import pickle
import signal
import subprocess
import sys
import threading
import traceback
import types
from collections import deque
from collections.abc import Iterable, Iterator
from multiprocessing.connection import Connection, Pipe, wait
from typing import Any, Protocol

import numpy as np

from stoker.errors import SampleError

#: tasks handed to each worker process and not yet written: results that come back before an earlier
#: task's wait in memory, so this bounds the writer's memory to a few tasks per worker
IN_FLIGHT_PER_WORKER = 2
#: bytes of encoded samples that a worker may have waiting in the writer ahead of the task being written;
#: past it the writer stops reading that worker's pipe, which then blocks it (tasks that stream many chunks)
BUFFER_PER_WORKER = 64 << 20

#: ``(rows, columns, heap)``: the heap is the payloads of the chunk's samples in order, written one after the other
Chunk = tuple[np.ndarray, dict[str, bytes], list[bytes]]
Written = tuple[int, np.ndarray, dict[str, bytes], list[bytes]]
_STOP = "stop"  # the task that ends a worker


class Source(Protocol):
    """What the workers encode: a task (a chunk of indices, a shard) to encoded chunks."""

    def encode(self, task: Any) -> Iterator[Chunk]:
        """Encode the samples of ``task`` as ``(rows, columns, heap)`` chunks, in order."""
        ...


def fork_is_safe() -> bool:
    """Whether forking this process now can neither deadlock a child nor make Numba's TBB layer warn."""
    if "fork" not in mp.get_all_start_methods():
        return False
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and type(t).__name__ != "TMonitor"]
    parallel = sys.modules.get("numba.np.ufunc.parallel")  # tqdm's monitor thread only sleeps
    return not others and threading.current_thread() is threading.main_thread() and not getattr(parallel, "_is_initialized", False)


class _NotPortable(Exception):
    pass


class _PortablePickler(pickle.Pickler):
    """A pickler that refuses what a fresh interpreter could not import: classes and functions of ``__main__``."""

    def reducer_override(self, obj: Any) -> Any:
        module = obj.__module__ if isinstance(obj, (type, types.FunctionType)) else type(obj).__module__
        if module == "__main__":
            raise _NotPortable(f"{type(obj).__qualname__} of __main__")
        return NotImplemented


def portable_pickle(source: Any) -> bytes | None:
    """``source`` pickled, or ``None`` when a fresh interpreter could not rebuild it."""
    buffer = io.BytesIO()
    try:
        _PortablePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(source)
    except Exception:  # _NotPortable, PicklingError, TypeError, AttributeError, RuntimeError (a lock outside spawning) ...
        return None
    return buffer.getvalue()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when the writer process dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # an exotic libc: no parent-death signal
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _serve(conn: Connection, source: Any) -> None:
    """Encode each task received on ``conn`` and send back its chunks, then ``("done",)`` or ``("error", exc)``."""
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if isinstance(task, str) and task == _STOP:
            return
        try:
            if isinstance(source, BaseException):  # the source could not be rebuilt here: every task says why
                raise source
            for rows, cols, heap in source.encode(task):
                conn.send(("chunk", rows, cols, heap))
            reply: tuple[Any, ...] = ("done",)
        except Exception as exc:
            if not isinstance(exc, SampleError):  # a bug, say in a custom field: keep where it happened
                exc.add_note("in a writer worker process:\n" + "".join(traceback.format_exception(exc)))
            reply = ("error", exc)
        try:
            conn.send(reply)
        except Exception as exc:  # an exception that does not pickle
            conn.send(("error", RuntimeError(f"a writer worker failed with {type(reply[1]).__name__}: {reply[1]} ({exc})")))


def _forked_main(conn: Connection, source: Any) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler (fork copies it): terminate() ends the worker
    _serve(conn, source)


def spawned_main() -> None:
    """Entry point of a worker started as a fresh interpreter: ``python -c ... FD`` (FD: its end of the pipe)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(sys.argv[-1]))
    try:
        path, payload = conn.recv()
    except EOFError:
        return
    sys.path[:] = path
    try:
        source = pickle.loads(payload)
    except Exception as exc:
        exc.add_note("while a writer worker process rebuilt the dataset (it must be importable from a fresh interpreter)")
        source = exc
    _serve(conn, source)


class _Spawned:
    """A ``subprocess.Popen`` with the part of ``multiprocessing.Process``'s interface the writer uses."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)


class Workers:
    """Worker processes that encode tasks of a :class:`Source`, each with a pipe of its own.

    Each worker encodes its tasks in the order received; :meth:`ordered`
    hands every worker at most ``IN_FLIGHT_PER_WORKER`` tasks that are not yet
    consumed and reads all the pipes at once, holding at most about
    ``BUFFER_PER_WORKER`` bytes of a worker's chunks ahead of the task being
    consumed.
    """

    def __init__(self, num_workers: int, source: Source) -> None:
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        payload = None if fork_is_safe() else portable_pickle(source)
        #: how the workers were started: "fork", or "spawn" (fresh interpreters)
        self.start_method = "fork" if payload is None else "spawn"
        try:
            for _ in range(num_workers):
                parent_end, child_end = Pipe()
                if payload is None:
                    proc: Any = mp.get_context("fork").Process(
                        target=_forked_main, args=(child_end, source), daemon=True, name="stoker-writer"
                    )
                    proc.start()
                else:
                    code = "from stoker.format._workers import spawned_main; spawned_main()"
                    fd = child_end.fileno()
                    proc = _Spawned(subprocess.Popen([sys.executable, "-c", code, str(fd)], pass_fds=(fd,), stdin=subprocess.DEVNULL))
                child_end.close()  # the worker holds it: recv() raises EOFError if the worker dies
                self.procs.append(proc)
                self.conns.append(parent_end)
            if payload is not None:  # once all have started: they import stoker at the same time
                for worker, conn in enumerate(self.conns):
                    try:
                        conn.send((list(sys.path), payload))
                    except OSError:
                        raise self._died(worker) from None
        except BaseException:
            self.close()
            raise

    def ordered(self, tasks: Iterable[tuple[int, Any]]) -> Iterator[Written]:
        """Encode ``(pos, task)`` pairs; yield ``(pos, rows, columns, heap)`` chunks in the order of ``tasks``.

        ``pos`` of a task's first chunk is the task's; each next chunk's follows the previous one's rows.

        Raises:
            Exception: the first task (in order) that failed raises its error.
            ChildProcessError: a worker died.
        """
        todo = iter(tasks)
        count = len(self.procs)
        queued: list[deque[int]] = [deque() for _ in range(count)]  # each worker's tasks (numbers), in the order sent
        owner: deque[int] = deque()  # the worker of each task submitted and not yet consumed, in order
        received: dict[int, deque[tuple[Any, ...]]] = {}
        starts: dict[int, int] = {}
        finished: set[int] = set()
        held = [0] * count
        submitted = 0

        def submit() -> None:
            nonlocal submitted
            item = next(todo, None)
            if item is None:
                return
            worker = min(range(count), key=lambda w: len(queued[w]))
            try:
                self.conns[worker].send(item[1])
            except OSError:
                raise self._died(worker) from None
            queued[worker].append(submitted)
            owner.append(worker)
            received[submitted], starts[submitted] = deque(), item[0]
            submitted += 1

        for _ in range(IN_FLIGHT_PER_WORKER * count):
            submit()
        head = 0
        while owner:
            worker, messages, pos = owner[0], received[head], starts[head]
            while messages:
                message = messages.popleft()
                if message[0] == "error":
                    raise message[1]
                _, rows, cols, heap = message
                held[worker] -= _nbytes(message)
                yield pos, rows, cols, heap
                pos += len(rows)
            starts[head] = pos
            if head in finished:
                owner.popleft()
                del received[head], starts[head]
                head += 1
                submit()  # after the consumer is done with the task: at most IN_FLIGHT_PER_WORKER per worker exist
                continue
            readable = [w for w in range(count) if queued[w] and (w == worker or held[w] < BUFFER_PER_WORKER)]
            for conn in wait([self.conns[w] for w in readable]):
                w = self.conns.index(conn)  # type: ignore[arg-type]
                try:
                    message = self.conns[w].recv()
                except (EOFError, OSError):  # OSError: ECONNRESET when it died with a task unread
                    raise self._died(w) from None
                task = queued[w][0]
                if message[0] != "done":
                    received[task].append(message)
                if message[0] == "chunk":
                    held[w] += _nbytes(message)
                else:  # "done" or "error": the worker goes on with its next task
                    queued[w].popleft()
                    finished.add(task)

    def _died(self, worker: int) -> ChildProcessError:
        proc = self.procs[worker]
        proc.join(1.0)
        return ChildProcessError(f"a writer worker process (pid {proc.pid}) died with exit code {proc.exitcode}; nothing was written")

    def close(self) -> None:
        """End the workers (SIGTERM, then SIGKILL after 5 s) and close the pipes."""
        for proc in self.procs:
            if proc.exitcode is None:
                proc.terminate()
        for proc in self.procs:
            proc.join(5.0)
            if proc.exitcode is None:  # pragma: no cover - a worker stuck in uninterruptible I/O
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


def _nbytes(message: tuple[Any, ...]) -> int:
    _, rows, cols, heap = message
    return int(rows.nbytes) + sum(len(c) for c in cols.values()) + sum(len(piece) for piece in heap)
