"""Blocking and memory primitives that compiled code can use without the GIL (Linux).

A producer loop compiled as a whole (see ``stoker.loader._engine``)
waits for and signals the consumer through POSIX semaphores, reads the clock
and writes into memory given by address, all inside one ``nogil`` call:

* :class:`Semaphores`: ``count`` unnamed POSIX semaphores in one numpy buffer,
  usable from Python (``wait``/``post``/``try_wait``; a blocking wait releases
  the GIL) and from compiled code (:func:`sem_wait`, :func:`sem_trywait`,
  :func:`sem_post` on :meth:`Semaphores.address`);
* :func:`monotonic_ns`: ``clock_gettime(CLOCK_MONOTONIC)`` in compiled code;
* :func:`compare_and_swap` (compiled) and :func:`claim` (from Python): an atomic
  compare-and-swap of an int32, so that two threads can race for the same work
  and exactly one wins;
* :func:`atomic_load`, :func:`atomic_store`, :func:`store_i8`, :func:`atomic_exchange`, :func:`fence` (compiled) and
  :func:`exchange`, :func:`fenced_load`, :func:`store` (from Python): int64 words shared by threads (the slot
  ring's counters, :mod:`stoker.loader._ring`), read and written in a defined order.

The intrinsics call the C library's functions by name, so compiled code that
uses them can be cached on disk and loaded in another process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from stoker import _numba_cache

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only

_SEM_BYTES = 64  # sizeof(sem_t) is 32 on 64-bit Linux; one cache line each
_CLOCK_MONOTONIC = 1  # Linux


def available() -> bool:
    """Whether the primitives work here: Linux (unnamed POSIX semaphores, ``CLOCK_MONOTONIC`` = 1), 64-bit."""
    return sys.platform.startswith("linux") and sys.maxsize > 2**32 and _libc() is not None


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name, use_errno=True)
        except OSError:
            return None
        for fn in (libc.sem_init, libc.sem_wait, libc.sem_post, libc.sem_trywait, libc.sem_destroy):
            fn.argtypes = [ctypes.c_void_p] if fn is not libc.sem_init else [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
            fn.restype = ctypes.c_int
        _LIBC = libc
    return _LIBC


class Semaphores:
    """``len(initial)`` unnamed POSIX semaphores (process-private), semaphore ``k`` starting at ``initial[k]``.

    Keep the object alive while any thread may use an address it gave.
    """

    def __init__(self, initial: list[int]) -> None:
        libc = _libc()
        if libc is None:  # pragma: no cover - every Linux has a C library
            raise OSError("the C library could not be loaded")
        self._libc = libc
        self.buffer = np.zeros(max(1, len(initial)) * _SEM_BYTES, dtype=np.uint8)
        self._base = int(self.buffer.ctypes.data)
        self.count = len(initial)
        self.reset(initial)

    def reset(self, initial: list[int]) -> None:
        """Start semaphore ``k`` at ``initial[k]`` again; no thread may be using any of them."""
        if len(initial) != self.count:
            raise ValueError(f"{len(initial)} values for {self.count} semaphores")
        for k, value in enumerate(initial):
            if self._libc.sem_init(self._base + k * _SEM_BYTES, 0, value) != 0:
                raise OSError(ctypes.get_errno(), f"sem_init failed for semaphore {k}")

    def address(self, k: int) -> int:
        """The address of semaphore ``k`` (for :func:`sem_wait` and :func:`sem_post` in compiled code)."""
        if not 0 <= k < self.count:
            raise IndexError(f"semaphore {k} of {self.count}")
        return self._base + k * _SEM_BYTES

    def wait(self, k: int) -> None:
        """Wait until semaphore ``k`` is positive and decrement it (the GIL is released while it sleeps)."""
        address = self.address(k)
        if self._libc.sem_trywait(address) == 0:
            return
        while self._libc.sem_wait(address) != 0:  # EINTR: a signal arrived; wait again
            pass

    def try_wait(self, k: int) -> bool:
        """Decrement semaphore ``k`` if it is positive; whether it was."""
        return bool(self._libc.sem_trywait(self.address(k)) == 0)

    def post(self, k: int) -> None:
        """Increment semaphore ``k`` (wakes one waiter)."""
        self._libc.sem_post(self.address(k))


def post_address(address: int) -> None:
    """``sem_post`` on the semaphore at ``address`` (one of :meth:`Semaphores.address`), from Python."""
    _libc().sem_post(address)


def _c_function(builder: Any, name: str, ret: Any, args: list[Any]) -> Any:
    fnty = cgutils.ir.FunctionType(ret, args)
    return cgutils.get_or_insert_function(builder.module, fnty, name)


@intrinsic
def sem_wait(typingctx: Any, address: Any) -> Any:
    """``sem_wait`` on the semaphore at ``address`` (an int64), retried after a signal; returns 0."""
    if not isinstance(address, types.Integer):
        return None
    sig = types.int32(address)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32 = cgutils.ir.IntType(32)
        ptr = builder.inttoptr(args[0], cgutils.voidptr_t)
        fn = _c_function(builder, "sem_wait", i32, [cgutils.voidptr_t])
        # loop while sem_wait returns nonzero (interrupted by a signal)
        loop = builder.append_basic_block("sem_wait.loop")
        done = builder.append_basic_block("sem_wait.done")
        builder.branch(loop)
        builder.position_at_end(loop)
        rc = builder.call(fn, [ptr])
        builder.cbranch(builder.icmp_signed("!=", rc, i32(0)), loop, done)
        builder.position_at_end(done)
        return i32(0)

    return sig, codegen


def _pointer_call(name: str, doc: str) -> Any:
    """An intrinsic calling the C library's ``int name(void *)`` on an address given as an int64."""

    def typer(typingctx: Any, address: Any) -> Any:
        if not isinstance(address, types.Integer):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            i32 = cgutils.ir.IntType(32)
            ptr = builder.inttoptr(args[0], cgutils.voidptr_t)
            return builder.call(_c_function(builder, name, i32, [cgutils.voidptr_t]), [ptr])

        return types.int32(address), codegen

    typer.__name__ = name
    call = intrinsic(typer)
    call.__doc__ = doc
    return call


