"""The scheduler of a flow: nodes, bounded queues, one lock, and the threads that move items.

Every node (the source, each ``pipe`` stage) holds at most ``concurrency`` items
(running, waiting for their turn with ``output_order='input'``, or finished and
waiting for room downstream: its *outbox*); every input queue and the sink have
a bound. An item moves downstream only into room, so memory is bounded whatever
the source's length. One lock guards all of it; three conditions wait on it:
work for the worker threads, room for the source thread, items for the consumer.

Plain functions run on ``num_threads`` worker threads shared by all stages; a
worker takes the most downstream item it may start, so the pipeline drains
before it fills. ``async def`` functions run on an event loop thread, process
and executor stages on their pools: those are launched, not waited for, by
whichever thread made room for them.

Items travel as ``(seq, done, value)``: ``seq`` the position among the items that
entered the stage (ordering, errors), ``done`` the source positions that are
delivered once this item is (resuming): an int, a tuple of them (``aggregate``),
or a :class:`_Shared` countdown (``disaggregate``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from time import perf_counter, perf_counter_ns
from typing import Any

from stoker._threads import start_thread
from stoker.errors import StokerError
from stoker.flow._builder import AggregateSpec, DisaggregateSpec, PipeSpec
from stoker.flow._errors import StageError
from stoker.flow._stats import PipelineStats, _Counters, percentile, snapshot
from stoker.observe import _registry, _report, _trace
from stoker.observe._recorder import MARK_FIXED, ROWS, Component, Recorder

log = logging.getLogger("stoker.flow")

#: tolerated failures kept for :attr:`Pipeline.failures`
_KEEP_FAILURES = 100


class _Shared:
    """Source positions delivered once all ``left`` elements of a disaggregated item are."""

    __slots__ = ("done", "left")

    def __init__(self, done: Any, left: int) -> None:
        self.done, self.left = done, left


class _Aggregate:
    def __init__(self, spec: AggregateSpec) -> None:
        self.n, self.drop_last = spec.num_items, spec.drop_last
        self.values: list[Any] = []
        self.dones: list[Any] = []

    def feed(self, items: list[tuple[Any, Any]], engine: _Engine) -> list[tuple[Any, Any]]:
        out = []
        for done, value in items:
            self.values.append(value)
            self.dones.append(done)
            if len(self.values) == self.n:
                out.append((tuple(self.dones), self.values))
                self.values, self.dones = [], []
        return out

    def flush(self, engine: _Engine) -> list[tuple[Any, Any]]:
        if not self.values:
            return []
        done, values = tuple(self.dones), self.values
        self.values, self.dones = [], []
        if self.drop_last:
            engine._resolve(done)
            return []
        return [(done, values)]


class _Disaggregate:
    def feed(self, items: list[tuple[Any, Any]], engine: _Engine) -> list[tuple[Any, Any]]:
        out: list[tuple[Any, Any]] = []
        for done, value in items:
            try:
                values = list(value)
            except TypeError as exc:
                engine._fatal(StageError("disaggregate", 0, exc))
                continue
            if not values:
                engine._resolve(done)
            elif len(values) == 1:
                out.append((done, values[0]))
            else:
                shared = _Shared(done, len(values))
                out.extend((shared, v) for v in values)
        return out

    def flush(self, engine: _Engine) -> list[tuple[Any, Any]]:
        return []


class _Node:
    """The source (index 0) or a ``pipe`` stage."""

    def __init__(self, index: int, name: str, kind: str, fn: Any, conc: int, ordered: bool, cap: int, pool: Executor | None) -> None:
        self.index, self.name, self.kind, self.fn, self.conc, self.ordered, self.cap = index, name, kind, fn, conc, ordered, cap
        self.pool = pool
        self.inq: deque[tuple[int, Any, Any]] = deque()
        self.running = 0
        self.pending: dict[int, tuple[Any, bool, Any]] = {}
        self.seq_in = 0
        self.seq_out = 0
        self.outbox: deque[tuple[Any, Any]] = deque()
        self.post: list[_Aggregate | _Disaggregate] = []
        self.post_flushed = False
        self.finished = False
        self.c = _Counters()


class _Engine:
    """The running state of one flow. Threads hold this, not the :class:`Pipeline`, so that the
    pipeline can be collected (and stopped) when its user drops it."""

    def __init__(
        self,
        ops: tuple[PipeSpec | AggregateSpec | DisaggregateSpec, ...],
        sink_size: int,
        num_threads: int,
        max_failures: int,
        queue_size: int | None,
    ) -> None:
        self._lock = threading.Lock()
        self._work_cv = threading.Condition(self._lock)
        self._space_cv = threading.Condition(self._lock)
        self._sink_cv = threading.Condition(self._lock)
        self.nodes = [_Node(0, "source", "source", None, 1, False, 0, None)]
        for op in ops:
            if isinstance(op, PipeSpec):
                cap = queue_size if queue_size is not None else max(4, 2 * op.concurrency)
                self.nodes.append(
                    _Node(len(self.nodes), op.name, op.kind, op.fn, op.concurrency, op.output_order == "input", cap, op.executor)
                )
            else:
                self.nodes[-1].post.append(_Aggregate(op) if isinstance(op, AggregateSpec) else _Disaggregate())
        self._thread_nodes = [n for n in reversed(self.nodes) if n.kind == "thread"]
        self._nb_nodes = [n for n in self.nodes if n.kind in ("async", "process", "executor")]
        self._uses_loop = any(n.kind == "async" for n in self.nodes)
        self.sink: deque[tuple[Any, Any]] = deque()
        self.sink_cap = sink_size
        self.sink_c = _Counters()
        self.num_threads = num_threads
        self.max_failures = max_failures
        self.failures: deque[StageError] = deque(maxlen=_KEEP_FAILURES)
        self.n_failures = 0
        self.error: BaseException | None = None
        self.stopping = False
        self.source_done = False
        self.ended = False
        self.idle = 0
        self._source_waiting = False
        self._consumers_waiting = 0
        self.delivered = 0
        self.consumer_wait_s = 0.0
        self.watermark = 0  # source positions below it are delivered (or failed, or dropped)
        self._ahead: set[int] = set()
        self.threads: list[threading.Thread] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: threading.Thread | None = None
        self.t_start: float | None = None
        self.t_stop: float | None = None
        # per-step accounting (stoker.observe): each get() is a step; while the consumer waits, the wait is blamed on
        # the node that holds the next item (the most downstream one with any), and moves with it
        self.recorder = Recorder("flow(" + " -> ".join(n.name for n in self.nodes) + ")", "flow") if _registry.enabled() else None
        self._blame = [0] * len(self.nodes)  # ns of the current wait blamed on each node
        self._blamed: int | None = None
        self._blamed_since = 0
        names = [n.name for n in self.nodes]  # (a name given to two stages: each is told apart by its position)
        self._names = [f"{name} (stage {i})" if names.count(name) > 1 else name for i, name in enumerate(names)]
        if self.recorder is not None:
            self.recorder.configure(
                [Component(self._names[n.index], "source" if n.index == 0 else "stage", "producer") for n in self.nodes], []
            )
            self.recorder.context["concurrency"] = {self._names[n.index]: n.conc for n in self.nodes}
            self.recorder.durations = self._durations
            self.recorder.epoch_base(0, 0)  # (one epoch: a step's batch is the item's position)
            _registry.register(self.recorder)
        self._prof = _trace.profiler()

    # ---- start / stop ------------------------------------------------------------------------
    def start(self, source: Iterator[Any], first_index: int) -> None:
        self.watermark = first_index
        self.t_start = perf_counter()
        for node in self.nodes:
            node.c.occ_t = self.t_start
            if node.kind == "process":
                import multiprocessing

                # spawn: forking a process whose other threads may hold locks is unsafe
                node.pool = ProcessPoolExecutor(max_workers=node.conc, mp_context=multiprocessing.get_context("spawn"))
        self.sink_c.occ_t = self.t_start
        if self._uses_loop:
            self.loop = asyncio.new_event_loop()
            self.loop_thread = start_thread(self.loop.run_forever, name="stoker-flow-loop")
        for i in range(self.num_threads):
            self.threads.append(start_thread(self._work, name=f"stoker-flow-worker-{i}"))
        self.threads.append(start_thread(self._produce, source, first_index, name="stoker-flow-source"))

    def stop(self) -> None:
        """Stop every thread and pool this flow started; wait for them (functions running finish first)."""
        with self._lock:
            self.stopping = True
            self._work_cv.notify_all()
            self._space_cv.notify_all()
            self._sink_cv.notify_all()
        me = threading.current_thread()
        for t in self.threads:
            if t is not me:
                t.join()
        for node in self.nodes:
            if node.kind == "process" and node.pool is not None:
                node.pool.shutdown(wait=True, cancel_futures=True)
        if self.loop is not None and self.loop_thread is not None and self.loop_thread is not me and not self.loop.is_closed():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_cancel_tasks(), self.loop).result(timeout=10.0)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.loop_thread.join()
            self.loop.close()
        if self.t_start is not None and self.t_stop is None:
            self.t_stop = perf_counter()

    # ---- the lock's helpers (each called with the lock held) --------------------------------------
    def _halted(self) -> bool:
        return self.stopping or self.error is not None

    def _fatal(self, err: BaseException) -> None:
        if self.error is None:
            self.error = err
        self._work_cv.notify_all()
        self._space_cv.notify_all()
        self._sink_cv.notify_all()

    def _resolve(self, done: Any) -> None:
        """The source positions in ``done`` are delivered, failed or dropped: advance the watermark."""
        if type(done) is int:
            if done == self.watermark:
                w = done + 1
                ahead = self._ahead
                while ahead and w in ahead:
                    ahead.remove(w)
                    w += 1
                self.watermark = w
            else:
                self._ahead.add(done)
        elif type(done) is tuple:
            for d in done:
                self._resolve(d)
        else:
            done.left -= 1
            if done.left == 0:
                self._resolve(done.done)

    def _emit(self, node: _Node, done: Any, ok: bool, value: Any) -> None:
        if not ok:
            self._resolve(done)
            return
        if not node.post:
            node.outbox.append((done, value))
            return
        items = [(done, value)]
        for op in node.post:
            items = op.feed(items, self)
        node.outbox.extend(items)

    def _flush(self, i: int) -> None:
        """Move node ``i``'s finished items into the next queue, as far as there is room."""
        node = self.nodes[i]
        ob = node.outbox
        if ob:
            now = perf_counter()
            if i + 1 < len(self.nodes):
                dest = self.nodes[i + 1]
                dq = dest.inq
                room = dest.cap - len(dq)
                if room > 0:
                    while ob and room:
                        done, value = ob.popleft()
                        dq.append((dest.seq_in, done, value))
                        dest.seq_in += 1
                        room -= 1
                    dest.c.occupancy(len(dq), now)
            else:
                sink = self.sink
                room = self.sink_cap - len(sink)
                if room > 0:
                    while ob and room:
                        sink.append(ob.popleft())
                        room -= 1
                    self.sink_c.occupancy(len(sink), now)
                    if self._consumers_waiting:
                        self._sink_cv.notify()
            node.c.blocked(bool(ob), now)
            if self._blamed is not None:
                self._reblame()
        if i == 0 and not ob and self._source_waiting and self._room_below_half():
            self._space_cv.notify()  # in bursts: the source wakes when the queue it feeds is half empty

    def _holder(self) -> int:
        """The node that holds the next item the consumer will get: the most downstream one with any (0: the source)."""
        for node in reversed(self.nodes):
            if node.running or node.pending or node.outbox or node.inq:
                return node.index
        return 0

    def _reblame(self) -> None:
        """The consumer waits: charge the time since the last look to the node blamed then, and look again."""
        now = perf_counter_ns()
        if self._blamed is not None:
            self._blame[self._blamed] += now - self._blamed_since
        self._blamed, self._blamed_since = self._holder(), now

    def _durations(self) -> dict[str, tuple[int, float, float, float]]:
        """Per node: (items, mean, p50, p95 [seconds]) of its function's time per item, for the report."""
        with self._lock:
            out = {}
            for n in self.nodes:
                done = n.c.items_out + n.c.failures
                ring = list(n.c.durations)
                out[self._names[n.index]] = (done, n.c.busy_s / done if done else math.nan, percentile(ring, 0.5), percentile(ring, 0.95))
            return out

    def _room_below_half(self) -> bool:
        if len(self.nodes) > 1:
            first = self.nodes[1]
            return len(first.inq) <= first.cap // 2
        return len(self.sink) <= self.sink_cap // 2

    def _pick(self) -> _Node | None:
        if self.stopping or self.error is not None:
            return None
        for node in self._thread_nodes:
            if node.inq and node.running + len(node.pending) + len(node.outbox) < node.conc:
                return node
        return None

    def _take(self, node: _Node) -> tuple[int, Any, Any]:
        item = node.inq.popleft()
        node.running += 1
        node.c.items_in += 1
        node.c.occupancy(len(node.inq), perf_counter())
        self._flush(node.index - 1)
        return item

    def _complete(self, node: _Node, seq: int, done: Any, ok: bool, out: Any, dt: float) -> None:
        node.running -= 1
        c = node.c
        c.duration(dt)
        if ok:
            c.items_out += 1
        else:
            c.failures += 1
            self._failed(node, seq, done, out)
        if node.ordered:
            if seq == node.seq_out:
                self._emit(node, done, ok, out)
                node.seq_out += 1
                pending = node.pending
                while pending and node.seq_out in pending:
                    self._emit(node, *pending.pop(node.seq_out))
                    node.seq_out += 1
            else:
                node.pending[seq] = (done, ok, out)
        else:
            self._emit(node, done, ok, out)
        self._flush(node.index)

    def _failed(self, node: _Node, seq: int, done: Any, exc: BaseException) -> None:
        err = StageError(node.name, seq, exc, source_index=done if type(done) is int else None)
        self.n_failures += 1
        if self.n_failures > self.max_failures or not isinstance(exc, Exception):
            self._fatal(err)
        else:
            self.failures.append(err)
            log.warning("stoker.flow: %s (failure %d of %d tolerated)", err, self.n_failures, self.max_failures)

    def _end(self) -> None:
        """After the source's last item: finish each node whose inputs are all through, in order."""
        nodes = self.nodes
        for i, node in enumerate(nodes):
            if node.finished:
                continue
            if i == 0:
                drained = self.source_done
            else:
                drained = nodes[i - 1].finished and not node.inq and node.running == 0 and not node.pending
            if not drained:
                return
            if not node.post_flushed:
                node.post_flushed = True
                items: list[tuple[Any, Any]] = []
                for op in node.post:
                    items = op.feed(items, self)
                    items.extend(op.flush(self))
                node.outbox.extend(items)
                self._flush(i)
            if node.outbox:
                return
            node.finished = True
        if not self.ended:
            self.ended = True
            self._sink_cv.notify_all()

    def _settle(self) -> list[tuple[_Node, int, Any, Any]]:
        """End of a locked section: propagate the end, wake a worker if there is work, take launches."""
        if self.source_done and not self.ended:
            self._end()
        launches: list[tuple[_Node, int, Any, Any]] = []
        if self._nb_nodes and not self._halted():
            for node in self._nb_nodes:
                while node.inq and node.running + len(node.pending) + len(node.outbox) < node.conc:
                    seq, done, value = self._take(node)
                    launches.append((node, seq, done, value))
        if self.idle and self._pick() is not None:
            self._work_cv.notify()
        return launches

    # ---- threads --------------------------------------------------------------------------------
    def _work(self) -> None:
        """A worker thread: finish the last item and take the next in one locked section."""
        job: tuple[_Node, int, Any, bool, Any, float] | None = None
        while True:
            with self._lock:
                if job is not None:
                    self._complete(*job)
                    job = None
                node = self._pick()
                if node is not None:
                    seq, done, value = self._take(node)
                launches = self._settle()
                if node is None and not launches:
                    if self.stopping:
                        return
                    self.idle += 1
                    self._work_cv.wait()
                    self.idle -= 1
                    continue
            if launches:
                self._launch(launches)
            if node is None:
                continue
            t0 = perf_counter()
            try:
                if self._prof is not None and self._prof._is_profiler_enabled:
                    with self._prof.record_function(f"stoker.flow: {node.name}"):
                        out, ok = node.fn(value), True
                else:
                    out, ok = node.fn(value), True
            except BaseException as exc:  # every failure crosses to the consumer as a value
                out, ok = exc, False
            t1 = perf_counter()
            job = (node, seq, done, ok, out, t1 - t0)
            if _trace._SESSIONS and self.recorder is not None:
                _trace.add_stage_span(self.recorder, node.name, int(t0 * 1e9), int(t1 * 1e9))
            value = out = None  # the job holds them until it is completed: an idle worker keeps no item alive

    def _produce(self, source: Iterator[Any], index: int) -> None:
        """The source thread: one item at a time into the first queue, waiting for room."""
        node, c = self.nodes[0], self.nodes[0].c
        first = index
        try:
            while True:
                t0 = perf_counter()
                try:
                    value = next(source)
                except StopIteration:
                    break
                except BaseException as exc:
                    with self._lock:
                        self._fatal(StageError("source", index - first, exc, source_index=index))
                    return
                dt = perf_counter() - t0
                with self._lock:
                    if self._halted():
                        return
                    c.items_in += 1
                    c.items_out += 1
                    c.duration(dt)
                    self._emit(node, index, True, value)
                    self._flush(0)
                    launches = self._settle()
                if launches:
                    self._launch(launches)
                index += 1
                with self._lock:
                    while node.outbox and not self._halted():
                        self._source_waiting = True
                        self._space_cv.wait()
                        self._source_waiting = False
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()
            with self._lock:
                self.source_done = True
                launches = self._settle()
            if launches:
                self._launch(launches)

    # ---- async and pool stages ------------------------------------------------------------------
    def _launch(self, launches: list[tuple[_Node, int, Any, Any]]) -> None:
        for node, seq, done, value in launches:
            t0 = perf_counter()
            try:
                if node.kind == "async":
                    assert self.loop is not None  # noqa: S101 - created at start when a stage is async
                    self.loop.call_soon_threadsafe(self._start_task, node, seq, done, value, t0)
                else:
                    assert node.pool is not None  # noqa: S101
                    future = node.pool.submit(node.fn, value)
                    future.add_done_callback(functools.partial(self._on_done, node, seq, done, t0))
            except BaseException as exc:  # a pool shut down, a loop closed: the item fails
                self._finish(node, seq, done, t0, exc)

    def _start_task(self, node: _Node, seq: int, done: Any, value: Any, t0: float) -> None:
        """On the event loop: the coroutine is created here, so that it is awaited or never exists."""
        if self.stopping:
            self._finish(node, seq, done, t0, asyncio.CancelledError())
            return
        try:
            task = asyncio.ensure_future(node.fn(value))
        except BaseException as exc:
            self._finish(node, seq, done, t0, exc)
            return
        task.add_done_callback(functools.partial(self._on_done, node, seq, done, t0))

    def _on_done(self, node: _Node, seq: int, done: Any, t0: float, future: Any) -> None:
        if future.cancelled():
            self._finish(node, seq, done, t0, asyncio.CancelledError())
            return
        exc = future.exception()
        self._finish(node, seq, done, t0, exc, None if exc is not None else future.result())

    def _finish(self, node: _Node, seq: int, done: Any, t0: float, exc: BaseException | None, out: Any = None) -> None:
        dt = perf_counter() - t0
        with self._lock:
            if exc is not None and self.stopping:
                node.running -= 1  # cancelled by stop(): not a failure of the item
                node.c.items_in -= 1
                return
            self._complete(node, seq, done, exc is None, out if exc is None else exc, dt)
            launches = self._settle()
        if launches:
            self._launch(launches)

    # ---- the consumer -------------------------------------------------------------------------------
    def get(self, timeout: float | None) -> Any:
        t_enter = perf_counter_ns()
        with self._lock:
            waited_from: float | None = None
            try:
                while True:
                    if self.error is not None:
                        raise self.error
                    if self.sink:
                        break
                    if self.ended:
                        raise EOFError("the flow has delivered every item")
                    if self.stopping:
                        raise StokerError("the flow was stopped; build a new one to run it again")
                    now = perf_counter()
                    if waited_from is None:
                        waited_from = now
                        if self.recorder is not None:
                            self._reblame()
                    remaining = None if timeout is None else timeout - (now - waited_from)
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"no item within {timeout} s")
                    self._consumers_waiting += 1
                    try:
                        self._sink_cv.wait(remaining)
                    finally:
                        self._consumers_waiting -= 1
            finally:
                if waited_from is not None:
                    self.consumer_wait_s += perf_counter() - waited_from
                if self._blamed is not None:
                    self._reblame()
                    self._blamed = None
            done, value = self.sink.popleft()
            self.sink_c.items_in += 1
            self.sink_c.items_out += 1
            self.sink_c.occupancy(len(self.sink), perf_counter())
            self._resolve(done)
            self.delivered += 1
            self._flush(len(self.nodes) - 1)
            launches = self._settle()
            rec = self.recorder
            if rec is not None:  # the step: its wait, blamed per node (in the mark ring's columns)
                row = rec.count % ROWS
                marks, blame = rec.marks[row], self._blame
                marks[:MARK_FIXED] = 0
                for k in range(len(blame)):
                    marks[MARK_FIXED + k] = blame[k]
                    blame[k] = 0
                t_exit = perf_counter_ns()
                rec.step(row * rec.width, t_enter, t_exit, t_exit, 0, 0)
        if launches:
            self._launch(launches)
        return value

    def stats(self) -> PipelineStats:
        with self._lock:
            now = perf_counter()
            start = self.t_start if self.t_start is not None else now
            end = self.t_stop if self.t_stop is not None else now
            elapsed = end - start
            stages = [snapshot(n.name, n.kind, n.conc, n.c, len(n.inq), n.cap, elapsed, end) for n in self.nodes]
            stages.append(snapshot("sink", "sink", 1, self.sink_c, len(self.sink), self.sink_cap, elapsed, end))
            delivered, waited = self.delivered, self.consumer_wait_s
        accounting = _report.summarize(self.recorder) if self.recorder is not None else {}  # (takes the lock itself)
        return PipelineStats(elapsed, delivered, waited, tuple(stages), accounting)

    def occupancy(self) -> dict[str, tuple[int, int]]:
        """Now, per stage: (items in its input queue, items it holds); for the sink: (queued, 0)."""
        with self._lock:
            out = {n.name: (len(n.inq), n.running + len(n.pending) + len(n.outbox)) for n in self.nodes}
            out["sink"] = (len(self.sink), 0)
            return out


async def _cancel_tasks() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def run_reporter(stats: Callable[[], PipelineStats], interval: float, stop: threading.Event, report: Callable[[str], None]) -> None:
    """The reporting thread: ``report(stats().report())`` every ``interval`` seconds until ``stop`` is set."""
    while not stop.wait(interval):
        with contextlib.suppress(Exception):
            report(stats().report())
