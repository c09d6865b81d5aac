"""The fingerprint of compiled code: a hash of everything that determines its machine code.

Two functions with the same fingerprint compile to the same machine code, so
they may share one compiled dispatcher in a process
(:meth:`~stoker.pipeline.compiler.Compiler.compile`) and one file of Numba's
disk cache across processes (:mod:`stoker.pipeline.cache`). The fingerprint
covers:

* the generated source and the ``numba.njit`` options of the function
  (debug mode's bounds checks among them);
* each operation, recursively through everything its code reads: the bytecode,
  constants, defaults and closure values of every function, the options and
  Python function of every compiled function (dispatcher) it calls, Numba
  intrinsics (with their code generation), functions that Numba ``overload``\\ s,
  module-level constants (numpy arrays, tuples, numbers) and the attributes
  read from modules (``kernels.decode`` hashes ``decode``);
* the versions of stoker, Python, numpy, Numba and llvmlite, and the Numba
  settings that change machine code (``NUMBA_BOUNDSCHECK``, ``NUMBA_OPT``,
  ``NUMBA_CPU_NAME``, ...).

Functions of numpy, Numba, ``math`` and Python itself are named, not hashed:
their versions stand for them. Anything else that cannot be fingerprinted (a
closure over an arbitrary object, a jitclass, a ctypes function) has no
fingerprint (``None``): when in doubt, miss.
"""

from __future__ import annotations

import builtins
import dis
import enum
import hashlib
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

# modules whose functions are named, not rebuilt nor hashed: their version says what they do
LIBRARIES = frozenset({"numpy", "numba", "llvmlite", "math", "cmath", "operator", "_operator", "builtins"})

# Numba settings read when machine code is generated
#: the settings that choose the CPU the code is compiled for (left out of a ``portable`` fingerprint)
_CPU_SETTINGS = ("CPU_NAME", "CPU_FEATURES")
_NUMBA_SETTINGS = (
    "BOUNDSCHECK",
    "OPT",
    "CPU_NAME",
    "CPU_FEATURES",
    "DEBUGINFO_DEFAULT",
    "FULL_TRACEBACKS",
    "DISABLE_JIT",
    "LOOP_VECTORIZE",
    "SLP_VECTORIZE",
    "ENABLE_AVX",
    "USING_SVML",
    "DISABLE_INTEL_SVML",
    "EXTEND_VARIABLE_LIFETIMES",
    "CAPTURED_ERRORS",
)
_MAX_DEPTH = 40


class _Uncacheable(Exception):
    pass


# ---- what a function's code reads ------------------------------------------------------


def is_library(value: Any) -> bool:
    """Whether ``value`` (a function, class or dispatcher) belongs to numpy, numba, math or Python itself."""
    fn = getattr(value, "py_func", value)
    module = getattr(fn, "__module__", None)
    if module is None and not isinstance(fn, (types.FunctionType, type)):
        module = type(fn).__module__  # a bound builtin method: np.random.randint
    return (module or "").split(".")[0] in LIBRARIES


def code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from code_objects(const)


def global_loads(code: types.CodeType) -> list[str]:
    """The global names ``code`` (with the functions defined inside it) loads, in order of first use."""
    names: dict[str, None] = {}
    for c in code_objects(code):
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                names[ins.argval] = None
    return list(names)


def references(fn: types.FunctionType) -> list[tuple[str, Any, tuple[str, ...]]]:
    """What ``fn`` reads from outside: ``(label, value, attributes)`` per global, builtin and closure cell.

    ``attributes`` are the attribute chains read from a module (``kernels.decode``
    reads ``decode`` from the module ``kernels``), joined with dots; each value is
    listed once, with every chain read from it.
    """
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False))
    chains: dict[tuple[str, str], dict[str, None]] = {}
    for c in code_objects(fn.__code__):
        root: tuple[str, str] | None = None
        attrs: list[str] = []
        for ins in dis.get_instructions(c):
            if ins.opname == "EXTENDED_ARG":
                continue
            if root is not None and ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                attrs.append(ins.argval)
                continue
            if root is not None and attrs:
                chains[root][".".join(attrs)] = None
            root, attrs = None, []
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                root = ("global", ins.argval)
            elif ins.opname in ("LOAD_DEREF", "LOAD_CLASSDEREF") and ins.argval in cells and ins.argval not in c.co_cellvars:
                root = ("cell", ins.argval)
            if root is not None:
                chains.setdefault(root, {})
        if root is not None and attrs:
            chains[root][".".join(attrs)] = None
    for name in cells:  # every closure value, read or not
        chains.setdefault(("cell", name), {})
    out: list[tuple[str, Any, tuple[str, ...]]] = []
    for (kind, name), reached in chains.items():
        if kind == "cell":
            try:
                value = cells[name].cell_contents
            except ValueError:  # an empty cell: not assigned yet
                continue
        elif name in fn.__globals__:
            value = fn.__globals__[name]
        elif hasattr(builtins, name):
            kind, value = "builtin", getattr(builtins, name)
        else:
            continue
        out.append((f"{kind}:{name}", value, tuple(reached)))
    return out