sem_trywait = _pointer_call(
    "sem_trywait", "``sem_trywait`` on the semaphore at ``address`` (an int64): 0 when it was positive (and is now decremented)."
)
sem_post = _pointer_call("sem_post", "``sem_post`` on the semaphore at ``address`` (an int64); returns its result.")


@intrinsic
def monotonic_ns(typingctx: Any) -> Any:
    """``clock_gettime(CLOCK_MONOTONIC)`` in nanoseconds (int64)."""
    sig = types.int64()

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64 = cgutils.ir.IntType(64)
        i32 = cgutils.ir.IntType(32)
        spec = cgutils.alloca_once(builder, cgutils.ir.ArrayType(i64, 2))
        fn = _c_function(builder, "clock_gettime", i32, [i32, cgutils.voidptr_t])
        builder.call(fn, [i32(_CLOCK_MONOTONIC), builder.bitcast(spec, cgutils.voidptr_t)])
        seconds = builder.load(cgutils.gep_inbounds(builder, spec, 0, 0))
        nanos = builder.load(cgutils.gep_inbounds(builder, spec, 0, 1))
        return builder.add(builder.mul(seconds, i64(1_000_000_000)), nanos)

    return sig, codegen


@intrinsic
def address_as_pointer(typingctx: Any, address: Any) -> Any:
    """The int64 ``address`` as a ``void*`` (for ``numba.carray``)."""
    if not isinstance(address, types.Integer):
        return None
    sig = types.voidptr(address)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return sig, codegen


@intrinsic
def compare_and_swap(typingctx: Any, address: Any, expected: Any, new: Any) -> Any:
    """Atomically: if the int32 at ``address`` is ``expected``, make it ``new``; returns the value it held (sequentially consistent)."""
    if not all(isinstance(a, types.Integer) for a in (address, expected, new)):
        return None
    sig = types.int32(address, expected, new)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32 = cgutils.ir.IntType(32)
        ptr = builder.inttoptr(args[0], i32.as_pointer())
        want = context.cast(builder, args[1], signature.args[1], types.int32)
        value = context.cast(builder, args[2], signature.args[2], types.int32)
        pair = builder.cmpxchg(ptr, want, value, "seq_cst", "seq_cst")
        return builder.extract_value(pair, 0)

    return sig, codegen


def _i64_pointer(builder: Any, address: Any) -> Any:
    return builder.inttoptr(address, cgutils.ir.IntType(64).as_pointer())


