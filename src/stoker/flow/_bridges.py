"""Bridges between a flow and the rest of stoker: a :class:`~stoker.loader.Loader` as a source, feeding a
:class:`~stoker.writer.DatasetWriter`.

A Loader as a source: ``add_source(loader)`` iterates one epoch of it, and makes the flow
resumable (see :meth:`Pipeline.state_dict`); :func:`declare_held` tells the loader how many
of its batches the flow's bounded queues and stages may hold, so that it sizes its memory
for them instead of warning (:class:`~stoker.loader.HeldBatchesWarning`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

from stoker.errors import SampleError, StokerError
from stoker.flow._engine import _Aggregate, _Engine


class _InOrder:
    """``dataset[i]`` for ``i = 0, 1, ..., n - 1`` in that order, taken from ``flow``.

    The flow is iterated (a pipeline not started: started) at the first item asked for, so that
    a writer that fails before it starts nothing that :meth:`close` could not stop. What
    ``dataset[i]`` raises (the flow's own error, a :class:`~stoker.flow.StageError`, or a count
    other than ``n``) is kept in :attr:`failure`: the writer reports it as a failed sample, and
    :func:`write_dataset` hands it to its caller as it is.
    """

    def __init__(self, flow: Iterable[Any], n: int) -> None:
        self._flow, self._n, self._next = flow, n, 0
        self._items: Iterator[Any] | None = None
        self.failure: Exception | None = None

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> Any:
        try:
            return self._take(i)
        except Exception as exc:
            self.failure = exc
            raise

    def _take(self, i: int) -> Any:
        if i != self._next:
            raise StokerError(f"a flow is read in order: asked for item {i}, the next one is {self._next}")
        try:
            item = next(self._iterator())
        except StopIteration:
            raise StokerError(f"the flow ended after {i} items; num_items said {self._n}") from None
        self._next += 1
        if self._next == self._n:
            self.check_ended()
        return item

    def check_ended(self) -> None:
        """The flow has no item after the ``n`` read (for ``n = 0``, which the writer asks no item of: none at all).

        Raises:
            StokerError: it has another.
        """
        if next(self._iterator(), _NONE) is not _NONE:
            raise StokerError(f"the flow yields more than num_items={self._n} items")

    def _iterator(self) -> Iterator[Any]:
        if self._items is None:
            self._items = iter(self._flow)
        return self._items

    def close(self) -> None:
        """Stop the flow's iterator (a pipeline started by it stops), if one was made."""
        close = getattr(self._items, "close", None)
        if close is not None:
            close()


_NONE = object()  # sentinel: no item


def source_items_held(engine: _Engine) -> int:
    """The most source items ``engine``'s flow keeps alive at once, besides the one its consumer's loop uses.

    An upper bound, counting every place an item can wait as if it kept its source
    items alive (a function may return a view of its input): the source thread's
    last item (still referenced while it reads the next), each stage's input queue
    (its bound) and ``concurrency`` items (running, reordering or waiting for room),
    the items an ``aggregate`` is filling, the sink, and the consumer's item. After
    ``aggregate(n)`` an item holds ``n`` times as many source items; after
    ``disaggregate()`` each element may hold all of its parent's. (Every place is
    a bounded FIFO, so a held item is also a recent one, which is what a ring of
    batch slots needs: an idle worker thread keeps no item.)
    """
    factor = 1  # source items one item may keep alive, at this point of the flow
    held = 1  # the source thread's last item
    for node in engine.nodes:
        if node.index > 0:
            held += node.cap * factor  # its input queue
        widest = factor
        for op in node.post:
            if isinstance(op, _Aggregate):
                held += (op.n - 1) * factor  # a partial list
                factor *= op.n
            widest = max(widest, factor)
        held += node.conc * widest  # running, reordering or waiting for room (outputs keep at most their inputs' items)
    held += (engine.sink_cap + 1) * factor  # the sink, and the item the consumer holds
    return held - 1  # the batch the consumer's loop uses is the loader's own to count


def declare_held(source: Any, engine: _Engine) -> None:
    """Tell a source with ``expect_held`` (a :class:`~stoker.loader.Loader`) how many of its batches the flow may hold."""
    expect_held = getattr(source, "expect_held", None)
    if callable(expect_held):
        expect_held(source_items_held(engine))


def write_dataset(flow: Iterable[Any], writer: Any, num_items: int) -> None:
    """Write the items of ``flow`` (a :class:`~stoker.flow.Pipeline` or any iterable) with ``writer``.

    Each item is a sample: a tuple of values in the writer's field order (or one
    value for one field). Items are encoded in this thread as they arrive, so the
    flow's stages (reading, decoding, resizing) run while the file is written; the
    flow is started and stopped here if it is a pipeline that was not started.
    Whatever it raises, nothing is left at the destination.

    Args:
        flow: the items, exactly ``num_items`` of them.
        writer: a :class:`~stoker.writer.DatasetWriter` (used with one worker: the items
            come in order from one iterator).
        num_items: how many items the flow yields (the file's layout needs it first).

    Raises:
        StokerError: the flow yields another number of items than ``num_items``.
        StageError: a stage of the flow failed: the flow's own error, as it is (so is
            any other exception the flow's iterator raises).
        SampleError: an item does not fit the fields.

    Example:
        >>> from stoker.flow import PipelineBuilder, write_dataset  # doctest: +SKIP
        >>> flow = PipelineBuilder().add_source(paths).pipe(load, concurrency=4, output_order="input").add_sink(8).build()  # doctest: +SKIP
        >>> write_dataset(flow, DatasetWriter("out.stoker", fields), len(paths))  # doctest: +SKIP
    """
    if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 0:
        raise ValueError(f"num_items must be an int >= 0; got {num_items!r}")
    sequential = copy.copy(writer)
    sequential.num_workers = 1
    source = _InOrder(flow, num_items)
    failure: Exception | None = None
    try:
        if num_items == 0:
            source.check_ended()  # (the writer asks for no item)
        sequential.from_indexed_dataset(source, chunksize=64)
    except SampleError as exc:
        if source.failure is None or exc.__cause__ is not source.failure:
            raise  # an item that does not fit the fields
        failure = source.failure  # the writer's "sample i: dataset[i] raised ..." about the flow's error: that error, below
    finally:
        source.close()
    if failure is not None:
        raise failure  # (outside the handler: not shown as raised while handling the SampleError)
