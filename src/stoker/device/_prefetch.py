""":func:`prefetch`: copy the next batches to the GPU on a stream of their own while the loop works on this one.

Lifecycle of one batch on CUDA (the transfer is :class:`~stoker.device._stream.StreamTransfer`,
the Loader's too)::

    source ──next()──> issue into the next slot: on the transfer's stream, to_device(batch)
                       ──> the slot's event recorded (batches k+1..k+depth wait in a deque)
    your loop <──────  hand out batch k: your stream waits for its event (on the GPU, the
                       host does not block); the memory prefetch allocated for it records your
                       stream, so PyTorch's allocator does not reuse it before your work is done

The same look-ahead runs for every device (on the CPU the "copy" is ``to_device``, done
when the batch is read), so what a CPU run shows about resuming and held batches is what
a CUDA run does. No thread: the source is advanced in your loop's thread, inside ``next()``.

Resuming: the source has handed out the batches read ahead, the loop has not received
them; :meth:`Prefetcher.state_dict` asks the source for its state as if they had not
been handed out (``source.state_dict(unseen=k)``), so that a resume yields them again.
"""

from __future__ import annotations

import inspect
import operator
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from stoker.device._stream import StreamTransfer, issuing
from stoker.device._transfer import move, move_held, resolve_device
from stoker.errors import StokerError


class _End:
    """The source is exhausted (a sentinel in the deque: ``None`` could be a batch)."""


_END = _End()


class _Failure:
    """The source (or the copy) raised: re-raised when the loop reaches this position."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class _Unseen:
    """Batches the source handed out in one pass that the loop has not received (read ahead, or lost with a failed copy).

    Shared by a pass and its :class:`Prefetcher`, which keeps it after the pass is dropped
    (a loop left with ``break``): the count still says how far the source ran ahead.
    """

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class _SyncTransfer:
    """CPU and devices without streams: the batch is moved (``to_device``, blocking) when it is read ahead."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def issue(self, batch: Any) -> Any:
        moved, _ = move(batch, self.device, non_blocking=False)
        return moved

    def deliver(self, item: Any) -> Any:
        return item


class _CudaTransfer:
    """Copies on the transfer's own CUDA stream (:class:`~stoker.device._stream.StreamTransfer`), a slot per batch in flight.

    A batch read ahead takes the next of ``depth + 2`` slots (the batches ahead,
    the one the loop uses, and the one it used before): the slot keeps the
    page-locked staging buffers its copies read until the slot comes round
    again, by when its event has long completed (the host waits only if not).
    The device memory is PyTorch's allocator's, fresh for each batch: it needs
    no marks, and records the consumer's stream when handed over.
    """

    def __init__(self, device: Any, depth: int) -> None:
        self.device = device
        self.transfer = StreamTransfer(device, depth + 2)
        self._next = 0

    def issue(self, batch: Any) -> tuple[Any, list[Any], int]:
        """Queue the batch's copies on the transfer's stream; returns (the batch on the device, the memory allocated, its slot)."""
        transfer = self.transfer
        slot = self._next
        self._next = (slot + 1) % transfer.num_slots
        transfer.reuse(slot)
        transfer.release(slot, marks=False)
        created: list[Any] = []
        held: list[Any] = []
        with issuing(transfer, slot, created, held):
            moved, new, host = move_held(batch, self.device, non_blocking=True)
            created += new
            held += host
        return moved, created, slot

    def deliver(self, item: tuple[Any, list[Any], int]) -> Any:
        """Make the caller's current stream wait for the copies, and tie the memory to that stream."""
        moved, created, slot = item
        # allocated on the transfer's stream, used on the consumer's: when the caller frees it, the allocator must
        # wait for the work the consumer's stream has queued on it before giving it to the transfer's stream
        self.transfer.hand_over(slot, created)
        return moved


