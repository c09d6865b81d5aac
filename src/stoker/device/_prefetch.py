""":func:`prefetch`: copy the next batches to the GPU on a stream of their own while the loop works on this one.

Lifecycle of one batch on CUDA::

    source ──next()──> issue: on the side stream, to_device(batch) ──> event recorded
                       (batches k+1..k+depth wait in a deque)
    your loop <──────  hand out batch k: your stream waits for its event (on the GPU, the
                       host does not block); the memory prefetch allocated for it records your
                       stream, so PyTorch's allocator does not reuse it before your work is done

No thread: the source is advanced in your loop's thread, inside ``next()``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from stoker.device._transfer import move, resolve_device


class _End:
    """The source is exhausted (a sentinel in the deque: ``None`` could be a batch)."""


_END = _End()


class _Failure:
    """The source (or the copy) raised: re-raised when the loop reaches this position."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class _SyncTransfer:
    """CPU and devices without streams: the batch is moved when it is handed out (no look-ahead)."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def issue(self, batch: Any) -> Any:
        return batch

    def deliver(self, item: Any) -> Any:
        moved, _ = move(item, self.device, non_blocking=False)
        return moved


class _CudaTransfer:
    """Copies on a CUDA stream of its own; hands batches over with events and ``record_stream``."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def issue(self, batch: Any) -> tuple[Any, list[Any], Any]:
        """Queue the batch's copies on the side stream; returns (the batch on the device, the memory allocated, the event)."""
        torch = self.torch
        with torch.cuda.stream(self.stream):
            moved, created = move(batch, self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return moved, created, ready

    def deliver(self, item: tuple[Any, list[Any], Any]) -> Any:
        """Make the caller's current stream wait for the copies, and tie the memory to that stream."""
        moved, created, ready = item
        consumer = self.torch.cuda.current_stream(self.device)
        consumer.wait_event(ready)
        for t in created:
            # allocated on the side stream, used on the consumer's: when the caller frees it, the allocator
            # must wait for the work the consumer's stream has queued on it before giving it to the side stream
            t.record_stream(consumer)
        return moved


class PrefetchIterator(Iterator[Any]):
    """One pass over the source, ``depth`` batches ahead; see :func:`prefetch`.

    Batches come in the source's order. An exception raised by the source (or
    by a copy) is raised by the ``next()`` that reaches its position, after
    every batch before it; the iterator is then finished. Breaking out of the
    loop, deleting the iterator, :meth:`close` or leaving a ``with`` block
    closes the source iterator (if it has ``close()``, as generators and
    the Loader's iterators do) and drops the batches copied ahead.
    """

    def __init__(self, source: Iterator[Any], transfer: Any, depth: int) -> None:
        self._source: Iterator[Any] | None = source
        self._transfer = transfer
        self._depth = depth
        self._ahead: deque[Any] = deque()
        self._exhausted = False
        self._closed = False

    def __iter__(self) -> PrefetchIterator:
        return self

    def _pull(self, n: int) -> None:
        """Issue batches from the source until ``n`` are ahead (or the source ends or fails)."""
        while len(self._ahead) < n and not self._exhausted:
            source = self._source
            if source is None:
                self._exhausted = True
                break
            try:
                batch = next(source)
            except StopIteration:
                self._ahead.append(_END)
                self._exhausted = True
                break
            except Exception as exc:
                self._ahead.append(_Failure(exc))
                self._exhausted = True
                break
            try:
                self._ahead.append(self._transfer.issue(batch))
            except Exception as exc:
                self._ahead.append(_Failure(exc))
                self._exhausted = True
            del batch  # hold no reference to the source's batch: a Loader may then reuse its memory

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        try:
            self._pull(1)
            item = self._ahead.popleft() if self._ahead else _END
            if isinstance(item, _End):
                self.close()
                raise StopIteration
            if isinstance(item, _Failure):
                self.close()
                raise item.error
            out = self._transfer.deliver(item)
            del item
            self._pull(self._depth)  # batches k+1..k+depth are copied while the caller works on batch k
            return out
        except (StopIteration, Exception):
            raise
        except BaseException:  # KeyboardInterrupt and the like: stop the source, as the Loader does
            self.close()
            raise

    def close(self) -> None:
        """Drop the batches copied ahead and close the source iterator (safe to call any number of times)."""
        if self._closed:
            return
        self._closed = True
        self._ahead.clear()
        source, self._source = self._source, None
        close = getattr(source, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> PrefetchIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # a finalizer must not raise
            self.close()


class Prefetcher(Iterable[Any]):
    """An iterable over ``source``'s batches on ``device``, copied ``depth`` batches ahead; see :func:`prefetch`.

    Each ``iter()`` (each ``for`` loop) is one pass over ``iter(source)``: a
    Loader or a DataLoader gives one epoch per pass, as it would without
    ``prefetch``; a generator can be gone through once.
    """

    def __init__(self, source: Iterable[Any], device: Any, depth: int = 2) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1 (batches copied ahead); got {depth!r}")
        if not isinstance(source, Iterable):
            raise TypeError(f"prefetch needs an iterable of batches (a Loader, a DataLoader, a generator); got {type(source).__name__}")
        self.source = source
        self.device = device
        self.depth = depth
        # the pass in progress, for close(); weak, so that a loop left with break ends its pass (and closes the
        # source's iterator) as soon as the loop drops it, as it would without prefetch
        self._active: weakref.ref[PrefetchIterator] | None = None

    def __iter__(self) -> PrefetchIterator:
        device = resolve_device(self.device)
        if device.type == "cuda":
            transfer: Any = _CudaTransfer(device)
            depth = self.depth
        else:
            transfer, depth = _SyncTransfer(device), 0
        it = PrefetchIterator(iter(self.source), transfer, depth)
        self._active = weakref.ref(it)
        return it

    def __len__(self) -> int:
        """The source's length (``TypeError`` if it has none)."""
        return len(self.source)  # type: ignore[arg-type]

    def close(self) -> None:
        """Close the pass in progress, if any."""
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        self._active = None

    def __repr__(self) -> str:
        return f"prefetch({self.source!r}, device={str(self.device)!r}, depth={self.depth})"


def prefetch(source: Iterable[Any], device: Any, depth: int = 2) -> Prefetcher:
    """Iterate over ``source``'s batches on ``device``, the next ``depth`` already copying while you use one.

    On CUDA, a stream of its own copies batches k+1..k+depth (with
    :func:`~stoker.device.to_device`: nested structures, small tensors
    coalesced, pageable memory staged through page-locked buffers) while your
    loop works on batch k. Handing batch k over costs no host
    synchronisation: your current stream waits for an event of its copies,
    and the device memory they filled records your stream
    (``Tensor.record_stream``), so that PyTorch's allocator never gives it to
    another copy before the work you queued on it is done. The page-locked
    buffers the copies read stay referenced until an event says the copy has
    read them.

    On the CPU (and devices without CUDA streams) it is a pass-through: each
    batch goes through ``to_device`` when it is handed out (on the CPU: the
    batch itself when its tensors are already there), nothing is read ahead.

    Batches come in order. An error of the source reaches your loop at the
    position it happened, after every batch before it; breaking out of the
    loop (or deleting the iterator, ``close()``) closes the source's iterator
    and drops the batches copied ahead, as the Loader stops its threads.

    Args:
        source: any iterable of batches: a :class:`stoker.Loader` (with
            ``named=True`` it yields dicts), a ``torch.utils.data.DataLoader``,
            a generator.
        device: where the batches go (``'cuda'``, ``'cuda:1'``, a ``torch.device``, ``'cpu'``).
        depth: batches copied ahead (CUDA).

    Returns:
        An iterable; each ``for`` loop over it is one pass over ``source``.

    Raises:
        ValueError: ``depth`` is not an int >= 1.
        TypeError: ``source`` is not iterable.

    Example:
        >>> batches = ({"x": torch.full((2,), float(i))} for i in range(3))  # doctest: +SKIP
        >>> for batch in prefetch(batches, "cuda"):  # doctest: +SKIP
        ...     loss = model(batch["x"]).sum()
    """
    return Prefetcher(source, device, depth)
