"""Compilation of pipeline code with Numba: the switch to turn it off, and the debug mode.

Three modes, chosen when a pipeline is built:

* compiled (default): operations are compiled with Numba (``nopython``,
  ``nogil``), and **indices are not bounds-checked**: an operation that writes
  past the end of an array corrupts memory or crashes the process.
* debug (:meth:`Compiler.debug`, or ``NUMBA_BOUNDSCHECK=1``): compiled with
  bounds checks, serially (an ``IndexError`` raised inside a parallel loop is
  lost), every compiled function the operation calls included.
* off (:meth:`Compiler.disabled`): operations run as Python, and so do the
  compiled functions they call, except those that call Numba intrinsics
  (which exist only in compiled code).
"""

from __future__ import annotations

import contextlib
import contextvars
import dis
import functools
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from stoker.pipeline.fingerprint import code_objects, fingerprint, global_loads, is_library, references

_ENABLED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("stoker_compiler_enabled", default=None)
_DEBUG: contextvars.ContextVar[bool | None] = contextvars.ContextVar("stoker_compiler_debug", default=None)

# id(dispatcher) -> (dispatcher, its bounds-checked twin): each compiled once per process
_DEBUG_TWINS: dict[int, tuple[Any, Any]] = {}
_DEBUG_LOCK = threading.RLock()


class Compiler:
    """Compiles operations' code; ``Compiler.get_iterable()`` gives the parallel range.

    Compilation is on by default. Turn it off to debug a pipeline in plain
    Python (breakpoints, prints, exceptions with tracebacks):

    >>> with Compiler.disabled():  # doctest: +SKIP
    ...     loader = Loader(path, batch_size=8)  # pipelines built here run in Python

    or pass ``Loader(..., compile=False)``, or set ``Compiler.set_enabled(False)``
    for the whole process (FFCV's spelling).

    Compiled code does not check indices. To find an operation that reads or
    writes out of bounds, build the pipeline in debug mode: compiled, with
    bounds checks (an ``IndexError`` instead of corrupted memory), serially:

    >>> with Compiler.debug():  # doctest: +SKIP
    ...     loader = Loader(path, batch_size=8)

    ``NUMBA_BOUNDSCHECK=1`` in the environment turns debug mode on too.
    """

    _process_default: bool = True
    _process_debug: bool = False

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
    def is_debug(cls) -> bool:
        """Whether code compiled now is bounds-checked: debug mode, or ``NUMBA_BOUNDSCHECK=1``."""
        scoped = _DEBUG.get()
        if cls._process_debug if scoped is None else scoped:
            return True
        import numba

        return bool(numba.config.BOUNDSCHECK)  # type: ignore[attr-defined]

    @classmethod
    def set_debug(cls, debug: bool) -> None:
        """Turn debug mode on or off for pipelines built from now on in this process."""
        cls._process_debug = bool(debug)

    @classmethod
    @contextlib.contextmanager
    def debug(cls, debug: bool | None = True) -> Iterator[None]:
        """Within the block, pipelines are built in debug mode (bounds-checked, serial), or not.

        Args:
            debug: ``True`` for debug mode, ``False`` for none (unless
                ``NUMBA_BOUNDSCHECK=1``), ``None`` to leave the mode as it is.
        """
        if debug is None:
            yield
            return
        token = _DEBUG.set(bool(debug))
        try:
            yield
        finally:
            _DEBUG.reset(token)

    @classmethod
    def get_iterable(cls) -> Callable[..., Any]:
        """``numba.prange`` when compiling, else ``range``: loop over samples with it."""
        if cls.is_enabled():
            import numba

            return numba.prange
        return range

    get_iterator = get_iterable  # the name FFCV's own code uses

    @classmethod
    def fused_options(cls) -> dict[str, Any]:
        """The ``numba.njit`` options of a fused pipeline function built now."""
        return {"nogil": True, "boundscheck": True} if cls.is_debug() else {"nogil": True}

    @classmethod
    def compile(cls, code: Callable[..., Any], parallel: bool | None = None, per_sample: bool = False) -> Callable[..., Any]:
        """Compile ``code`` with Numba (``nopython``, ``nogil``); or its Python twin when disabled.

        Code of the same fingerprint (:func:`~stoker.pipeline.fingerprint.fingerprint`:
        its bytecode, constants, closure values, what it calls, the options) gives
        the same dispatcher, one per process: the closure an operation generates
        for each field is compiled once for all the fields whose closures are
        alike, and a dispatcher passed in gives the first one of its fingerprint
        (an operation's closure compiled by it: compiled again, named by its
        fingerprint, see :func:`_named_by`). Code that cannot be fingerprinted
        gets a dispatcher of its own (a module's dispatcher passed in: itself).

        When compilation is off, the result is ``code`` as Python with every
        compiled function it calls replaced by its Python function (except
        those that call Numba intrinsics). In debug mode, ``code`` and every
        compiled function it calls are compiled again, bounds-checked and
        serial.

        Args:
            code: a Python function, or an already compiled Numba dispatcher.
            parallel: compile ``prange`` loops to threads; default: the
                function's ``is_parallel`` attribute. Ignored in debug mode.
        """
        if not cls.is_enabled():
            return as_python(code)
        import numba

        is_dispatcher = isinstance(code, numba.core.dispatcher.Dispatcher)
        if cls.is_debug():
            if is_dispatcher:
                canonical = _shared(code)  # (not under _DEBUG_LOCK: _shared takes it after its own lock)
                with _DEBUG_LOCK:
                    return _debug_twin(canonical)  # type: ignore[no-any-return]
            checked: dict[str, Any] = {"nogil": True, "parallel": False, "fastmath": False, "boundscheck": True}

            def build_checked(key: str) -> Any:
                rebuilt = code
                if isinstance(code, types.FunctionType):
                    with _DEBUG_LOCK:
                        rebuilt = _named_by(_rebuild(code, _debug_twin), key)
                return numba.njit(**checked)(rebuilt)

            return _shared(code, checked, build_checked)
        if is_dispatcher:
            fn = code.py_func  # type: ignore[attr-defined]
            if not _local(fn):  # a module's own kernel: its name is its own (and prebuilt code calls it by that name)
                return _shared(code)
            # an operation's closure, compiled by it: named by its fingerprint, as the closures compiled here (_named_by)
            kept = {k: v for k, v in code.targetoptions.items() if k not in ("nopython", "cache")}  # type: ignore[attr-defined]
            return _shared(code, kept, lambda key: numba.njit(**kept)(_named_by(fn, key)), "a closure compiled by its operation")
        if parallel is None:
            parallel = bool(getattr(code, "is_parallel", False))
        options: dict[str, Any] = {"nogil": True, "parallel": parallel, "fastmath": False}
        label = "per sample" if per_sample else ""
        return _shared(code, options, lambda key: numba.njit(**options)(_named_by(by_symbol(code, large_only=per_sample), key)), label)


