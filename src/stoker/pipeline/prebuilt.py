"""The library's own kernels, compiled ahead for a portable CPU and shipped with the package.

A new environment (a container on a cluster node, a new virtualenv) starts with
empty compile caches, and stoker's decoders, crops and resizes take tens of
seconds of LLVM work to compile. Built once for the generic x86-64 (or other)
CPU (``NUMBA_CPU_NAME=generic``: machine code every CPU of the architecture
runs), they load in milliseconds on any machine; generated code calls them by
symbol (:mod:`stoker.pipeline.linking`), so only the user's own combination is
compiled, and that in the background (:mod:`stoker.pipeline.warm`).

Layout: ``stoker/_prebuilt/<module>/<Numba's file name>.nbi`` and ``.nbc``, Numba's
own index and data files, keyed by the generic CPU. Lookup order for a kernel:
its disk cache in stoker's private folder (code compiled on this machine, for
its CPU: :mod:`stoker._numba_cache`), then the prebuilt files (package data,
trusted as the package's code is): on an x86-64 CPU with AVX-512 or AVX2, first
the entries built for the best level it runs (:data:`FAST_CPUS`, the modules in
:data:`FAST_MODULES` only: the shuffle, whose draws vectorise there), then the
generic CPU's. An entry is used only if it was built from exactly this
package's sources: each index carries a hash of the versions of Python,
numpy, Numba and llvmlite and of the sources its kernels can depend on (Numba's
own index stamp only covers the kernel's file, not the kernels it calls): the
kernel's module, every module of stoker it imports (at any depth, lazy imports
included, a package's ``__init__`` with each of its modules), and the modules
that extend Numba or store its caches (:data:`_ALWAYS`). An edit to the
Loader, flows or the store leaves the image kernels' entries valid; an edit to
anything a kernel could reach makes its module's entries miss (compiled here
instead, as without prebuilt files). Building:
``stoker warmup --library`` (``make prebuilt``), which runs representative
pipelines in a process with ``NUMBA_CPU_NAME=generic`` and saves every kernel
of stoker it compiled. ``STOKER_PREBUILT=0`` turns the lookup off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_PACKAGE = Path(__file__).resolve().parents[1]
#: where the prebuilt kernels live (package data)
PREBUILT_DIR = _PACKAGE / "_prebuilt"
#: the file in it that lists each module's :func:`dependencies`, as the build found them
DEPENDENCIES = "dependencies.json"
#: the CPU every prebuilt kernel is built for: machine code every CPU of the architecture runs
GENERIC_CPU = "generic"
_V2 = ("sse3", "ssse3", "sse4.1", "sse4.2", "popcnt", "cx16", "sahf")
_V3 = (*_V2, "avx", "avx2", "bmi", "bmi2", "f16c", "fma", "lzcnt", "movbe", "xsave")
_V4 = (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
#: more builds of the modules in :data:`FAST_MODULES`, for x86-64 CPU levels (LLVM's names), best first, each with the
#: host CPU features (LLVM's names) its code may use: a CPU looks up the entries of the best level whose every feature
#: it has (one without them would stop at the first such instruction: ``SIGILL``), then the generic CPU's. The
#: shuffle's draws (64-bit multiplies) vectorise with AVX-512 (Intel Xeon since Skylake-SP, AMD since Zen 4) and in
#: part with AVX2: seed 003's order (300,000 values) shuffles in 1.8-2.0 ms with the generic x86-64's code, 1.4 ms with
#: x86-64-v3's, 0.70-0.74 ms with x86-64-v4's and 0.69-0.72 ms with this CPU's own (measured here, AVX-512); a fresh
#: install's first process runs the prebuilt code all its life (this CPU's is compiled at its exit, for the next ones)
FAST_CPUS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (("x86-64-v4", _V4), ("x86-64-v3", _V3)) if platform.machine().lower() in {"x86_64", "amd64"} else ()
)
#: the modules built for :data:`FAST_CPUS` too (a few hundred KB each: only where it pays)
FAST_MODULES = ("stoker.pipeline.random",)

_STAMPS: dict[str, tuple[str, str]] = {}
#: this process's walk of the package's sources: module names and files, each module's imports, each file's digest
_MEMO: dict[Any, Any] = {}
#: modules every kernel's stamp covers: Numba's extensions (intrinsics, overloads) that typing finds without an
#: import, the cache's own format, and this module
_ALWAYS = ("stoker._numba_cache", "stoker.pipeline.native", "stoker.image._kernels", "stoker.format._verify", __name__)
#: an import of stoker's modules: ``from stoker.x import a, b`` (one line or parenthesised) or ``import stoker.x``
_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(stoker(?:\.\w+)*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]*)|import[ \t]+(stoker(?:\.\w+)*))", re.M)
_SCANNED: set[str] = set()
_LOCK = threading.Lock()
#: kernels loaded from the prebuilt files in this process, and the seconds spent looking them up (tests, benchmarks)
hits: list[str] = []
#: the CPU whose prebuilt code each kernel loaded was built for (:data:`GENERIC_CPU` or one of :data:`FAST_CPUS`), by name
hit_cpus: dict[str, str] = {}
load_seconds = [0.0]


def enabled() -> bool:
    """Whether prebuilt kernels are looked up (``STOKER_PREBUILT``, default on) and there are any."""
    return os.environ.get("STOKER_PREBUILT", "1") != "0" and PREBUILT_DIR.is_dir()


def _module_file(module: str) -> Path | None:
    """The source file of one of stoker's modules (a package's ``__init__.py``), or ``None``."""
    files = _MEMO.get("files")
    if files is None:  # (one walk of the package: every module's name -> its file)
        files = {}
        for path in _PACKAGE.rglob("*.py"):
            parts = path.relative_to(_PACKAGE).with_suffix("").parts
            files[".".join(("stoker", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
        _MEMO["files"] = files
    return files.get(module)  # type: ignore[no-any-return]


def _imports(module: str, path: Path) -> set[str]:
    """The modules of stoker that ``module``'s source imports (its parent packages too), as names."""
    found: set[str] | None = _MEMO.get(("imports", module))
    if found is None:
        parts = module.split(".")
        found = {".".join(parts[:i]) for i in range(1, len(parts))}
        for m in _IMPORT.finditer(path.read_text(encoding="utf-8")):
            if m.group(3):
                found.add(m.group(3))
                continue
            found.add(m.group(1))
            for name in re.findall(r"\w+", m.group(2)):  # (``from stoker.pipeline import native``: a module too)
                if _module_file(f"{m.group(1)}.{name}") is not None:
                    found.add(f"{m.group(1)}.{name}")
        _MEMO[("imports", module)] = found
    return found


