"""Compilation of pipeline code with Numba, and the switch to turn it off."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

_ENABLED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("stoker_compiler_enabled", default=None)


class Compiler:
    """Compiles operations' code; ``Compiler.get_iterable()`` gives the parallel range.

    Compilation is on by default. Turn it off to debug a pipeline in plain
    Python (breakpoints, prints, exceptions with tracebacks):

    >>> with Compiler.disabled():  # doctest: +SKIP
    ...     loader = Loader(path, batch_size=8)  # pipelines built here run in Python

    or pass ``Loader(..., compile=False)``, or set ``Compiler.set_enabled(False)``
    for the whole process (FFCV's spelling).
    """

    _process_default: bool = True

    @classmethod
    def is_enabled(cls) -> bool:
        """Whether code generated now will be compiled."""
        scoped = _ENABLED.get()
        return cls._process_default if scoped is None else scoped

    @classmethod
    def set_enabled(cls, enabled: bool) -> None:
        """Turn compilation on or off for pipelines built from now on in this process."""
        cls._process_default = bool(enabled)

    @classmethod
    @contextlib.contextmanager
    def enabled(cls, enabled: bool = True) -> Iterator[None]:
        """Within the block, pipelines are built with compilation on (or off)."""
        token = _ENABLED.set(bool(enabled))
        try:
            yield
        finally:
            _ENABLED.reset(token)

    @classmethod
    def disabled(cls) -> contextlib.AbstractContextManager[None]:
        """Within the block, pipelines are built without compilation."""
        return cls.enabled(False)

    @classmethod
    def get_iterable(cls) -> Callable[..., Any]:
        """``numba.prange`` when compiling, else ``range``: loop over samples with it."""
        if cls.is_enabled():
            import numba

            return numba.prange
        return range

    get_iterator = get_iterable  # the name FFCV's own code uses

    @classmethod
    def compile(cls, code: Callable[..., Any], parallel: bool | None = None) -> Callable[..., Any]:
        """Compile ``code`` with Numba (``nopython``, ``nogil``), or return it unchanged when disabled.

        Args:
            code: a Python function, or an already compiled Numba dispatcher.
            parallel: compile ``prange`` loops to threads; default: the
                function's ``is_parallel`` attribute.
        """
        if not cls.is_enabled():
            return getattr(code, "py_func", code)
        import numba

        if isinstance(code, numba.core.dispatcher.Dispatcher):
            return code
        if parallel is None:
            parallel = bool(getattr(code, "is_parallel", False))
        return numba.njit(nogil=True, parallel=parallel, fastmath=False)(code)
