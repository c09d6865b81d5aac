"""A loader's first batch compiled in parallel: child processes that compile the kernels it needs into the disk cache.

With empty caches (a fresh install), the first batch waits for Numba to compile each kernel it calls, one after
the other, in the thread that makes it: the JPEG decoder's kernel calls ``_decode_one``, which calls ``resize``,
which calls ``_vrow``, and so on. When a loader is planned and its first batch calls a kernel that no cache holds,
:func:`start` forks:

* a **finder**: a process that lists every kernel of stoker the first batch will compile, with its argument types,
  in the order the batch reaches them, without compiling any: Numba's type inference only (the callees are typed,
  never lowered or optimised; about a fifth of compiling them), then hands the list to the compilers and exits;
* up to :func:`children` **compilers** (the CPUs available minus one, at least one, at most 16): each compiles the
  kernels of the list into the disk cache, from the last one the first batch reaches back to the first, while the
  thread that makes the batch compiles from the first one on, as it always has. A kernel whose cache entry another
  process holds (its cross-process lock, :mod:`stoker._numba_cache`) is passed over: the process that reaches it
  later waits for that lock and loads what was saved. Each kernel is compiled once, by whichever process reaches it
  first; the batch waits only for what no process has compiled yet.

The processes are forked as :class:`~stoker.pipeline.warm.Background`'s child is (:func:`~stoker.pipeline._fork.fork_child`): their
results are written whole and renamed (a compiler killed mid-compile leaves nothing that is loaded; the kernel
releases its lock, and the next process compiles that kernel itself), they say nothing, end on their own once their
list is done, and no process waits for them (a daemon thread reaps them). ``STOKER_COMPILE_CHILDREN=N`` sets how many
compilers (``0``: none); ``STOKER_COMPILE_IN_BACKGROUND=0`` or ``STOKER_COMPILE_IN_CHILD=0`` turn them off too.

A call of the first batch is known by its function and the argument types of the values the loader will pass (the
loader's planner lists them); a function that is not compiled itself (Python calling kernels) is given as its
compiled form, whose callees the finder lists (the form itself is not compiled).
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stoker._env import env_count
from stoker._threads import available_cpus, start_thread
from stoker.pipeline import _fork, warm

#: the environment variable: how many compile processes a first batch may use (default: the CPUs available minus one)
CHILDREN_ENV = "STOKER_COMPILE_CHILDREN"
#: the most compile processes started by default (a first batch calls a few dozen kernels)
MAX_CHILDREN = 16
#: seconds a loader's planning waits for another thread's compilation before forking (then: no children) [seconds]
_PATIENCE = 0.2


@dataclass(frozen=True)
class Call:
    """One compiled call of the first batch: ``function`` for ``argtypes``.

    ``needed``: the first batch calls ``function`` itself (else only the kernels it calls: a Python operation's
    compiled form, typed to find them).
    """

    function: Any
    argtypes: tuple[Any, ...]
    needed: bool = True


@dataclass
class Started:
    """The processes :func:`start` forked: the finder's pid and the compilers' (reaped by a daemon thread)."""

    finder: int
    compilers: list[int]
    #: pid -> exit status, once reaped
    status: dict[int, int] = field(default_factory=dict)
    #: pid -> CPU seconds it used (user and system), once reaped
    cpu: dict[int, float] = field(default_factory=dict)
    _reaped: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every process has ended (tests, benchmarks: no loader waits); whether they have."""
        return self._reaped.wait(timeout)


#: the processes started last (tests, benchmarks)
last: list[Started] = []


def children() -> int:
    """How many compile processes a first batch may use: ``$STOKER_COMPILE_CHILDREN``, by default the CPUs available
    minus one (at least 1, at most :data:`MAX_CHILDREN`); 0 when background compilation is off.

    Raises:
        ValueError: ``$STOKER_COMPILE_CHILDREN`` is not a whole number >= 0.
    """
    if not warm.in_background() or os.environ.get("STOKER_COMPILE_IN_CHILD", "1") == "0":
        return 0
    return env_count(CHILDREN_ENV, max(1, min(MAX_CHILDREN, available_cpus() - 1)), "processes", "none")


