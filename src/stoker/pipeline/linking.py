"""Calls from generated code to the library's compiled kernels by symbol, not by copying their code in.

Numba compiles a call from one compiled function to another by linking the
callee's LLVM code into the caller's module and optimising and generating
machine code for the whole again. For a pipeline's generated code (the fused
function, a loader's producer loop) that calls the library's decoders, that is
most of its compile time: a JPEG decoder with its crops and resizes is seconds
of LLVM work, repeated for every new combination of operations even when the
decoder itself is cached.

:func:`external` gives, for one of the library's kernels, a stand-in that
generated code calls instead. Compiling the caller then compiles (or loads
from Numba's disk cache) the kernel on its own, once per argument types, and
emits a plain call to the kernel's machine code through a symbol named after
the kernel's fingerprint and argument types (registered with LLVM's symbol
table: ``llvmlite.binding.add_symbol``). The caller's code holds no address,
so it is cached on disk like any other; loading it from the cache first
registers the symbols it calls (a step Numba runs before loading: the
library's ``reload_init``), loading each kernel from its own cache.

The call is Numba's own calling convention: the same arguments, return value
and exceptions as a linked call; only inlining across the call is lost, which
costs nothing for calls once per batch. Only kernels that a new process can
find again are called so (:func:`linkable`): compiled functions of stoker's
own modules, module-level, cached on disk (and their serial twins); the rest
is linked as before. Debug mode (bounds checks) links everything.

A cached caller must register every symbol its machine code calls. Numba runs
a loaded function's ``reload_init`` but gives its rebuilt library none, so a
function compiled later that links a cached one (a loader's producer loop
linking a fused function loaded from the cache) would be saved calling the
fused function's kernels without registering them, and a process that loads
only the loop would call unresolved symbols (a crash).
:func:`stoker.pipeline.prebuilt.load_without_refresh` gives the library its
``reload_init`` back; :func:`unregistered` finds an entry written without
(the disk cache treats it as a miss).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from stoker.pipeline import prebuilt

#: symbol -> (the kernel's compile result, its address), for the life of the process (Numba never frees machine code)
_SYMBOLS: dict[str, tuple[Any, int]] = {}
_EXTERNALS: dict[tuple[int, bool], Any] = {}  # (id of the kernel, serial) -> its stand-in
_NAMES: dict[tuple[int, bool], str] = {}  # (id of the kernel, serial) -> the prefix of its symbols (its fingerprint)
_KEEP: list[Any] = []  # the kernels of _EXTERNALS and _NAMES stay alive, so that their ids stay unique
_LOCK = threading.RLock()
#: a kernel symbol's name (:func:`_symbol`: the kernel's 32-digit fingerprint, 24 digits of its argument types), as
#: the symbol table of machine code that calls it holds it
_SYMBOL_NAME = re.compile(rb"stoker_kernel_[0-9a-f]{32}_[0-9a-f]{24}")


def _identity(dispatcher: Any) -> tuple[str, str, bool] | None:
    """``(module, qualname, serial)`` by which another process finds ``dispatcher`` again, or ``None``."""
    from stoker.pipeline.compiler import serial_origin

    origin = serial_origin(dispatcher)
    serial = origin is not None
    fn = (origin if serial else dispatcher).py_func
    module, qualname = fn.__module__, fn.__qualname__
    if not module.startswith("stoker.") or "<locals>" in qualname:
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return (module, qualname, serial) if found is (origin if serial else dispatcher) else None


def linkable(value: Any) -> bool:
    """Whether generated code calls ``value`` by symbol: a module-level compiled function of stoker, cached on disk."""
    import numba
    from numba.core.caching import NullCache

    from stoker.pipeline.compiler import Compiler

    if not isinstance(value, numba.core.dispatcher.Dispatcher) or Compiler.is_debug():
        return False
    if isinstance(getattr(value, "_cache", None), NullCache):
        return False
    return _identity(value) is not None


def origin(value: Any) -> Any:
    """The kernel behind ``value`` if it is a stand-in made by :func:`external`, else ``value`` itself."""
    mark = getattr(value, "_stoker_fingerprint", None)
    return mark[4] if isinstance(mark, tuple) and mark[:1] == ("external",) else value


def swap(value: Any) -> Any:
    """``value``'s stand-in if it is :func:`linkable`, else ``value`` itself."""
    return external(value) if linkable(value) else value


def _resolve(module: str, qualname: str, serial: bool) -> Any:
    from stoker.pipeline.compiler import serial_twin

    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return serial_twin(found) if serial else found


def _prefix(dispatcher: Any, serial: bool) -> str:
    """The kernel's fingerprint: its symbols' names start with it."""
    from stoker.pipeline.fingerprint import fingerprint

    key = (id(dispatcher), serial)
    with _LOCK:
        name = _NAMES.get(key)
        if name is None:
            # (portable: the same name whatever CPU the caller was compiled for, the prebuilt kernels' generic one too)
            digest = fingerprint("stoker.pipeline.linking", [dispatcher], {"serial": serial}, portable=True)
            if digest is None:  # pragma: no cover - linkable() kernels are module-level stoker code
                raise TypeError(f"{dispatcher.py_func.__qualname__} cannot be fingerprinted")
            name = _NAMES[key] = digest
            _KEEP.append(dispatcher)
    return name


