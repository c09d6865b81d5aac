"""The public face of a built flow: lifecycle, consumption, statistics, resuming."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from stoker._threads import start_thread
from stoker.errors import StokerError
from stoker.flow._bridges import declare_held
from stoker.flow._builder import AggregateSpec, DisaggregateSpec, PipeSpec
from stoker.flow._engine import _Engine, run_reporter
from stoker.flow._errors import StageError
from stoker.flow._stats import PipelineStats
from stoker.observe import _report, _trace

_STATE_VERSION = 1

# Every running flow, so that interpreter exit stops and joins its threads (they are daemons: a flow left
# running never blocks exit, and is stopped here before the modules its functions use go away).
_LIVE: weakref.WeakSet[_Engine] = weakref.WeakSet()
_ATEXIT = False


def _stop_all() -> None:
    for engine in list(_LIVE):
        with contextlib.suppress(Exception):
            engine.stop()


def _register(engine: _Engine) -> None:
    global _ATEXIT
    if not _ATEXIT:
        atexit.register(_stop_all)
        _ATEXIT = True
    _LIVE.add(engine)


def _is_loader(source: Any) -> bool:
    loader = sys.modules.get("stoker.loader")  # a Loader exists only once stoker.loader is imported
    return loader is not None and isinstance(source, loader.Loader)


def _stop_collected(engine: _Engine) -> None:
    """A running pipeline was collected: stop its engine, from another thread if this one may hold its lock."""
    mine = threading.current_thread() in engine.threads or threading.current_thread() is engine.loop_thread
    if mine or engine._lock.locked():
        start_thread(engine.stop, name="stoker-flow-stopper")
    else:
        engine.stop()
    _LIVE.discard(engine)


def _stderr(text: str) -> None:
    sys.stderr.write(text + "\n")


class Pipeline:
    """A built flow (see :class:`~stoker.flow.PipelineBuilder`): iterate it, or :meth:`get_item` from it.

    Lifecycle: ``build()`` -> :meth:`start` (threads start) -> consume -> :meth:`stop`
    (threads joined; any number of times). A pipeline runs once. ``for item in
    pipeline`` starts it if needed, and stops it when the loop ends, breaks or
    raises, if the loop started it; :meth:`auto_stop` does the same around a block.
    A pipeline never started holds no thread; one left running is stopped when it
    is collected, and at interpreter exit.

    Failures: an item whose function raises is dropped; after ``max_failures`` of
    them the next one stops the flow and the consumer gets a
    :class:`~stoker.flow.StageError` (stage, position, the exception).
    ``None`` is an item like any other.
    """

    def __init__(
        self,
        source: Iterable[Any],
        ops: tuple[PipeSpec | AggregateSpec | DisaggregateSpec, ...],
        *,
        sink_size: int,
        num_threads: int,
        max_failures: int,
        queue_size: int | None,
        report_interval: float | None,
        report_at_end: bool,
        report: Callable[[str], None] | None,
    ) -> None:
        self._source = source
        self._engine = _Engine(ops, sink_size, num_threads, max_failures, queue_size)
        self._report_interval = report_interval
        self._report_at_end = report_at_end
        self._report = report or _stderr
        self._reporter: threading.Thread | None = None
        self._reporter_stop = threading.Event()
        self._state = "built"  # -> "running" -> "stopped"
        self._lifecycle = threading.Lock()
        self._restore: Mapping[str, Any] | None = None
        self._source_state: Any = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the source thread, the worker threads, and the event loop or process pools stages need.

        Raises:
            StokerError: the pipeline was already started (a pipeline runs once), or
                its source cannot resume from the state given to :meth:`load_state_dict`.
        """
        with self._lifecycle:
            if self._state != "built":
                raise StokerError(f"start(): the pipeline is {self._state}; a pipeline runs once (build another to run again)")
            iterator, first = self._open_source()
            self._engine.start(iterator, first)
            _register(self._engine)
            # stop the threads when the pipeline is collected without stop(); never at exit (atexit does it, in order)
            self._finalizer = weakref.finalize(self, _stop_collected, self._engine)
            self._finalizer.atexit = False
            if self._report_interval is not None:
                self._reporter = start_thread(
                    run_reporter, self._engine.stats, self._report_interval, self._reporter_stop, self._report, name="stoker-flow-report"
                )
            self._state = "running"

    def stop(self) -> None:
        """Stop every stage and join every thread the pipeline started (safe to call any number of times).

        Functions already running finish first; queued items are dropped.
        """
        with self._lifecycle:
            if self._state != "running":
                self._state = "stopped"
                return
            self._state = "stopped"
        self._reporter_stop.set()
        if self._reporter is not None and self._reporter is not threading.current_thread():
            self._reporter.join()
        self._engine.stop()
        _LIVE.discard(self._engine)
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._report_at_end:
            self._report(self._engine.stats().report())

    @contextlib.contextmanager
    def auto_stop(self) -> Iterator[Pipeline]:
        """Start the pipeline (if not started) and stop it when the block ends, however it ends."""
        if self._state == "built":
            self.start()
        try:
            yield self
        finally:
            self.stop()

    def __enter__(self) -> Pipeline:
        if self._state == "built":
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- consumption --------------------------------------------------------------------------
    def get_item(self, *, timeout: float | None = None) -> Any:
        """The next item from the sink, starting the pipeline if it was not started.

        Args:
            timeout: the longest to wait [seconds]; ``None`` waits as long as it takes.

        Raises:
            StageError: a stage failed (beyond ``max_failures``); the flow has stopped working.
            EOFError: every item was delivered.
            TimeoutError: no item came within ``timeout``.
            StokerError: the pipeline was stopped.
        """
        if self._state == "built":
            self.start()
        return self._engine.get(timeout)

    def __iter__(self) -> Iterator[Any]:
        if self._engine.recorder is not None:  # (report()'s first item is timed from the first iter(), as the user waits)
            self._engine.recorder.note_iter()
        started_here = self._state == "built"
        if started_here:
            self.start()
        return self._items(started_here)

    def _items(self, owner: bool) -> Iterator[Any]:
        try:
            while True:
                try:
                    item = self._engine.get(None)
                except EOFError:
                    return
                yield item
        finally:
            if owner:
                self.stop()

    # ---- what it did ----------------------------------------------------------------------------
    def stats(self) -> PipelineStats:
        """Per-stage statistics now (see :class:`~stoker.flow.PipelineStats`); ``.report()`` formats them."""
        return self._engine.stats()

    def report(self, gather: bool = False) -> str:
        """Whether the consumer is data-bound, in a few lines (as :meth:`stoker.loader.Loader.report`).

        The share of its time the consumer waited in ``get``, the verdict, the stage that
        caused most of the waiting (each wait is blamed on the stage that holds the next
        item, and follows the item downstream) with its time per item, one suggestion.

        Args:
            gather: with ``torch.distributed`` initialised, gather every rank's figures (one
                collective call on every rank) and name the rank that waits most.
        """
        rec = self._engine.recorder
        if rec is None:
            return f"{self!r}: accounting is off (STOKER_ACCOUNTING=0)"
        summary = _report.summarize(rec)
        return _report.render(summary, _report.gather(summary) if gather else None)

    def trace(self, path: str | os.PathLike[str]) -> contextlib.AbstractContextManager[None]:
        """Record a timeline of this flow while the block runs (Chrome trace-event JSON streamed to ``path``).

        A track per stage and worker thread (each call of the stage's function), and the
        consumer's track (its waits and steps). See :meth:`stoker.loader.Loader.trace`.
        """
        return _trace.tracing(self._engine.recorder, path)

    def queue_sizes(self) -> dict[str, tuple[int, int]]:
        """Per stage, now: (items in its input queue, items it holds: running, reordering or waiting for room)."""
        return self._engine.occupancy()

    @property
    def failures(self) -> list[StageError]:
        """The tolerated failures (``max_failures``), the last 100 of them."""
        with self._engine._lock:
            return list(self._engine.failures)

    @property
    def num_failures(self) -> int:
        """Items whose function raised, so far."""
        return self._engine.n_failures

    # ---- resuming ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the consumer is: the number of source items whose outputs were all delivered.

        A source item counts once every item made from it reached the consumer (or
        failed, within ``max_failures``, or was dropped by ``drop_last``), and every
        source item before it did too. Restore it into a new pipeline built the same
        way with :meth:`load_state_dict` before it starts: it continues after them.
        """
        eng = self._engine
        with eng._lock:
            delivered = eng.watermark
        if self._restore is not None and self._state == "built":
            delivered = int(self._restore["items_delivered"])
        return {"version": _STATE_VERSION, "items_delivered": delivered, "source": self._source_state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict` when the pipeline starts.

        Raises:
            StokerError: the pipeline already started, the state is not one, or the source
                cannot skip ahead (it must be a sequence or a :class:`~stoker.loader.Loader`).
        """
        if self._state != "built":
            raise StokerError("load_state_dict() must be called before the pipeline starts")
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            raise StokerError(f"load_state_dict() needs a state_dict() of version {_STATE_VERSION}; got {state!r:.200}")
        n = state.get("items_delivered")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise StokerError(f"flow state: items_delivered must be an int >= 0; got {n!r}")
        if not (_is_loader(self._source) or isinstance(self._source, (Sequence, range))):
            raise StokerError(
                f"a flow resumes only from a sequence (len and indexing) or a stoker Loader; its source is a "
                f"{type(self._source).__name__} (wrap a list, or skip the items yourself)"
            )
        self._restore = state

    def _open_source(self) -> tuple[Iterator[Any], int]:
        source, state = self._source, self._restore
        skip = int(state["items_delivered"]) if state is not None else 0
        if _is_loader(source):
            declare_held(source, self._engine)  # before iter(): the epoch's memory is sized for what the flow holds
            base = state["source"] if state is not None and state.get("source") else source.state_dict()  # type: ignore[attr-defined]
            self._source_state = dict(base)
            if skip:
                moved = dict(base)
                moved["batches_consumed"] = int(base["batches_consumed"]) + skip
                if moved["batches_consumed"] > len(source):  # type: ignore[arg-type]
                    raise StokerError(f"flow state: {skip} items delivered, but the loader's epoch has fewer batches left")
                source.load_state_dict(moved)  # type: ignore[attr-defined]
            elif state is not None:
                source.load_state_dict(base)  # type: ignore[attr-defined]
            return iter(source), skip
        if skip:
            seq: Any = source
            if skip > len(seq):
                raise StokerError(f"flow state: {skip} items delivered, but the source has only {len(seq)}")
            return map(seq.__getitem__, range(skip, len(seq))), skip
        return iter(source), 0

    def __repr__(self) -> str:
        stages = " -> ".join(f"{n.name}[{n.kind} x{n.conc}]" for n in self._engine.nodes)
        return f"Pipeline({stages} -> sink[{self._engine.sink_cap}], {self._state})"
