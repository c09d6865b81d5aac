"""Configuring a flow: :class:`PipelineBuilder` and the frozen descriptions of its stages."""

from __future__ import annotations

import functools
import inspect
import pickle
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal

from stoker.errors import StokerError

OutputOrder = Literal["completion", "input"]


def _is_async(fn: Any) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


def _default_name(fn: Any) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return str(getattr(fn, "__name__", None) or type(fn).__name__)


@dataclass(frozen=True)
class PipeSpec:
    """A ``pipe`` stage: a function applied to each item, ``concurrency`` items at a time.

    Attributes:
        fn: the function (plain or ``async def``).
        concurrency: items in flight at once in this stage.
        name: the stage's name in errors and statistics.
        output_order: ``'completion'`` (as items finish) or ``'input'`` (as they arrived).
        kind: ``'thread'`` (the pipeline's threads), ``'async'`` (its event loop),
            ``'process'`` (a process pool the pipeline owns) or ``'executor'`` (yours).
        executor: the executor of kind ``'executor'``.
    """

    fn: Callable[[Any], Any]
    concurrency: int
    name: str
    output_order: OutputOrder
    kind: str
    executor: Executor | None = None

    def __post_init__(self) -> None:
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ValueError(f"concurrency must be an int >= 1; got {self.concurrency!r}")
        if self.output_order not in ("completion", "input"):
            raise ValueError(f"output_order must be 'completion' or 'input'; got {self.output_order!r}")
        if not callable(self.fn):
            raise TypeError(f"pipe() needs a callable; got {type(self.fn).__name__}")


@dataclass(frozen=True)
class AggregateSpec:
    """Group ``num_items`` consecutive items into a list; the last, shorter list is kept unless ``drop_last``."""

    num_items: int
    drop_last: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.num_items, bool) or not isinstance(self.num_items, int) or self.num_items < 1:
            raise ValueError(f"aggregate() needs num_items >= 1; got {self.num_items!r}")


@dataclass(frozen=True)
class DisaggregateSpec:
    """Split each item (an iterable) into its elements."""


