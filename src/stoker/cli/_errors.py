"""The one-line messages of the errors the ``stoker`` commands report: an OS error always names a path.

An ``OSError`` raised by ``open()`` carries the file's name; one raised by a
``write()``, ``pwritev()`` or ``fsync()`` on an open file carries none:
``[Errno 28] No space left on device`` alone does not say which disk is full.
One raised with a message of the library's own (``FileNotFoundError("images does
not exist; ...")``) is kept as it is when that message names one of the paths.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

#: errors that only writing raises: the path the command writes is the one to name
_WRITING_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def error_message(
    exc: BaseException, *, writing: str | os.PathLike[str] | None = None, reading: str | os.PathLike[str] | None = None
) -> str:
    """``exc`` as one line; an ``OSError`` names its path, or else the paths the command writes or reads.

    Args:
        exc: the error to report.
        writing: the file or folder the command writes.
        reading: the file or folder the command reads.

    Example:
        >>> error_message(OSError(errno.ENOSPC, "No space left on device"), writing="out.stoker", reading="images")
        'out.stoker: No space left on device [Errno 28] (writing it)'
        >>> error_message(OSError(errno.EIO, "Input/output error"), writing="out.stoker", reading="images")
        'Input/output error [Errno 5], reading images or writing out.stoker'
        >>> error_message(FileNotFoundError("images does not exist"), writing="out.stoker", reading="images")
        'images does not exist'
    """
    if not isinstance(exc, OSError):
        return str(exc)
    text = f"{exc.strerror or exc} [Errno {exc.errno}]" if exc.errno is not None else str(exc)
    if exc.filename is not None:
        second = f" -> {_name(exc.filename2)}" if exc.filename2 is not None else ""
        return f"{_name(exc.filename)}{second}: {text}"
    if any(path is not None and _names(text, path) for path in (writing, reading)):
        return text
    if writing is not None and (exc.errno in _WRITING_ERRNOS or reading is None):
        return f"{Path(writing)}: {text} (writing it)"
    if reading is not None and writing is None:
        return f"{Path(reading)}: {text} (reading it)"
    if reading is not None:
        return f"{text}, reading {Path(reading)} or writing {writing}"
    return text


def _names(text: str, path: str | os.PathLike[str]) -> bool:
    """Whether ``text`` names ``path``: as a whole word, not inside a longer name (``x`` in ``x.stoker``)."""
    name = re.escape(str(Path(path)))
    return re.search(rf"(?<![\w./\\-]){name}(?![\w/\\-]|\.\w)", text) is not None


def _name(filename: object) -> str:
    return os.fsdecode(filename) if isinstance(filename, (str, bytes, os.PathLike)) else str(filename)