def dependencies(module: str) -> list[str]:
    """The modules of stoker whose sources ``module``'s kernels can depend on, sorted (see the module's docstring)."""
    return sorted(_dependency_files(module))


def _dependency_files(module: str) -> dict[str, Path]:
    seen: dict[str, Path] = {}
    todo = [module, *_ALWAYS]
    while todo:
        name = todo.pop()
        path = _module_file(name) if name not in seen else None
        if path is None:
            continue
        seen[name] = path
        todo += _imports(name, path)
    return seen


def source_stamp(module: str) -> tuple[str, str]:
    """The prebuilt entries' stamp for ``module``'s kernels: a hash of the versions that change compiled code and of
    the sources of :func:`dependencies` (computed once per module and process: a few milliseconds)."""
    stamp = _STAMPS.get(module)
    if stamp is None:
        import llvmlite
        import numba
        import numpy as np

        h = hashlib.sha256(f"{sys.version_info[:2]} {np.__version__} {numba.__version__} {llvmlite.__version__}".encode())
        # the list the build saved (reading the import statements of ~130 files is a quarter of a second): a change
        # to what the kernels import changes a file of the list, so the stamp still misses
        listed = _listed_dependencies().get(module)
        for name in listed if listed is not None else dependencies(module):
            digest = _MEMO.get(("digest", name))
            if digest is None:
                path = _module_file(name)
                content = path.read_bytes() if path is not None else b"(no such module)"
                digest = _MEMO[("digest", name)] = hashlib.sha256(content).digest()
            h.update(name.encode() + b"\0" + digest)
        stamp = _STAMPS[module] = ("stoker-sources", h.hexdigest())
    return stamp