# fingerprint -> its dispatcher, for the life of the process (as the machine code Numba loads for it)
_SHARED: dict[str, Any] = {}
_SHARED_LOCK = threading.Lock()


def _shared(code: Any, options: dict[str, Any] | None = None, build: Callable[[str], Any] | None = None, label: str = "") -> Any:
    """The one dispatcher of ``code``'s fingerprint with ``options``: ``build(fingerprint)`` (or ``code``, a dispatcher)
    the first time.

    Hashed every time (about a millisecond): the same function object may read
    other globals or closure values by now, and compile to other code.
    """
    key = fingerprint(f"stoker.pipeline.compiler.Compiler.compile {label}", [code], options)
    if key is None:  # cannot be fingerprinted: as before, a dispatcher of its own (named by its object, see _named_by)
        return code if build is None else build(f"id{id(code):x}")
    with _SHARED_LOCK:
        found = _SHARED.get(key)
        if found is None:
            found = _SHARED[key] = code if build is None else build(key)
    return found


def _local(fn: Any) -> bool:
    """Whether ``fn`` is a Python function defined inside another one (a closure, a lambda): a name that other
    functions share (each call of an operation's ``generate_code`` makes one of the same name)."""
    return isinstance(fn, types.FunctionType) and ("<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>")


def _named_by(code: Any, key: str) -> Any:
    """A copy of the Python function ``code`` whose qualified name carries ``key`` (its fingerprint): Numba's symbol
    for it then differs from that of a function of the same name with other closure values.

    Numba names a compiled function by its module, qualified name, argument types and a counter of this process; an
    operation's generated closure (``NormalizeImage``'s, with its mean and std as constants) compiled in one process
    and cached inside a fused function can carry the same symbol as another closure of the same name compiled in this
    one, and the machine code loaded from the cache then calls this process's, with its values (two loaders
    normalising with other constants, one of them from the cache: the second got the first's mean and std). With
    the fingerprint in the name, two functions share a symbol only where their code and values are the same. An
    operation that returns its closure compiled already (a dispatcher) gets the same: its Python function is
    compiled again under such a name, with the dispatcher's options (:meth:`Compiler.compile`).
    """
    if not isinstance(code, types.FunctionType):
        return code
    twin = types.FunctionType(code.__code__, code.__globals__, code.__name__, code.__defaults__, code.__closure__)
    twin.__kwdefaults__ = None if code.__kwdefaults__ is None else dict(code.__kwdefaults__)
    twin.__qualname__ = f"{code.__qualname__}__{key[:16]}"
    twin.__module__ = code.__module__
    twin.__doc__ = code.__doc__
    twin.__dict__.update(code.__dict__)
    return twin