class PipelineBuilder:
    """Describe a flow: a source, stages, a sink; then :meth:`build` it.

    The shape is SPDL's ``PipelineBuilder``: code written for ``spdl.pipeline``
    runs with the import changed.

    Example:
        >>> from stoker.flow import PipelineBuilder
        >>> pipeline = (
        ...     PipelineBuilder()
        ...     .add_source(range(6))
        ...     .pipe(lambda x: 2 * x, concurrency=2, output_order="input")
        ...     .aggregate(4)
        ...     .add_sink(2)
        ...     .build(num_threads=2)
        ... )
        >>> with pipeline.auto_stop():
        ...     print(list(pipeline))
        [[0, 2, 4, 6], [8, 10]]
    """

    def __init__(self) -> None:
        self._source: Iterable[Any] | None = None
        self._ops: list[PipeSpec | AggregateSpec | DisaggregateSpec] = []
        self._sink: int | None = None

    def add_source(self, source: Iterable[Any]) -> PipelineBuilder:
        """Set the iterable whose items enter the flow (read on a thread of its own).

        A sequence (``len`` and indexing) or a :class:`~stoker.loader.Loader` makes the
        flow resumable (:meth:`Pipeline.state_dict`).

        Raises:
            StokerError: a source was already set.
            TypeError: ``source`` is not iterable.
        """
        if self._source is not None:
            raise StokerError("add_source() was already called: a flow has one source")
        if not hasattr(source, "__iter__"):
            raise TypeError(f"add_source() needs an iterable; got {type(source).__name__}")
        self._source = source
        return self

    def pipe(
        self,
        fn: Callable[[Any], Any],
        *,
        concurrency: int = 1,
        name: str | None = None,
        output_order: OutputOrder = "completion",
        executor: Executor | Literal["process"] | None = None,
    ) -> PipelineBuilder:
        """Apply ``fn`` to every item.

        Args:
            fn: a function of one item. A plain function runs on the pipeline's
                threads (functions that release the GIL, such as :mod:`stoker.io`'s,
                run in parallel); an ``async def`` function runs on the pipeline's
                event loop.
            concurrency: items this stage works on at once.
            name: the stage's name in errors and statistics (default: the function's).
            output_order: ``'completion'`` passes items on as they finish;
                ``'input'`` keeps the order in which they arrived.
            executor: ``'process'`` runs ``fn`` in a pool of ``concurrency`` processes
                that the pipeline starts and stops (for functions that hold the GIL;
                ``fn`` and the items must pickle); an ``Executor`` of yours runs it
                there (you shut it down).

        Raises:
            ValueError: an invalid ``concurrency`` or ``output_order``.
            TypeError: ``fn`` is not callable, or is async with an executor, or does not pickle with ``'process'``.
        """
        is_async = _is_async(fn)
        if executor is None:
            kind = "async" if is_async else "thread"
            pool = None
        elif is_async:
            raise TypeError(f"pipe({_default_name(fn)}): an async function runs on the event loop; it takes no executor")
        elif executor == "process":
            kind, pool = "process", None
            try:
                pickle.dumps(fn)
            except Exception as exc:
                raise TypeError(
                    f"pipe({_default_name(fn)}, executor='process'): the function must pickle to run in another process "
                    f"(define it at module level; no lambda or closure): {exc}"
                ) from exc
        elif isinstance(executor, Executor):
            kind, pool = "executor", executor
        else:
            raise TypeError(f"executor must be None, 'process' or a concurrent.futures.Executor; got {executor!r}")
        self._ops.append(PipeSpec(fn, concurrency, name or _default_name(fn), output_order, kind, pool))
        return self

    def aggregate(self, num_items: int, /, *, drop_last: bool = False) -> PipelineBuilder:
        """Group ``num_items`` consecutive items into a list (the last one shorter unless ``drop_last``)."""
        self._ops.append(AggregateSpec(num_items, drop_last))
        return self

    def disaggregate(self) -> PipelineBuilder:
        """Split each item (an iterable, such as a list from :meth:`aggregate`) into its elements."""
        self._ops.append(DisaggregateSpec())
        return self

    def add_sink(self, buffer_size: int = 3) -> PipelineBuilder:
        """Set the bound of the queue that holds finished items for the consumer [items].

        Raises:
            ValueError: ``buffer_size`` < 1.
        """
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"add_sink() needs buffer_size >= 1; got {buffer_size!r}")
        self._sink = buffer_size
        return self

    def build(
        self,
        *,
        num_threads: int | None = None,
        max_failures: int = 0,
        queue_size: int | None = None,
        report_interval: float | None = None,
        report_at_end: bool = False,
        report: Callable[[str], None] | None = None,
    ) -> Any:
        """Build the :class:`~stoker.flow.Pipeline`; nothing runs (no thread) until it starts.

        Args:
            num_threads: threads that run the plain functions of every stage (default:
                the sum of those stages' concurrency).
            max_failures: items whose function may raise before the flow stops with a
                :class:`~stoker.flow.StageError`; failed items are dropped and counted.
            queue_size: the bound of each stage's input queue [items] (default:
                ``max(4, 2 * concurrency)``): memory does not grow with the source.
            report_interval: print the statistics every this many seconds while running.
            report_at_end: print them when the pipeline stops.
            report: where reports go (default: standard error).

        Raises:
            StokerError: no source or no sink.
            ValueError: invalid numbers.
        """
        from stoker.flow._pipeline import Pipeline

        if self._source is None:
            raise StokerError("build(): the flow has no source; call add_source(iterable) first")
        if self._sink is None:
            raise StokerError("build(): the flow has no sink; call add_sink(buffer_size) last")
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"num_threads must be an int >= 1 or None; got {num_threads!r}")
        if isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < 0:
            raise ValueError(f"max_failures must be an int >= 0; got {max_failures!r}")
        if queue_size is not None and (isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1):
            raise ValueError(f"queue_size must be an int >= 1 or None; got {queue_size!r}")
        if report_interval is not None and not report_interval > 0:
            raise ValueError(f"report_interval must be > 0 [seconds] or None; got {report_interval!r}")
        thread_conc = sum(op.concurrency for op in self._ops if isinstance(op, PipeSpec) and op.kind == "thread")
        threads = num_threads if num_threads is not None else max(1, thread_conc)
        if thread_conc == 0:
            threads = 0
        return Pipeline(
            self._source,
            tuple(self._ops),
            sink_size=self._sink,
            num_threads=threads,
            max_failures=max_failures,
            queue_size=queue_size,
            report_interval=report_interval,
            report_at_end=report_at_end,
            report=report,
        )