def _listed_dependencies() -> dict[str, list[str]]:
    """The build's :func:`dependencies` of each module it saved kernels of (``_prebuilt/dependencies.json``)."""
    key = ("listed", str(PREBUILT_DIR))
    listed = _MEMO.get(key)
    if listed is None:
        try:
            listed = json.loads((PREBUILT_DIR / DEPENDENCIES).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            listed = {}
        _MEMO[key] = listed
    return listed  # type: ignore[no-any-return]


def _generic_magic(codegen: Any) -> tuple[str, str, str]:
    return (codegen.magic_tuple()[0], GENERIC_CPU, "")


def fast_cpus(features: Any = None) -> list[str]:
    """The levels of :data:`FAST_CPUS` whose every feature this CPU (or one with LLVM's ``features`` map) has, best
    first (memoised for this CPU)."""
    if features is None:
        host = _MEMO.get("host fast cpus")
        if host is None:
            import llvmlite.binding as ll

            host = _MEMO["host fast cpus"] = fast_cpus(ll.get_host_cpu_features()) if FAST_CPUS else []
        return list(host)
    return [cpu for cpu, needs in FAST_CPUS if all(features.get(f, False) for f in needs)]


def _magics(module: str, codegen: Any) -> list[tuple[str, str, str]]:
    """The CPU keys a kernel of ``module`` is looked up by among the prebuilt files, best first."""
    generic = _generic_magic(codegen)
    if module in FAST_MODULES:
        return [*((generic[0], cpu, "") for cpu in fast_cpus()[:1]), generic]
    return [generic]


def _layered_class() -> type:
    from numba.core.caching import IndexDataCacheFile

    from stoker._numba_cache import PrivateFunctionCache

    class LayeredCache(PrivateFunctionCache):  # type: ignore[misc]
        """The kernel's cache in stoker's private folder, then the prebuilt files (see the module's docstring)."""

        def __init__(self, py_func: Any) -> None:
            super().__init__(py_func)
            self._prebuilt_file: Any = None
            #: (module, qualname, serial): how another process finds the kernel (set by attach)
            self._identity: tuple[str, str, bool] | None = None

        @property
        def _prebuilt(self) -> Any:  # (made at its first lookup: the stamp reads the sources the kernel depends on)
            if self._prebuilt_file is None:
                module = self._py_func.__module__
                folder = PREBUILT_DIR / module
                self._prebuilt_file = IndexDataCacheFile(str(folder), self._impl.filename_base, source_stamp(module))
            return self._prebuilt_file

        def load_overload(self, sig: Any, target_context: Any) -> Any:
            return load_without_refresh(self, sig, target_context)

        def _load_overload(self, sig: Any, target_context: Any) -> Any:
            data = super()._load_overload(sig, target_context)
            if data is None and self._enabled and not _SUSPENDED[0]:
                t0 = time.perf_counter()
                codegen = target_context.codegen()
                sig_, _, hashes = self._index_key(sig, codegen)
                payload = None
                for magic in _magics(self._py_func.__module__, codegen):
                    payload = self._prebuilt.load((sig_, magic, hashes))
                    if payload is not None:
                        break
                if payload is not None:
                    data = self._impl.rebuild(target_context, payload)
                    hits.append(self._py_func.__qualname__)
                    hit_cpus[self._py_func.__qualname__] = magic[1]
                    _GENERIC[id(data)] = data
                    if self._identity is not None:  # (compiled for this CPU in the background: the next processes')
                        _queue_for_this_cpu((*self._identity, tuple(sig)))
                load_seconds[0] += time.perf_counter() - t0
            return data

        def in_prebuilt(self, sig: Any, codegen: Any) -> bool:
            """Whether :meth:`load_overload` would find ``sig`` in the prebuilt files (its index only is read)."""
            if not self._enabled or _SUSPENDED[0]:
                return False
            sig_, _, hashes = self._index_key(sig, codegen)
            try:
                index = self._prebuilt._load_index()
                return any((sig_, magic, hashes) in index for magic in _magics(self._py_func.__module__, codegen))
            except Exception:  # (an index another Numba wrote: as if not there)
                return False

        def this_cpus(self, sig: Any, target_context: Any) -> Any:
            """The entry of ``sig`` compiled for this CPU, from stoker's private folder only, or ``None``."""
            return super()._load_overload(sig, target_context)

        def save_prebuilt(self, sig: Any, cres: Any) -> bool:
            """Save ``cres`` (compiled for the generic CPU, or for a level of :data:`FAST_CPUS`: a kernel of
            :data:`FAST_MODULES` only) into the prebuilt files; whether it was saved."""
            if not self._impl.check_cachable(cres):
                return False
            codegen = cres.library.codegen
            cpu = codegen.magic_tuple()[1:]
            if cpu in {(name, "") for name, _ in FAST_CPUS}:
                if self._py_func.__module__ not in FAST_MODULES:
                    return False
            elif cpu != (GENERIC_CPU, ""):
                raise RuntimeError(f"prebuilt kernels must be compiled with NUMBA_CPU_NAME={GENERIC_CPU} (or a level of "
                                   "FAST_CPUS, with NUMBA_CPU_FEATURES empty)")  # fmt: skip
            key = self._index_key(sig, codegen)
            try:
                payload = self._impl.reduce(cres)
            except RuntimeError:  # loaded from this process's cache (its JIT took the object code): that entry's
                payload = self._cache_file.load(key)  # (compiled here for the generic CPU too, by another process)
                if payload is None:
                    return False
            os.makedirs(self._prebuilt._cache_path, exist_ok=True)
            self._prebuilt.save((key[0], (codegen.magic_tuple()[0], *cpu), key[2]), payload)
            return True

    return LayeredCache


_LAYERED: type | None = None


def load_without_refresh(cache: Any, sig: Any, target_context: Any) -> Any:
    """``cache.load_overload`` without refreshing the target's registries first.

    Numba refreshes its typing and lowering registries before every cache lookup
    (importing much of Numba: about half a second, once per process); loading
    compiled code needs only the runtime (NRT) those registries would start, not
    the registries: compiling, which needs them, refreshes them itself.

    The loaded library keeps the entry's ``reload_init`` (what its code needs
    registered first: see :mod:`stoker.pipeline.linking`), so that a function
    compiled later that links it is cached with them too.
    """
    from numba.core.runtime import rtsys

    rtsys.initialize(target_context)  # (a no-op once done)
    cres = cache.load_or_lock(sig, target_context)  # (a miss holds the entry's lock: stoker._numba_cache)
    if cres is not None and cres.reload_init:
        # Numba has run them (registering the kernels the code calls by symbol) but gives the rebuilt library none:
        # a function compiled later that links this one inherits its library's, and would be cached without them
        cres.library._reload_init.update(cres.reload_init)
    return cres


def attach(dispatcher: Any) -> None:
    """Give one of stoker's cached kernels the prebuilt layer (nothing if it has it, is not cached, or the layer is off)."""
    global _LAYERED
    from stoker._numba_cache import PrivateFunctionCache

    cache = getattr(dispatcher, "_cache", None)
    if type(cache) is not PrivateFunctionCache or not dispatcher.py_func.__module__.startswith("stoker."):
        return
    if _LAYERED is None:
        _LAYERED = _layered_class()
    try:
        layered = _LAYERED(dispatcher.py_func)
    except Exception:  # no place for its cache (Numba's own error): as it was
        return
    from stoker.pipeline.compiler import serial_origin

    origin = serial_origin(dispatcher)  # (a serial twin: found again as its parallel kernel's twin)
    fn = (origin if origin is not None else dispatcher).py_func
    if "<locals>" not in fn.__qualname__:
        layered._identity = (fn.__module__, fn.__qualname__, origin is not None)
    dispatcher._cache = layered


# ---- the same kernels compiled for this CPU, in the background ----------------------------------------------------
#: the compile results loaded from the prebuilt files in this process (id -> result: kept alive, so ids stay unique)
_GENERIC: dict[int, Any] = {}
#: (module, qualname, serial, argument types) of prebuilt kernels loaded and not yet handed to a compile process
_PENDING: list[tuple[str, str, bool, tuple[Any, ...]]] = []
#: the compile processes started (tests wait for them)
host_compiles: list[Any] = []
#: the kernels handed to them: (module, qualname, serial, argument types)
host_compiled: list[tuple[str, str, bool, tuple[Any, ...]]] = []
#: whether :func:`_start_host_compile` is registered to run at this process's exit
_AT_EXIT: list[bool] = []


#: how many :func:`suspended` blocks are running (the prebuilt files are not looked up meanwhile)
_SUSPENDED = [0]


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """A block that compiles for this CPU what it would have loaded from the prebuilt files (``Loader.compile()``,
    ``stoker warmup``: compiling ahead is asked for this machine's code). Kernels already loaded stay as they are."""
    with _LOCK:
        _SUSPENDED[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _SUSPENDED[0] -= 1


def host_compile_enabled() -> bool:
    """Whether prebuilt kernels loaded are compiled for this CPU in the background (``STOKER_HOST_KERNELS``, default on)."""
    return os.environ.get("STOKER_HOST_KERNELS", "1") != "0"


def _queue_for_this_cpu(item: tuple[str, str, bool, tuple[Any, ...]]) -> None:
    if not host_compile_enabled():
        return
    with _LOCK:
        _PENDING.append(item)
        if _AT_EXIT:
            return
        _AT_EXIT.append(True)
    import atexit

    atexit.register(_start_host_compile)


def _start_host_compile() -> None:
    """One detached process, at the lowest priority, compiles the pending kernels for this CPU into stoker's private
    folder (:mod:`stoker.pipeline._host_kernels`): the next processes load those, a little faster than the generic
    CPU's code. Started when this process exits (registered with :mod:`atexit` by the first kernel loaded from the
    prebuilt files), never beside its training: even at the lowest priority the compile took CPU time the first
    process's loop could use (Otto: 0.82x-0.87x the warm speed for the 30 s measured, 0.97x-1.0x without it), for a
    gain of a few percent (photo crops: the generic code 0.94x this CPU's). A producer loop loaded later calls them
    (:func:`for_this_cpu`). It finishes on its own after this process exits; a kernel another process compiles
    meanwhile is waited for and loaded (the cache's lock), not compiled twice."""
    import pickle
    import subprocess

    with _LOCK:
        items, _PENDING[:] = list(_PENDING), []
        host_compiled.extend(items)
    if not items:
        return
    env = dict(os.environ, STOKER_PREBUILT="0", STOKER_COMPILE_CHILDREN="0", STOKER_COMPILE_IN_BACKGROUND="0")
    env.pop("NUMBA_CPU_NAME", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE.parent), env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stoker.pipeline._host_kernels"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
        )  # fmt: skip
        stdin: Any = proc.stdin
        stdin.write(pickle.dumps(items))
        stdin.close()
    except Exception:  # (no process to start, types that do not pickle, a pipe closed: nothing compiled; at exit, silent)
        return
    host_compiles.append(proc)  # (not waited for: it outlives this process)


def for_this_cpu(dispatcher: Any, argtypes: tuple[Any, ...]) -> Any:
    """``dispatcher``'s compile result for ``argtypes`` (compiled or loaded), preferring code compiled for this CPU.

    A result loaded from the prebuilt files (the generic CPU's) is replaced by the private folder's entry for this
    CPU once the background compile has saved it: what generated code (a producer loop loaded at the switch) calls
    by symbol.
    """
    cres = dispatcher.overloads[argtypes]
    if id(cres) in _GENERIC:
        cache = getattr(dispatcher, "_cache", None)
        this_cpus = getattr(cache, "this_cpus", None)
        if this_cpus is not None:
            try:
                found = this_cpus(argtypes, dispatcher.targetctx)
            except Exception:  # (an entry that does not load: the generic one)
                found = None
            if found is not None:
                return found
    return cres


def attach_all() -> None:
    """Attach the prebuilt layer to every cached kernel of stoker's modules imported so far (once per module)."""
    if not enabled():
        return
    import numba

    with _LOCK:
        for name, module in list(sys.modules.items()):
            if not name.startswith("stoker.") or name in _SCANNED or module is None:
                continue
            _SCANNED.add(name)
            for value in list(vars(module).values()):
                if isinstance(value, numba.core.dispatcher.Dispatcher):
                    attach(value)


def save_all() -> list[str]:
    """Save every kernel of stoker's modules compiled in this process into the prebuilt files; the names saved.

    Run in a process with ``NUMBA_CPU_NAME=generic``, after pipelines that compile the kernels (or with
    a level of :data:`FAST_CPUS`, after :func:`compile_fast_entries`: what it saves is added to the generic build's files).
    """
    import numba

    from stoker.pipeline.compiler import serial_twins

    saved = []
    modules: set[str] = set()
    kernels: list[Any] = []
    for name, module in list(sys.modules.items()):
        if name.startswith("stoker.") and module is not None:
            kernels += [v for v in vars(module).values() if isinstance(v, numba.core.dispatcher.Dispatcher)]
    kernels += serial_twins()
    layered: Any = _LAYERED or _layered_class()
    seen: set[int] = set()
    for kernel in kernels:
        if id(kernel) in seen or not kernel.py_func.__module__.startswith("stoker.") or not kernel.overloads:
            continue
        seen.add(id(kernel))
        from numba.core.caching import NullCache

        if isinstance(getattr(kernel, "_cache", None), NullCache):
            continue
        cache: Any = kernel._cache if isinstance(kernel._cache, layered) else layered(kernel.py_func)
        for argtypes, cres in list(kernel.overloads.items()):
            if cache.save_prebuilt(tuple(argtypes), cres):
                saved.append(f"{kernel.py_func.__module__}.{kernel.py_func.__qualname__}{tuple(str(a) for a in argtypes)}")
                modules.add(kernel.py_func.__module__)
    if modules:
        listed = _listed_dependencies() | {m: dependencies(m) for m in modules}
        listed = {m: listed[m] for m in sorted(listed)}
        (PREBUILT_DIR / DEPENDENCIES).write_text(json.dumps(listed, indent=1) + "\n", encoding="utf-8")
        _MEMO.pop(("listed", str(PREBUILT_DIR)), None)
    return saved


def compile_fast_entries() -> None:
    """Compile every kernel of :data:`FAST_MODULES` for each signature the generic build saved of it (in the fast
    build's process: ``NUMBA_CPU_NAME`` is a level of :data:`FAST_CPUS`, ``NUMBA_CPU_FEATURES`` empty); :func:`save_all` then
    saves them beside the generic entries."""
    import importlib

    import numba

    layered: Any = _LAYERED or _layered_class()
    for name in FAST_MODULES:
        module = importlib.import_module(name)
        for kernel in list(vars(module).values()):
            if not isinstance(kernel, numba.core.dispatcher.Dispatcher) or kernel.py_func.__module__ != name:
                continue
            for sig, magic, _ in list(layered(kernel.py_func)._prebuilt._load_index()):
                if magic[1:] == (GENERIC_CPU, ""):
                    kernel.compile(tuple(sig))