def start(calls: Sequence[Call]) -> Started | None:
    """Fork the finder and the compilers for the first batch's ``calls`` (in the order the batch makes them).

    Nothing is started (``None``) when :func:`children` is 0, or when every needed call is compiled or cached
    already, or cannot be handed over through a disk cache. Returns at once: nothing waits for the processes.
    """
    n = children()
    if n == 0 or not hasattr(os, "fork"):
        return None
    calls = [c for c in calls if _fork.forkable(c.function) or not c.needed]
    if not any(c.needed and warm.state(c.function, c.argtypes) == "missing" for c in calls):
        return None
    pipes: list[tuple[int, int]] = []
    pids: list[int] = []
    try:
        for _ in range(n):
            r, w = os.pipe()
            pipes.append((r, w))
            pids.append(_fork.fork_child(functools.partial(_compile_listed, r, calls), keep=(r,), patience=_PATIENCE))
        writers = [w for _, w in pipes]
        finder = _fork.fork_child(lambda: _find(calls, writers), keep=writers, patience=_PATIENCE)
    except OSError:  # (no process to spare, or another thread compiling: the first batch compiles as it would without)
        finder = -1
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)
    started = Started(finder, pids)
    last[:] = [started]
    start_thread(_reap, started, name="stoker-compile-reaper", daemon=True)
    return started


def _reap(started: Started) -> None:
    for pid in [started.finder, *started.compilers]:
        if pid <= 0:
            continue
        with contextlib.suppress(ChildProcessError, OSError):
            _, status, usage = os.wait4(pid, 0)
            started.cpu[pid] = usage.ru_utime + usage.ru_stime
            started.status[pid] = os.waitstatus_to_exitcode(status)
    started._reaped.set()


# ---- the finder: every kernel the calls compile, typed only -----------------------------------------------------


def _kernel_names() -> dict[int, tuple[str, str]]:
    """id -> (module, attribute) of every compiled function at module level in stoker's modules: how another forked
    process finds the same function."""
    from numba.core.dispatcher import Dispatcher

    found: dict[int, tuple[str, str]] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("stoker.") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, Dispatcher):
                found.setdefault(id(value), (name, attr))
    return found


def _types_only_compiler() -> Any:
    from numba.core import compiler
    from numba.core.compiler_machinery import PassManager
    from numba.core.typed_passes import NopythonTypeInference

    class TypesOnly(compiler.CompilerBase):  # type: ignore[misc]
        """Numba's front end to type inference, and no further: no lowering, no LLVM."""

        def define_pipelines(self) -> list[Any]:
            pm = PassManager("types only")
            pm.passes.extend(compiler.DefaultPassBuilder.define_untyped_pipeline(self.state).passes)
            pm.add_pass(NopythonTypeInference, "nopython frontend")
            pm.finalize()
            return [pm]

    return TypesOnly


def find(calls: Sequence[Call]) -> list[tuple[Any, tuple[Any, ...]]]:
    """Every compilation ``calls`` make, as ``(dispatcher, argument types)`` in the order they start, typed only.

    Changes Numba's compiler in this process for good (every dispatcher then only types its calls and keeps a
    stand-in for the result): run it only in a process of its own, which exits afterwards (:func:`start`'s finder).
    Entries already in a disk cache are loaded, not typed (their callees are not listed).
    """
    from types import SimpleNamespace

    from numba.core import compiler, sigutils, typing
    from numba.core.dispatcher import Dispatcher

    from stoker.pipeline import linking

    types_only = _types_only_compiler()
    original = Dispatcher.compile
    found: list[tuple[Any, tuple[Any, ...]]] = []

    def compile_types(self: Any, sig: Any) -> Any:
        args, return_type = sigutils.normalize_signature(sig)
        key = tuple(args)
        existing = self.overloads.get(key)
        if existing is not None:
            return existing.entry_point
        if warm.state(self, key) == "cached":
            return original(self, sig)
        found.append((self, key))
        c = self._compiler
        flags = compiler.Flags()
        c.targetdescr.options.parse_as_flags(flags, c.targetoptions)
        flags = c._customize_flags(flags)
        impl = c._get_implementation(args, {})
        pipeline = types_only(c.targetdescr.typing_context, c.targetdescr.target_context, None, args, return_type, flags, c.locals)
        pipeline.state.cr = None
        try:
            pipeline.compile_extra(impl)
        except compiler.CompilerError as exc:  # (no pipeline produced a compile result: the types are what was asked)
            if "exhausted" not in str(exc):
                raise
        result = pipeline.state.return_type
        self.overloads[key] = SimpleNamespace(signature=typing.signature(result, *args), objectmode=False, entry_point=None)
        return None

    def link_types(module: str, qualname: str, serial: bool, argtypes: tuple[Any, ...]) -> tuple[str, Any]:
        dispatcher = linking._resolve(module, qualname, serial)
        dispatcher.compile(argtypes)
        return "", dispatcher.overloads[argtypes]

    Dispatcher.compile = compile_types  # type: ignore[method-assign]
    linking.link = link_types  # type: ignore[assignment]
    for c in calls:
        with contextlib.suppress(Exception):  # (a call that cannot be typed so: what was found before it is kept)
            c.function.compile(c.argtypes)
    return found


