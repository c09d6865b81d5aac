"""One epoch at a time: ``iter(loader)`` starts the next epoch (or refuses a second one), ``close()`` stops it.

Starting an epoch checks that none is being iterated and that the files are unchanged, builds (``recompile``) and
allocates what the epoch needs, plans how its batches are made (:mod:`stoker.loader._planner`, once) and hands it to
the consumer loop (:class:`~stoker.loader._engine.CompiledEpoch`) with the producer threads kept from the epoch before.
Whether an epoch runs is asked of its iterator, collected first where garbage may hold one left by ``break``.
Functions of the Loader (:class:`~stoker.loader._view.LoaderView`); its methods call them.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import TYPE_CHECKING, cast

from stoker._threads import interrupts_blocked
from stoker.errors import StokerError
from stoker.format import _verify
from stoker.loader import _engine, _open, _planner
from stoker.loader._epoch import Epoch, _register_atexit, compiles_here, producer_pool
from stoker.loader._view import LoaderView
from stoker.pipeline.compiler import Compiler

if TYPE_CHECKING:
    from stoker.dataset._remote import RemoteReader
    from stoker.dataset.mixed import MixedReader

#: why a second iter() is refused while an epoch runs or starts
ALREADY_ITERATED = (
    "this Loader is already being iterated: an iterator from an earlier iter() is still alive and not exhausted "
    "(a nested loop over the same Loader, or two threads iterating it). Finish or delete that iterator, or call "
    "loader.close(); use one Loader per thread"
)


def iterating(loader: LoaderView) -> bool:
    """Whether the loader's last epoch is alive and not over (as seen now, garbage not collected)."""
    active = loader._active() if loader._active is not None else None
    return active is not None and not active.finished


def loop_running(loader: LoaderView) -> bool:
    """Whether an epoch is being iterated, whether or not the collector has run since a ``break``.

    Only an ``iter()`` or ``next()`` that compiled leaves garbage that can hold an epoch after ``break``
    (:func:`~stoker.loader._epoch.compiles_here`): then the first call collects once (a fraction of a second);
    otherwise an epoch left by ``break`` is gone at once (CPython frees it with the loop's last reference).
    """
    if iterating(loader) and loader._compile_garbage:
        loader._compile_garbage = False
        return still_iterating(loader)
    return iterating(loader)


def still_iterating(loader: LoaderView) -> bool:
    """Whether an epoch is being iterated, garbage collected first (for a refusal: it costs a collection).

    An epoch left by ``break`` is gone with its iterator, unless garbage holds it: the epoch whose first
    batch compiled the loop is on that compile's stack, which Numba's typing keeps in a reference cycle
    (a failed overload's exception, its traceback, their frames) until the collector runs.
    """
    if not iterating(loader):
        return False
    gc.collect()
    return iterating(loader)


def start(loader: LoaderView) -> Epoch:
    """``iter(loader)``: the next epoch, started; a second one while one runs or starts is refused.

    Raises:
        StokerError: an epoch is being iterated or started (:data:`ALREADY_ITERATED`).
    """
    if loader._recorder is not None:  # (report()'s first batch is timed from the first iter(), as the user waits)
        loader._recorder.note_iter()
    # the check and the start of the epoch are one step: a second thread's iter() while the first one is still
    # starting its epoch (which releases the GIL: the shuffle, the compiled claims) is refused, never run beside it
    if not loader._starting.acquire(blocking=False):
        raise StokerError(ALREADY_ITERATED)
    it: Epoch | None = None
    running = loader._pool.current if loader._pool is not None else None
    try:
        # one step for Ctrl-C too: SIGINT/SIGTERM wait until the epoch has started (a fraction of a millisecond, once
        # compiled), and one that arrived meanwhile ends the epoch it interrupted before it reaches you
        compiled = compiles_here()
        with interrupts_blocked():
            it = _start_epoch(loader)
        if compiles_here() != compiled:  # its garbage may hold the epoch after break (see loop_running)
            loader._compile_garbage = True
        return it
    except BaseException:
        if it is not None:
            it.close()
        elif loader._pool is not None and loader._pool.current is not running:  # this call had started the producers
            loader._pool.stop_epoch()
        raise
    finally:
        loader._starting.release()


def _start_epoch(loader: LoaderView) -> Epoch:
    if still_iterating(loader):  # (no reference to the running epoch here: the error's traceback would keep it alive)
        raise StokerError(ALREADY_ITERATED)
    _open.check_unchanged(loader.reader, loader._identity)  # (a file rewritten in place could kill the process: SIGBUS)
    if loader._pool is not None and loader._pool.busy():  # the producers of an epoch dropped without close() (break)
        loader._pool.stop_epoch()
    if loader.recompile and loader._allocated:
        loader._build()
    loader._allocate()
    epoch, skip = loader._next_epoch, loader._skip_batches
    loader._next_epoch, loader._skip_batches = epoch + 1, 0
    loader._position = loader._run_start = (epoch, skip)
    loader._ran_to_end = False
    slot_base = loader._slot_counter
    loader._slot_counter += max(0, loader._batches_in(epoch) - skip)
    _register_atexit()
    if loader._plan is None:
        with Compiler.enabled(Compiler.is_enabled() if loader._compile is None else loader._compile), Compiler.debug(loader._debug):
            loader._plan = _planner.plan(loader)
    plan = loader._plan
    if loader.check_data and loader._data_check is None and loader.remote is None:
        loader._data_check = _verify.DataCheck(loader.reader, [p.name for p in loader.pipelines])
    elif loader.check_data and loader.remote is not None:  # the reader checks each block as it reads it (a mix: local ones too)
        cast("RemoteReader | MixedReader", loader.reader).check_data([p.name for p in loader.pipelines])
    if plan.loop is not None and not loader.reader._metadata_valid:
        # the compiled loop reads the metadata without the per-batch validation of a big, lazily validated index
        plan = _planner.python_plan("metadata validated per batch")
    it: Epoch = _engine.CompiledEpoch(loader, plan, epoch, skip, slot_base, producer_pool(loader))
    loader._active = weakref.ref(it)
    return it


def close(loader: LoaderView) -> None:
    """``Loader.close``: stop the running epoch, if any, the producer threads and a store's downloads ahead."""
    active = loader._active() if loader._active is not None else None
    if active is not None:
        active.close()
    loader._active = None
    pool, loader._pool = getattr(loader, "_pool", None), None
    if pool is not None:
        stopped = getattr(loader.reader, "downloads_stopped", None)  # (an epoch dropped unclosed: its producers may download)
        with stopped() if stopped is not None else contextlib.nullcontext():
            pool.shutdown()
    remote = getattr(loader, "remote", None)
    if remote is not None:  # no download ahead, no shard pinned (a later epoch schedules its own)
        remote.close()