class PrefetchIterator(Iterator[Any]):
    """One pass over the source, ``depth`` batches ahead; see :func:`prefetch`.

    Batches come in the source's order. An exception raised by the source (or
    by a copy) is raised by the ``next()`` that reaches its position, after
    every batch before it; the iterator is then finished. Breaking out of the
    loop, deleting the iterator, :meth:`close` or leaving a ``with`` block
    closes the source iterator (if it has ``close()``, as generators and
    the Loader's iterators do) and drops the batches copied ahead.

    Args:
        source: the iterator read ahead.
        transfer: what issues a batch's copy (``issue``) and hands it over (``deliver``).
        depth: batches read ahead (0: none).
        stateful: what :meth:`state_dict` and :meth:`load_state_dict` ask (the
            iterable ``source`` came from, e.g. the Loader); default ``source``.
    """

    def __init__(self, source: Iterator[Any], transfer: Any, depth: int, stateful: Any = None) -> None:
        self._source: Iterator[Any] | None = source
        self._transfer = transfer
        self._depth = depth
        self._stateful = source if stateful is None else stateful
        self._unseen = _Unseen()
        self._ahead: deque[Any] = deque()
        self._exhausted = False
        self._closed = False

    def __iter__(self) -> PrefetchIterator:
        return self

    def _pull(self, n: int, ahead: bool) -> None:
        """Issue batches from the source until ``n`` are ahead (or the source ends or fails).

        Reading ahead (``ahead``: not the batch the loop asked for), it stops
        where the source's iterator says no batch is left (``len()`` or
        ``__length_hint__`` of 0, as a Loader's epoch says): the source then
        sees its end when the loop asks for it, as without prefetch, and its
        state stays in the epoch that is ending.
        """
        while len(self._ahead) < n and not self._exhausted:
            source = self._source
            if source is None:
                self._exhausted = True
                break
            if ahead and _announces_end(source):
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
            self._unseen.n += 1
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
            self._pull(1, ahead=False)
            item = self._ahead.popleft() if self._ahead else _END
            if isinstance(item, _End):
                self.close()
                raise StopIteration
            if isinstance(item, _Failure):
                self.close()
                raise item.error
            out = self._transfer.deliver(item)
            del item
            self._pull(self._depth, ahead=True)  # batches k+1..k+depth are copied while the caller works on batch k
            self._unseen.n -= 1
            return out
        except (StopIteration, Exception):
            raise
        except BaseException:  # KeyboardInterrupt and the like: stop the source, as the Loader does
            self.close()
            raise

    def state_dict(self) -> dict[str, Any]:
        """The source's state after the last batch this iterator handed to the loop (not the last one it read).

        The batches read ahead are excluded: the source is asked for
        ``state_dict(unseen=k)``, ``k`` the batches it handed out that the loop
        has not received (a stoker :class:`~stoker.loader.Loader` accepts it), so that
        a resume yields them again. Valid during the pass and after it ends or
        is closed (a ``break``), until the source starts another pass; a
        Loader's state is then its next epoch's start (the loader's rule: a
        pass left early ends its epoch).

        Raises:
            TypeError: the source has no ``state_dict``, or batches are ahead and
                its ``state_dict`` takes no ``unseen`` (its state would count them as seen).
        """
        return _source_state(self._stateful, self._unseen.n)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Give ``state`` to the source (its ``load_state_dict``), once this pass is over; the next pass continues from it.

        Raises:
            StokerError: the pass is still running (finish it, or :meth:`close` it, first).
            TypeError: the source has no ``load_state_dict``.
        """
        if not self._closed:
            raise StokerError(_RUNNING)
        _load_source_state(self._stateful, state)
        self._unseen.n = 0

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
        try:  # noqa: SIM105  (a finalizer must not raise; no module globals: at interpreter exit they may be None)
            self.close()
        except Exception:
            pass


_RUNNING = (
    "load_state_dict() while a pass over prefetch() is running: the batches it read ahead would come from the old state. "
    "Finish the loop, or close() the iterator, first"
)


def _announces_end(source: Iterator[Any]) -> bool:
    """Whether ``source`` says it has no item left (``len()``/``__length_hint__`` of 0); ``False`` when it cannot say."""
    try:
        return operator.length_hint(source, -1) == 0
    except Exception:  # a __len__ that raises: no announcement
        return False


def _takes_unseen(method: Callable[..., Any]) -> bool:
    """Whether ``method`` accepts an ``unseen=`` keyword."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any((p.name == "unseen" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) or p.kind == p.VAR_KEYWORD for p in params)


def _source_state(source: Any, unseen: int) -> dict[str, Any]:
    """``source.state_dict()`` counting only the batches the loop received; ``unseen``: those it did not."""
    state_dict = getattr(source, "state_dict", None)
    if not callable(state_dict):
        raise TypeError(
            f"prefetch's source, a {type(source).__name__}, has no state_dict(): resuming through prefetch needs a source "
            "that saves its position (a stoker Loader, or an object with state_dict() and load_state_dict())"
        )
    if unseen == 0:
        return state_dict()  # type: ignore[no-any-return]
    if not _takes_unseen(state_dict):
        raise TypeError(
            f"{type(source).__name__}.state_dict() takes no unseen= argument, and prefetch holds {unseen} batches it read ahead "
            "that your loop has not received: the source's state would count them as seen, and a resume would skip them. "
            "Take the state when no batch is ahead (after a pass), or give the source a state_dict(unseen=k) that leaves "
            "out its last k batches"
        )
    return state_dict(unseen=unseen)  # type: ignore[no-any-return]