_SERIAL_TWINS: dict[Any, Any] = {}
_SERIAL_ORIGINS: dict[int, Any] = {}  # id(twin) -> the dispatcher it is the serial twin of
_SERIAL_LOCK = threading.Lock()


def by_symbol(code: Any, large_only: bool = False) -> Any:
    """``code`` (a Python function) calling the library's kernels it reads by symbol (see :mod:`stoker.pipeline.linking`).

    Its globals and closure values that are :func:`~stoker.pipeline.linking.linkable`
    are replaced by their stand-ins, so that compiling ``code`` compiles none of
    their code into it; with ``large_only`` (code run once per sample, where a call
    that cannot be inlined costs), only those marked large (``stoker_large``: seconds
    of LLVM work, such as a JPEG decoder's). Anything else (a dispatcher, debug mode)
    is returned as it is.
    """
    from stoker.pipeline import linking

    if not isinstance(code, types.FunctionType) or Compiler.is_debug():
        return code

    def wanted(value: Any) -> bool:
        return linking.linkable(value) and (not large_only or bool(getattr(value, "stoker_large", False)))

    if not any(wanted(v) for _, v, _ in references(code)):
        return code
    return _rebuild(code, lambda value: linking.swap(value) if wanted(value) else value)


def serial_twins() -> list[Any]:
    """Every serial twin made in this process."""
    with _SERIAL_LOCK:
        return list(_SERIAL_TWINS.values())


def serial_origin(code: Any) -> Any:
    """The dispatcher ``code`` is the :func:`serial_twin` of, or ``None``."""
    return _SERIAL_ORIGINS.get(id(code))


def serial_twin(code: Callable[..., Any]) -> Callable[..., Any]:
    """``code`` compiled without threads (its ``prange`` loops run as ``range``); ``code`` itself if it is not parallel.

    For a caller that already runs on one thread of its own (a producer
    thread): a parallel region on one thread still goes through the threading
    layer on every call. The twin is a copy of the function under another
    name, so that Numba's disk cache keeps the two builds apart (its key does
    not include ``parallel``); it is cached on disk when ``code`` is.
    """
    import numba
    from numba.core.caching import NullCache

    from stoker import _numba_cache

    if not isinstance(code, numba.core.dispatcher.Dispatcher) or not code.targetoptions.get("parallel"):
        return code
    with _SERIAL_LOCK:
        twin = _SERIAL_TWINS.get(code)
        if twin is None:
            fn = code.py_func
            copy = types.FunctionType(fn.__code__, fn.__globals__, f"{fn.__name__}_serial", fn.__defaults__, fn.__closure__)
            copy.__qualname__ = f"{fn.__qualname__}_serial"
            copy.__module__ = fn.__module__
            copy.__doc__ = fn.__doc__
            options = {k: v for k, v in code.targetoptions.items() if k not in ("parallel", "nopython")}
            cached = not isinstance(getattr(code, "_cache", None), NullCache)
            _numba_cache.register()  # (a stoker kernel's twin is cached in stoker's private folder, as the kernel is)
            twin = _SERIAL_TWINS[code] = numba.njit(**options, cache=cached)(copy)
            _SERIAL_ORIGINS[id(twin)] = code  # (both stay alive in _SERIAL_TWINS: the id stays unique)
            if cached:
                from stoker.pipeline import prebuilt

                if prebuilt.enabled():
                    prebuilt.attach(twin)
    return twin


# ---- twins: the same code with the compiled functions it calls swapped ----------------------