@intrinsic
def atomic_load(typingctx: Any, address: Any) -> Any:
    """The int64 at ``address``, loaded atomically with acquire order (never hoisted out of a loop by the compiler)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.load_atomic(_i64_pointer(builder, args[0]), "acquire", 8)

    return types.int64(address), codegen


@intrinsic
def atomic_store(typingctx: Any, address: Any, value: Any) -> Any:
    """Store the int64 ``value`` at ``address`` atomically with release order (the stores before it are seen first)."""
    if not (isinstance(address, types.Integer) and isinstance(value, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        v = context.cast(builder, args[1], signature.args[1], types.int64)
        builder.store_atomic(v, _i64_pointer(builder, args[0]), "release", 8)
        return context.get_dummy_value()

    return types.none(address, value), codegen


@intrinsic
def store_i8(typingctx: Any, address: Any, value: Any) -> Any:
    """Store ``value`` as the int8 at ``address`` atomically with release order (a batch's status after its memory)."""
    if not (isinstance(address, types.Integer) and isinstance(value, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        v = context.cast(builder, args[1], signature.args[1], types.int8)
        builder.store_atomic(v, builder.inttoptr(args[0], cgutils.ir.IntType(8).as_pointer()), "release", 1)
        return context.get_dummy_value()

    return types.none(address, value), codegen


@intrinsic
def atomic_exchange(typingctx: Any, address: Any, value: Any) -> Any:
    """Atomically make the int64 at ``address`` ``value``; returns what it held (sequentially consistent: a full fence)."""
    if not (isinstance(address, types.Integer) and isinstance(value, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        v = context.cast(builder, args[1], signature.args[1], types.int64)
        return builder.atomic_rmw("xchg", _i64_pointer(builder, args[0]), v, "seq_cst")

    return types.int64(address, value), codegen


@intrinsic
def fence(typingctx: Any) -> Any:
    """A full memory fence (sequentially consistent): no load after it is done before a store before it."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


@numba.njit(nogil=True, cache=True)
def exchange(flags: np.ndarray, k: int, value: int) -> int:
    """Atomically make ``flags[k]`` (an int64 array) ``value``; returns what it held (a full fence, from Python)."""
    if k < 0 or k >= flags.shape[0]:
        raise IndexError("exchange: index out of bounds")
    return atomic_exchange(flags.ctypes.data + 8 * k, value)  # type: ignore[call-arg, no-any-return]


@numba.njit(nogil=True, cache=True)
def fenced_load(flags: np.ndarray, k: int) -> int:
    """``flags[k]`` (an int64 array) after a full fence: the caller's earlier stores are seen before this load."""
    if k < 0 or k >= flags.shape[0]:
        raise IndexError("fenced_load: index out of bounds")
    fence()  # type: ignore[call-arg]
    return atomic_load(flags.ctypes.data + 8 * k)  # type: ignore[call-arg, no-any-return]


@numba.njit(nogil=True, cache=True)
def store(flags: np.ndarray, k: int, value: int) -> None:
    """``flags[k] = value`` (an int64 array) as a release store after a full fence (from Python, where the machine's
    own order is weaker than x86's)."""
    if k < 0 or k >= flags.shape[0]:
        raise IndexError("store: index out of bounds")
    fence()  # type: ignore[call-arg]
    atomic_store(flags.ctypes.data + 8 * k, value)  # type: ignore[call-arg]


@numba.njit(nogil=True, cache=True)
def claim_first(flags: np.ndarray, lo: int, hi: int) -> int:
    """Atomically claim (0 -> 1) the first unclaimed ``flags[k]`` with ``lo <= k < hi``; ``k``, or -1 if every one was taken."""
    if lo < 0 or hi > flags.shape[0]:
        raise IndexError("claim_first: range out of bounds")
    base = flags.ctypes.data
    for k in range(lo, hi):
        if flags[k] == 0 and compare_and_swap(base + 4 * k, 0, 1) == 0:  # type: ignore[call-arg]
            return k
    return -1


@numba.njit(nogil=True, cache=True)
def claim(flags: np.ndarray, k: int) -> bool:
    """Atomically set ``flags[k]`` (an int32 array) from 0 to 1; whether this call did it (else another thread had)."""
    return claim_first(flags, k, k + 1) == k  # (IndexError outside flags)