def _load_source_state(source: Any, state: Mapping[str, Any]) -> None:
    load = getattr(source, "load_state_dict", None)
    if not callable(load):
        raise TypeError(f"prefetch's source, a {type(source).__name__}, has no load_state_dict(): it cannot resume")
    load(state)


class Prefetcher(Iterable[Any]):
    """An iterable over ``source``'s batches on ``device``, copied ``depth`` batches ahead; see :func:`prefetch`.

    Each ``iter()`` (each ``for`` loop) is one pass over ``iter(source)``: a
    Loader or a DataLoader gives one epoch per pass, as it would without
    ``prefetch``; a generator can be gone through once.

    A source with ``expect_held(batches)`` (a stoker :class:`~stoker.loader.Loader`)
    is told, before each pass, that ``depth`` of its batches are held besides the
    one the loop uses, so that it sizes its memory for them instead of warning
    (:class:`~stoker.loader.HeldBatchesWarning`).
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
        self._unseen = _Unseen()  # the last pass's, kept after the pass is dropped

    def __iter__(self) -> PrefetchIterator:
        device = resolve_device(self.device)
        transfer: Any = _CudaTransfer(device, self.depth) if device.type == "cuda" else _SyncTransfer(device)
        expect_held = getattr(self.source, "expect_held", None)
        if callable(expect_held):
            # besides the batch the loop uses: the depth batches ahead (while the next one is read, the loop's
            # variable still holds the previous batch, as it does without prefetch)
            expect_held(self.depth)
        it = PrefetchIterator(iter(self.source), transfer, self.depth, stateful=self.source)
        self._active = weakref.ref(it)
        self._unseen = it._unseen
        return it

    def __len__(self) -> int:
        """The source's length (``TypeError`` if it has none)."""
        return len(self.source)  # type: ignore[arg-type]

    def _running(self) -> PrefetchIterator | None:
        active = self._active() if self._active is not None else None
        return active if active is not None and not active._closed else None

    def state_dict(self) -> dict[str, Any]:
        """The source's state after the last batch your loop received, not after the batches read ahead.

        Asks ``source.state_dict(unseen=k)``, ``k`` the batches the last pass
        read ahead and did not hand out (a stoker :class:`~stoker.loader.Loader`
        accepts ``unseen``): restored with :meth:`load_state_dict` (or the
        source's own), the next pass yields them. Taken during a pass, or after
        it (after a ``break`` too: the batches read ahead are still left out).
        A Loader's rule holds through it: once the pass is over (ended, or left
        by ``break``), the state is where the next pass starts, the next
        epoch's first batch; save it inside the loop to resume mid-epoch.

        Raises:
            TypeError: the source has no ``state_dict``, or batches are ahead and
                its ``state_dict`` takes no ``unseen``.

        Example:
            >>> from stoker.loader import Loader  # doctest: +SKIP
            >>> loader = Loader("train.stoker", batch_size=256)  # doctest: +SKIP
            >>> batches = prefetch(loader, "cuda", depth=3)  # doctest: +SKIP
            >>> for step, batch in enumerate(batches):  # doctest: +SKIP
            ...     train(batch)
            ...     if step % 1000 == 0:
            ...         torch.save({"model": model.state_dict(), "data": batches.state_dict()}, "ckpt.pt")
        """
        return _source_state(self.source, self._unseen.n)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Give ``state`` (from :meth:`state_dict`) to the source: the next pass continues after the batch it records.

        Raises:
            StokerError: a pass is running (finish the loop, or :meth:`close`, first):
                its batches read ahead come from the old state.
            TypeError: the source has no ``load_state_dict``.
        """
        if self._running() is not None:
            raise StokerError(_RUNNING)
        _load_source_state(self.source, state)
        self._unseen.n = 0

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

    On the CPU (and devices without CUDA streams) it reads ahead the same way,
    each batch going through ``to_device`` when it is read (on the CPU: the
    batch itself when its tensors are already there): a CPU run resumes and
    holds batches as a CUDA run does.

    Batches come in order. An error of the source reaches your loop at the
    position it happened, after every batch before it; breaking out of the
    loop (or deleting the iterator, ``close()``) closes the source's iterator
    and drops the batches copied ahead, as the Loader stops its threads.

    Resuming: :meth:`Prefetcher.state_dict` is the source's state after the
    last batch your loop received (the batches read ahead are left out, so a
    resume yields them); a source with ``expect_held`` (the Loader) is told
    that ``depth`` batches are held, and sizes its memory for them.

    Args:
        source: any iterable of batches: a :class:`stoker.Loader` (with
            ``named=True`` it yields dicts), a ``torch.utils.data.DataLoader``,
            a generator.
        device: where the batches go (``'cuda'``, ``'cuda:1'``, a ``torch.device``, ``'cpu'``).
        depth: batches copied ahead.

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