def _rebuild(fn: types.FunctionType, swap: Callable[[Any], Any], register: Callable[[Any], Any] | None = None) -> Any:
    """``fn`` with each global, closure value and default it reads replaced by ``swap(value)``.

    The globals are a copy of ``fn``'s module dictionary, unless ``fn`` assigns
    globals (Python-only code that counts or logs): then they are the module's
    own, unswapped. ``register(twin)`` (when given) runs before the swaps and
    its result is returned: it records the twin, so that a function reached
    again (recursion) ends there.
    """
    cells = None if fn.__closure__ is None else tuple(types.CellType() for _ in fn.__closure__)
    assigns_globals = any(
        ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL") for c in code_objects(fn.__code__) for ins in dis.get_instructions(c)
    )
    namespace = fn.__globals__ if assigns_globals else dict(fn.__globals__)
    twin = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, cells)
    twin.__kwdefaults__ = None if fn.__kwdefaults__ is None else dict(fn.__kwdefaults__)
    twin.__qualname__ = fn.__qualname__
    twin.__doc__ = fn.__doc__
    twin.__dict__.update(fn.__dict__)
    result = twin if register is None else register(twin)
    for old, new in zip(fn.__closure__ or (), cells or (), strict=True):
        try:
            value = old.cell_contents
        except ValueError:  # an empty cell stays empty
            continue
        new.cell_contents = swap(value)
    for name in () if assigns_globals else global_loads(fn.__code__):
        if name in namespace:
            namespace[name] = swap(namespace[name])
    if fn.__defaults__:
        twin.__defaults__ = tuple(swap(d) for d in fn.__defaults__)
    return result


def _is_dispatcher(value: Any) -> bool:
    import numba

    return isinstance(value, numba.core.dispatcher.Dispatcher)


def _calls_intrinsics(fn: types.FunctionType) -> bool:
    from numba.core.extending import _Intrinsic

    for _, value, reached in references(fn):
        if isinstance(value, _Intrinsic):
            return True
        if isinstance(value, types.ModuleType):
            for chain in reached:
                target: Any = value
                for attr in chain.split("."):
                    target = getattr(target, attr, None)
                    if not isinstance(target, types.ModuleType):
                        break
                if isinstance(target, _Intrinsic):
                    return True
    return False


def as_python(code: Callable[..., Any]) -> Callable[..., Any]:
    """``code`` as Python: its Python function, and so for every compiled function it calls.

    A compiled function that calls a Numba intrinsic stays compiled (an
    intrinsic only exists in compiled code); a function reached through a
    module attribute (``module.function``) is not swapped.
    """
    memo: dict[int, tuple[Any, Any]] = {}

    def twin(value: Any) -> Any:
        from stoker.pipeline import linking

        value = linking.origin(value)  # a kernel called by symbol: as the kernel itself
        fn = value.py_func if _is_dispatcher(value) else value
        if not isinstance(fn, types.FunctionType) or is_library(fn):
            return value
        if fn is not value and _calls_intrinsics(fn):
            return value
        hit = memo.get(id(fn))
        if hit is not None:
            return hit[1]

        def register(rebuilt: Any) -> Any:
            memo[id(fn)] = (fn, rebuilt)
            return rebuilt

        return _rebuild(fn, twin, register)

    python = twin(code)
    if python is code or not callable(python):
        return python  # type: ignore[no-any-return]

    @functools.wraps(python)
    def run_as_compiled_would(*args: Any, **kwargs: Any) -> Any:
        # compiled integer arithmetic wraps around silently; numpy's scalars would warn
        with np.errstate(over="ignore"):
            return python(*args, **kwargs)

    return run_as_compiled_would


def _debug_twin(value: Any) -> Any:
    """A bounds-checked, serial copy of the dispatcher ``value`` and of every dispatcher it calls (callers hold ``_DEBUG_LOCK``)."""
    from stoker.pipeline import linking

    value = linking.origin(value)  # a kernel called by symbol (stoker.image's decoder): its checked copy, linked
    if not _is_dispatcher(value) or is_library(value):
        return value
    hit = _DEBUG_TWINS.get(id(value))
    if hit is not None:
        return hit[1]
    import numba

    # Numba's disk cache keys on bytecode, not options: a cached twin could be the unchecked code
    dropped = ("nopython", "cache", "parallel", "boundscheck")
    options = {k: v for k, v in value.targetoptions.items() if k not in dropped}

    def register(rebuilt: Any) -> Any:
        compiled = numba.njit(**options, parallel=False, boundscheck=True)(rebuilt)
        _DEBUG_TWINS[id(value)] = (value, compiled)
        return compiled

    return _rebuild(value.py_func, _debug_twin, register)
