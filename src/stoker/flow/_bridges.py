"""Bridges between a flow and the rest of stoker: feeding a :class:`~stoker.writer.DatasetWriter`.

(A :class:`~stoker.loader.Loader` needs no bridge to be a source: ``add_source(loader)``
iterates one epoch of it, and makes the flow resumable; see :meth:`Pipeline.state_dict`.)
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

from stoker.errors import StokerError


class _InOrder:
    """``dataset[i]`` for ``i = 0, 1, ..., n - 1`` in that order, taken from an iterator."""

    def __init__(self, items: Iterator[Any], n: int) -> None:
        self._items, self._n, self._next = items, n, 0

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> Any:
        if i != self._next:
            raise StokerError(f"a flow is read in order: asked for item {i}, the next one is {self._next}")
        try:
            item = next(self._items)
        except StopIteration:
            raise StokerError(f"the flow ended after {i} items; num_items said {self._n}") from None
        self._next += 1
        if self._next == self._n:
            extra = next(self._items, _NONE)
            if extra is not _NONE:
                raise StokerError(f"the flow yields more than num_items={self._n} items")
        return item


_NONE = object()  # sentinel: no item


def write_dataset(flow: Iterable[Any], writer: Any, num_items: int) -> None:
    """Write the items of ``flow`` (a :class:`~stoker.flow.Pipeline` or any iterable) with ``writer``.

    Each item is a sample: a tuple of values in the writer's field order (or one
    value for one field). Items are encoded in this thread as they arrive, so the
    flow's stages (reading, decoding, resizing) run while the file is written; the
    flow is started and stopped here if it is a pipeline that was not started.

    Args:
        flow: the items, exactly ``num_items`` of them.
        writer: a :class:`~stoker.writer.DatasetWriter` (used with one worker: the items
            come in order from one iterator).
        num_items: how many items the flow yields (the file's layout needs it first).

    Raises:
        StokerError: the flow yields another number of items (nothing is left at the
            destination), or a stage failed (:class:`~stoker.flow.StageError`).
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
    items = iter(flow)
    try:
        sequential.from_indexed_dataset(_InOrder(items, num_items), chunksize=64)
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()