# ---- the hash ----------------------------------------------------------------------------


def _canon(value: Any) -> str:
    """A repr that does not depend on set or dict order."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(sorted(f"{_canon(k)}: {_canon(v)}" for k, v in value.items())) + "}"
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}(" + ", ".join(sorted(_canon(v) for v in value)) + ")"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}(" + ", ".join(_canon(v) for v in value) + ")"
    return repr(value)


def _environment(portable: bool = False) -> str:
    import llvmlite
    import numba

    import stoker

    names = [n for n in _NUMBA_SETTINGS if not (portable and n in _CPU_SETTINGS)]
    settings = {name: str(getattr(numba.config, name, None)) for name in names}
    return (
        f"stoker {stoker.__version__}; python {sys.implementation.name} {sys.version_info[:3]}; numpy {np.__version__}; "
        f"numba {numba.__version__}; llvmlite {llvmlite.__version__}; {_canon(settings)};"
    )


def _overloads() -> dict[int, list[Any]]:
    """Python functions that Numba compiles from an ``overload``: id -> their templates."""
    from numba.core.typing import templates

    found: dict[int, list[Any]] = {}
    for value, typ in list(templates.builtin_registry.globals):
        found.setdefault(id(value), []).extend(getattr(typ, "templates", ()))
    return found


class _Hasher:
    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.seen: dict[int, int] = {}  # id -> order of first visit, for functions and dispatchers
        self.keep: list[Any] = []  # what `seen` refers to stays alive, so that ids stay unique
        self.overloads = _overloads()

    def put(self, text: str) -> None:
        self.h.update(text.encode())
        self.h.update(b"\x00")

    def first_visit(self, value: Any) -> bool:
        if id(value) in self.seen:
            self.put(f"again:{self.seen[id(value)]}")
            return False
        self.seen[id(value)] = len(self.seen)
        self.keep.append(value)
        return True

    def feed(self, value: Any, depth: int = 0) -> None:
        """Hash ``value``, or raise _Uncacheable."""
        if depth > _MAX_DEPTH:
            raise _Uncacheable("calls nested too deep")
        import numba
        from numba.core.extending import _Intrinsic

        parts = getattr(value, "_stoker_fingerprint", None) if not isinstance(value, (str, bytes, np.ndarray)) else None
        if isinstance(parts, tuple):  # an object that says what determines its code (stoker.pipeline.linking's stand-ins)
            if self.first_visit(value):
                self.put(f"parts[{len(parts)}]")
                for part in parts:
                    self.feed(part, depth + 1)
        elif value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            self.put(f"{type(value).__name__}:{value!r}")
        elif isinstance(value, enum.Enum):
            self.put(f"enum:{type(value).__module__}.{type(value).__qualname__}.{value.name}:{value.value!r}")
        elif isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise _Uncacheable("an object array")
            self.put(f"ndarray:{value.dtype.str}:{value.dtype.descr!r}:{value.shape}")
            self.h.update(np.ascontiguousarray(value).tobytes())
        elif isinstance(value, (np.generic, np.dtype)):
            self.put(f"np:{type(value).__name__}:{value!r}")
        elif isinstance(value, (tuple, list)):
            self.put(f"{type(value).__name__}[{len(value)}]")
            for v in value:
                self.feed(v, depth + 1)
            if hasattr(value, "_fields"):  # a namedtuple
                self.feed(type(value), depth + 1)
        elif isinstance(value, types.ModuleType):
            self.put(f"module:{value.__name__}")
        elif isinstance(value, numba.core.dispatcher.Dispatcher):
            if is_library(value):
                self.put(f"library dispatcher:{value.py_func.__module__}.{value.py_func.__qualname__}")
            elif self.first_visit(value):
                self.put(f"dispatcher:{type(value).__name__}:{_canon(value.targetoptions)}")
                self.feed(value.py_func, depth + 1)
        elif isinstance(value, _Intrinsic):
            if is_library(value):
                self.put(f"library intrinsic:{value.__module__}.{value._name}")
            elif self.first_visit(value):
                self.put(f"intrinsic:{value._name}:{value._prefer_literal!r}:{_canon(value._ctor_kwargs)}")
                self.feed(value._defn, depth + 1)  # the typing function, with its code generation inside
        elif isinstance(value, types.FunctionType):
            if is_library(value):
                self.put(f"library function:{value.__module__}.{value.__qualname__}")
            elif self.first_visit(value):
                self._feed_function(value, depth)
        elif isinstance(value, type):
            self._feed_class(value, depth)
        elif isinstance(getattr(getattr(value, "_dispatcher", None), "py_func", None), types.FunctionType) and not is_library(value):
            # @vectorize: a ufunc compiled from a Python function
            options = getattr(value._dispatcher, "targetoptions", None)
            self.put(f"ufunc:{type(value).__module__}.{type(value).__qualname__}:{_canon(options)}")
            self.feed(value._dispatcher.py_func, depth + 1)
        elif callable(value) and type(value).__module__.split(".")[0] in LIBRARIES and is_library(value):
            # ufuncs, builtins, numba types (numba.uint64) and other library callables, by name
            name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or str(value)
            self.put(f"library:{type(value).__module__}.{type(value).__qualname__}:{getattr(value, '__module__', None)}.{name}")
        else:
            raise _Uncacheable(f"cannot fingerprint {type(value).__module__}.{type(value).__qualname__}")

    def _feed_class(self, cls: type, depth: int) -> None:
        self.put(f"class:{cls.__module__}.{cls.__qualname__}")
        if cls.__module__.split(".")[0] in LIBRARIES or issubclass(cls, BaseException):
            return
        if issubclass(cls, enum.Enum):
            for member in cls:
                self.put(f"member:{member.name}:{member.value!r}")
            return
        if issubclass(cls, tuple) and hasattr(cls, "_fields"):
            self.put(f"fields:{cls._fields!r}")
            return
        raise _Uncacheable(f"class {cls.__qualname__} (a jitclass, or another class Numba types by its content)")

    def _feed_code(self, code: types.CodeType, depth: int) -> None:
        self.put(f"code:{code.co_name}:{code.co_argcount}:{code.co_posonlyargcount}:{code.co_kwonlyargcount}:{code.co_flags}")
        self.h.update(code.co_code)
        self.put(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)))
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self._feed_code(const, depth + 1)
            else:
                self.put(f"const:{type(const).__name__}:{_canon(const)}")

    def _feed_function(self, fn: types.FunctionType, depth: int) -> None:
        self.put(f"function:{fn.__module__}.{fn.__qualname__}")
        self._feed_code(fn.__code__, depth)
        self.put("defaults")
        self.feed(fn.__defaults__, depth + 1)
        self.put(f"kwdefaults:{sorted(fn.__kwdefaults__ or {})}")
        for name in sorted(fn.__kwdefaults__ or {}):
            self.feed((fn.__kwdefaults__ or {})[name], depth + 1)
        for label, value, chains in references(fn):
            self.put(label)
            self.feed(value, depth + 1)
            if isinstance(value, types.ModuleType):
                for chain in chains:
                    self._feed_chain(value, chain, depth + 1)
        for template in self.overloads.get(id(fn), ()):
            # the implementation Numba compiles instead of fn's own code
            self.put(f"overload:{_canon(getattr(template, '_jit_options', None))}")
            impl = getattr(template, "_overload_func", None)
            if impl is None:
                raise _Uncacheable(f"{fn.__qualname__} is typed by a template without an implementation function")
            self.feed(impl, depth + 1)

    def _feed_chain(self, module: types.ModuleType, chain: str, depth: int) -> None:
        value: Any = module
        for attr in chain.split("."):
            self.put(f"attribute:{attr}")
            if not hasattr(value, attr):
                self.put("missing")
                return
            value = getattr(value, attr)
            if not isinstance(value, types.ModuleType):
                break
            self.put(f"module:{value.__name__}")
        if not isinstance(value, types.ModuleType):
            self.feed(value, depth)


def fingerprint(
    source: str, functions: list[Callable[..., Any]], options: Mapping[str, Any] | None = None, *, portable: bool = False
) -> str | None:
    """A hex digest of the generated source, its options and every function it reaches; ``None`` if one cannot be hashed.

    Args:
        source: the generated source of the fused function.
        functions: the operations it calls, in a fixed order.
        options: the ``numba.njit`` options it is compiled with.
        portable: leave out the CPU the code is compiled for (``NUMBA_CPU_NAME``, ``NUMBA_CPU_FEATURES``): a name
            that machine code compiled for one CPU and for another share (a kernel's symbol, which the prebuilt
            kernels, compiled for the generic CPU, call by name).
    """
    hasher = _Hasher()
    hasher.put(_environment(portable))
    hasher.put(f"options:{_canon(dict(options or {}))}")
    hasher.put(source)
    try:
        for fn in functions:
            hasher.put("operation")
            hasher.feed(fn)
    except _Uncacheable:
        return None
    return hasher.h.hexdigest()[:32]
