"""Durable files: a temporary next to the destination, fsync, atomic rename, fsync of the folder.

What the writer (and ``convert imagefolder``'s class list) use so that a
destination only ever holds a complete file:

* :func:`create_temporary` makes ``.NAME.stoker-tmp-PID-RAND`` next to the
  destination, locked (``flock``) for as long as its writer lives, after
  deleting the temporaries of writers that died (:func:`clean_stale_temporaries`);
* :func:`replace_durably` renames it onto the destination and fsyncs the folder;
* :func:`sigterm_unwinds` makes SIGTERM run the clean-ups (``except``/``finally``)
  before it ends the process, as Ctrl-C does.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

TMP_MARK = ".stoker-tmp-"


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's live process; anything else: assume alive
        return True
    return True


def clean_stale_temporaries(path: Path) -> None:
    """Remove temporaries of earlier writers to ``path`` whose process is gone.

    A temporary is removed only when its name is exactly ``.NAME.stoker-tmp-PID-*``
    for this ``path``, no process ``PID`` runs here, and no process holds its
    lock (a writer on another machine sharing the folder holds it).
    """
    prefix = f".{path.name}{TMP_MARK}"
    try:
        entries = [entry for entry in os.scandir(path.parent) if entry.name.startswith(prefix)]
    except OSError:
        return
    for entry in entries:
        try:
            pid = int(entry.name[len(prefix) :].split("-")[0])
        except ValueError:
            continue
        if pid <= 0 or _process_exists(pid):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live writer, elsewhere, still holds it
        except OSError:
            pass  # no locks on this file system: the PID has to do
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
        finally:
            os.close(fd)


def create_temporary(path: Path) -> tuple[Path, int]:
    """Create and lock the temporary that will become ``path``: ``(its path, an O_RDWR descriptor)``."""
    clean_stale_temporaries(path)
    tmp = path.parent / f".{path.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    with contextlib.suppress(OSError):  # a file system without locks: stale-temporary cleanup relies on the PID alone
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return tmp, fd


def replace_durably(tmp: Path, path: Path) -> None:
    """Rename the (fsynced, closed) temporary ``tmp`` onto ``path`` and fsync the folder."""
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_file_atomically(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` as the dataset is written: temporary, fsync, rename, fsync of the folder.

    ``path`` holds either its previous contents or ``data``, never a part, also
    after a crash; an error (or SIGTERM, see :func:`sigterm_unwinds`) removes
    the temporary.
    """
    path = Path(path)
    with sigterm_unwinds():
        tmp, fd = create_temporary(path)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            os.close(fd)
            fd = -1
            replace_durably(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            if fd >= 0:
                os.close(fd)
            raise


class _Terminated(BaseException):
    """Raised by :func:`sigterm_unwinds`' handler to unwind the stack on SIGTERM."""


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within the block, SIGTERM unwinds the stack (running ``finally`` and ``except`` clean-ups) before it acts.

    Without this, SIGTERM's default action ends the process at once, leaving a
    writer's temporary behind. What happens after the unwinding is what would
    have happened without the block:

    * the previous handler was the default: the process ends by SIGTERM
      (exit status -15, or 143 in a shell);
    * it was a Python function: that function is called (at once, as a chained
      handler); if it raises, the exception unwinds the block; if it returns,
      the block goes on;
    * SIGTERM was ignored, or its handler is not Python's, or this is not the
      main thread (only the main thread may set handlers): nothing is changed.

    The previous handler is restored when the block ends.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None or previous == signal.SIG_IGN:
        yield
        return

    terminating = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal terminating
        if callable(previous):
            previous(signum, frame)
        elif not terminating:  # a second SIGTERM must not interrupt the clean-up of the first
            terminating = True
            raise _Terminated(signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except _Terminated:
        if callable(previous):
            raise  # an inner block's: the previous handler is an outer block's, which ends the process
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # ends the process here (delivered before kill returns) ...
        raise SystemExit(128 + signal.SIGTERM) from None  # ... or, if delivery were late, exits with the shell's code
    finally:
        signal.signal(signal.SIGTERM, previous)