def _find(calls: Sequence[Call], writers: Sequence[int]) -> None:  # pragma: no cover - runs in the finder process
    """The finder: :func:`find`'s list, as (where to find the function, argument types), written to each compiler."""
    names = _kernel_names()
    roots = {id(c.function): i for i, c in enumerate(calls)}
    listed: list[tuple[tuple[Any, ...], tuple[Any, ...]]] = []
    try:
        found = find(calls)
    except Exception:  # the calls themselves, then
        found = [(c.function, c.argtypes) for c in calls]
    for dispatcher, argtypes in found:
        i = roots.get(id(dispatcher))
        if i is not None:
            if calls[i].needed:
                listed.append((("call", i), argtypes))
        elif id(dispatcher) in names and warm._stokers(dispatcher.py_func) and _fork.forkable(dispatcher):
            listed.append((("attr", *names[id(dispatcher)]), argtypes))
    data = pickle.dumps(listed)
    for w in writers:
        with contextlib.suppress(OSError):
            view = memoryview(data)
            while view:
                view = view[os.write(w, view) :]
        with contextlib.suppress(OSError):
            os.close(w)


# ---- a compiler: the list, from its end ---------------------------------------------------------------------------


def _read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _compile_listed(reader: int, calls: Sequence[Call]) -> None:  # pragma: no cover - runs in a compiler process
    """A compiler: the finder's list (empty if the finder failed), compiled from its last kernel back to its first,
    each one that is missing from the cache and whose entry no other process holds."""
    data = _read_all(reader)
    os.close(reader)
    listed = pickle.loads(data) if data else []  # (written by the finder, a fork of this process)
    compile_listed(_resolve(listed, calls))


def _resolve(listed: list[tuple[tuple[Any, ...], tuple[Any, ...]]], calls: Sequence[Call]) -> list[tuple[Any, tuple[Any, ...]]]:
    jobs = []
    for where, argtypes in listed:
        if where[0] == "call":
            jobs.append((calls[where[1]].function, argtypes))
            continue
        module = sys.modules.get(where[1])
        function = getattr(module, where[2], None) if module is not None else None
        if function is not None:
            jobs.append((function, argtypes))
    return jobs


def compile_listed(jobs: Sequence[tuple[Any, tuple[Any, ...]]]) -> int:
    """Compile ``jobs`` into the disk cache from the last one back: each one missing from the caches whose entry no
    other process is compiling (its lock taken without waiting; a callee's is waited for). How many it compiled."""
    from stoker import _numba_cache

    done = 0
    for function, argtypes in reversed(jobs):
        if not _fork.forkable(function) or warm.state(function, argtypes) != "missing":
            continue
        release = _numba_cache.try_lock(function, argtypes)
        if release is None:  # another process compiles it
            continue
        try:
            function.compile(argtypes)
            done += 1
        except Exception:  # (the process that needs it compiles it, and says why it fails)
            pass
        finally:
            release()
    return done