def _symbol(prefix: str, argtypes: tuple[Any, ...]) -> str:
    signature = "|".join(str(t) for t in argtypes)
    return f"stoker_kernel_{prefix}_{hashlib.sha256(signature.encode()).hexdigest()[:24]}"


def link(module: str, qualname: str, serial: bool, argtypes: tuple[Any, ...]) -> tuple[str, Any]:
    """Compile (or load from its cache) a kernel for ``argtypes`` and register its symbol; ``(symbol, compile result)``."""
    from llvmlite import binding

    dispatcher = _resolve(module, qualname, serial)
    symbol = _symbol(_prefix(dispatcher, serial), argtypes)
    with _LOCK:
        hit = _SYMBOLS.get(symbol)
        if hit is not None and id(hit[0]) not in prebuilt._GENERIC:
            return symbol, hit[0]
        if prebuilt.enabled():
            prebuilt.attach(dispatcher)
        dispatcher.compile(argtypes)
        cres = prebuilt.for_this_cpu(dispatcher, argtypes)  # (this CPU's code once compiled, else the generic)
        if hit is not None and cres is hit[0]:
            return symbol, cres
        # (registered again with this CPU's code: machine code finalized from now on calls it; earlier code keeps
        # the generic one, which stays loaded)
        address = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
        binding.add_symbol(symbol, address)
        _SYMBOLS[symbol] = (cres, address)
    return symbol, cres


@dataclass(frozen=True)
class _Relink:
    """Run before a cached caller is loaded (Numba's ``reload_init``, pickled with it): registers one kernel's symbol."""

    module: str
    qualname: str
    serial: bool
    argtypes: tuple[Any, ...]

    def __call__(self) -> None:
        link(self.module, self.qualname, self.serial, self.argtypes)

    def symbol(self) -> str:
        """The symbol :meth:`__call__` registers, named without compiling the kernel."""
        return _symbol(_prefix(_resolve(self.module, self.qualname, self.serial), self.serial), self.argtypes)


def called_symbols(code: bytes) -> set[str]:
    """The kernel symbols that ``code`` (machine code as an object file, or LLVM bitcode) calls: the names it holds."""
    return {name.decode() for name in _SYMBOL_NAME.findall(code)}


def unregistered(code: bytes, reload_init: Iterable[Any]) -> set[str]:
    """The kernel symbols ``code`` calls that no :class:`_Relink` of ``reload_init`` (a cached function's) registers.

    Empty for an entry that may be loaded. A relink whose kernel is gone (renamed,
    removed) registers nothing.
    """
    registered = set()
    for init in reload_init:
        if isinstance(init, _Relink):
            try:
                registered.add(init.symbol())
            except (ImportError, AttributeError, TypeError):
                continue
    return called_symbols(code) - registered


def external(dispatcher: Any) -> Any:
    """The stand-in that generated code calls in place of the :func:`linkable` kernel ``dispatcher``.

    An intrinsic with the kernel's parameters: typing it compiles the kernel for the
    argument types (literal ones made plain) and returns the kernel's return type;
    its code is a call through the kernel's symbol, propagating the kernel's
    exceptions as a linked call does.
    """
    from numba.core import cgutils, types
    from numba.core.extending import intrinsic

    identity = _identity(dispatcher)
    if identity is None:
        raise ValueError(f"{dispatcher!r} is not a module-level compiled function of stoker")
    module, qualname, serial = identity
    key = (id(dispatcher), serial)
    with _LOCK:
        found = _EXTERNALS.get(key)
        if found is not None:
            return found

    def typer(typingctx: Any, *args: Any) -> Any:
        argtypes = tuple(types.unliteral(a) for a in args)
        symbol, cres = link(module, qualname, serial, argtypes)
        restype = cres.signature.return_type

        def codegen(context: Any, builder: Any, signature: Any, values: Any) -> Any:
            fnty = context.call_conv.get_function_type(restype, argtypes)
            fn = cgutils.get_or_insert_function(builder.module, fnty, symbol)
            status, result = context.call_conv.call_function(builder, fn, restype, argtypes, values)
            with cgutils.if_unlikely(builder, status.is_error):
                context.call_conv.return_status_propagate(builder, status)
            # a process that loads the caller from the cache registers the symbol first
            context.active_code_library._reload_init.add(_Relink(module, qualname, serial, argtypes))
            return result

        return restype(*argtypes), codegen

    # an intrinsic's typer takes the arguments by name: one with the kernel's parameters
    names = [f"a{i}" for i in range(len(inspect.signature(dispatcher.py_func).parameters))]
    space: dict[str, Any] = {"typer": typer}
    name = f"{dispatcher.py_func.__name__}_by_symbol"
    exec(f"def {name}(typingctx, {', '.join(names)}):\n    return typer(typingctx, {', '.join(names)})\n", space)
    stand_in = intrinsic(space[name])
    stand_in._stoker_fingerprint = ("external", module, qualname, serial, dispatcher)  # type: ignore[attr-defined]
    with _LOCK:
        stand_in = _EXTERNALS.setdefault(key, stand_in)
        _KEEP.append(dispatcher)
    return stand_in
