""":func:`to_device`: move every tensor of a nested batch, small ones in one copy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from stoker.device._pack import can_pack, pack, unpack
from stoker.device._stream import keep_until_done
from stoker.device._tree import tree_map
from stoker.errors import StokerError

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

#: [bytes]: CPU tensors of at most this size going to CUDA are coalesced, packed into one staging buffer and
#: copied at once; larger ones get their own copy (and their own device memory, so that keeping one of them
#: does not keep the others alive)
COALESCE_MAX_BYTES = 64 * 1024


def resolve_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device``; ``'cuda'`` without an index becomes the current CUDA device.

    Raises:
        StokerError: a CUDA device without CUDA.
    """
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise StokerError(f"cannot move batches to {str(dev)!r}: CUDA is not available (torch.cuda.is_available() is False)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def to_device(batch: T, device: Any, non_blocking: bool = True) -> T:
    """Move every tensor of ``batch`` to ``device``; everything else is left as it is.

    ``batch`` may be a tensor or nested dicts (any ``Mapping``), lists, tuples,
    named tuples and dataclasses of tensors and other values; the result has
    the same structure and container types (see ``stoker.device._tree``).
    Strings, numbers, numpy arrays, sets and other objects are leaves returned
    unchanged (numpy arrays are *not* converted: ``torch.from_numpy`` them
    first if they should move). A tensor already on ``device`` is returned as
    it is, and a container none of whose tensors moved is returned as it is;
    a tensor that appears twice is copied once.

    To CUDA, from the CPU:

    * tensors of at most :data:`COALESCE_MAX_BYTES` are packed into one
      staging buffer and copied in one transfer; each comes back as a
      contiguous view of one device buffer;
    * larger tensors are copied one by one and keep their strides (as with
      ``Tensor.to``); with ``non_blocking``, a tensor in pageable memory is
      first copied into page-locked memory, so that the transfer is really
      asynchronous;
    * the copies are issued on the current CUDA stream and the device memory
      is allocated on it: work queued on that stream afterwards sees the data
      without any synchronisation. Each page-locked buffer a copy reads stays
      referenced until an event recorded after the copy has completed, so it
      is neither freed nor reused before the copy has read it. A page-locked
      tensor *you* pass is copied directly: do not write into it before the
      stream has passed the copy (as with ``Tensor.to(non_blocking=True)``).

    To the CPU, from CUDA: with ``non_blocking``, every copy goes into
    page-locked memory asynchronously and one event per source device is
    waited for before returning, so the tensors returned are complete (a
    non-blocking copy into pageable memory is never issued). Other devices:
    ``Tensor.to(device, non_blocking=non_blocking)`` per tensor.

    Tensor subclasses, tensors that require grad, and sparse or quantized
    tensors are moved one by one with ``Tensor.to`` (so they stay in the
    autograd graph and keep their type).

    Args:
        batch: a tensor, or nested containers of tensors and other values.
        device: a ``torch.device``, a string (``'cuda'``, ``'cuda:1'``, ``'cpu'``) or a CUDA device index.
        non_blocking: return as soon as the copies are issued (to CUDA).

    Returns:
        ``batch`` with its tensors on ``device``.

    Raises:
        ValueError: ``batch`` contains itself.

    Example:
        >>> import torch
        >>> batch = {"x": torch.zeros(2, 3), "meta": {"ids": [torch.tensor(1), "a"]}}
        >>> moved = to_device(batch, "cpu")
        >>> moved is batch  # nothing to move
        True
    """
    moved, _ = move(batch, device, non_blocking)
    return moved


def move(batch: T, device: Any, non_blocking: bool = True, coalesce_max_bytes: int = COALESCE_MAX_BYTES) -> tuple[T, list[Any]]:
    """:func:`to_device`, also returning the device tensors it allocated (whose memory a consumer may need to ``record_stream``).

    The page-locked buffers its copies read stay referenced until an event
    recorded after them on the current stream has completed.
    """
    moved, created, host = move_held(batch, device, non_blocking, coalesce_max_bytes)
    if host:
        import torch

        keep_until_done(host, torch.cuda.current_stream(resolve_device(device)))
    return moved, created


def move_held(
    batch: T, device: Any, non_blocking: bool = True, coalesce_max_bytes: int = COALESCE_MAX_BYTES
) -> tuple[T, list[Any], list[Any]]:
    """:func:`move`, returning the page-locked buffers its asynchronous copies read instead of keeping them.

    Returns:
        The batch on ``device``, the device tensors allocated, and the host
        buffers to keep referenced until the copies are done (empty unless
        ``non_blocking`` copies to CUDA were issued).
    """
    target = resolve_device(device)
    unique: dict[int, Any] = {}

    def collect(t: Any) -> Any:
        unique.setdefault(id(t), t)
        return t

    tree_map(collect, batch)
    if not unique:
        return batch, [], []
    sources = list(unique.values())
    moved, created, host = _move_tensors(sources, target, non_blocking, coalesce_max_bytes)
    by_id = {id(s): m for s, m in zip(sources, moved)}
    return tree_map(lambda t: by_id[id(t)], batch), created, host


def _move_tensors(
    sources: list[Any], target: torch.device, non_blocking: bool, coalesce_max_bytes: int
) -> tuple[list[Any], list[Any], list[Any]]:
    out: list[Any] = list(sources)
    todo = [i for i, t in enumerate(sources) if t.device != target]
    if not todo:
        return out, [], []
    if target.type == "cuda":
        from_cpu = [i for i in todo if sources[i].device.type == "cpu"]
        moved, created, host = copy_in([sources[i] for i in from_cpu], target, non_blocking, non_blocking, coalesce_max_bytes)
        for i, m in zip(from_cpu, moved):
            out[i] = m
        for i in todo:
            if sources[i].device.type != "cpu":  # another GPU (peer copy, ordered by PyTorch with both current streams)
                out[i] = sources[i].to(target, non_blocking=non_blocking)
                created.append(out[i])
        return out, created, host if non_blocking else []
    if target.type == "cpu":
        moved = copy_out([sources[i] for i in todo], non_blocking)
    else:
        moved = [sources[i].to(target, non_blocking=non_blocking) for i in todo]
    for i, m in zip(todo, moved):
        out[i] = m
    return out, list(moved), []


def copy_in(
    sources: list[Any], target: torch.device, non_blocking: bool, pin: bool, coalesce_max_bytes: int = COALESCE_MAX_BYTES
) -> tuple[list[Any], list[Any], list[Any]]:
    """Copy CPU tensors to ``target``: the small ones packed into one staging buffer and copied at once, the others one by one.

    Args:
        sources: CPU tensors.
        target: the device (any: the CPU too, which tests the packing without a GPU).
        non_blocking: issue asynchronous copies.
        pin: stage through page-locked memory (the small ones' buffer, and
            large tensors in pageable memory), which asynchronous copies to
            CUDA need.
        coalesce_max_bytes: the largest tensor packed [bytes].

    Returns:
        The copies (in the order of ``sources``), the memory allocated on
        ``target`` (the packed buffer, the large copies), and the host buffers
        the copies read (to keep until they are done).
    """
    import torch

    out: list[Any] = [None] * len(sources)
    created: list[Any] = []
    host: list[Any] = []
    small = [i for i, t in enumerate(sources) if t.numel() * t.element_size() <= coalesce_max_bytes and can_pack(t)]
    if small:
        staging, spans = pack([sources[i] for i in small], pin=pin)
        buffer = torch.empty(staging.shape, dtype=torch.uint8, device=target)
        buffer.copy_(staging, non_blocking=non_blocking)
        for i, v in zip(small, unpack(buffer, spans)):
            out[i] = v
        created.append(buffer)
        host.append(staging)
    packed = set(small)
    for i, t in enumerate(sources):
        if i in packed:
            continue
        src = t
        if pin and type(t) is torch.Tensor and t.layout == torch.strided and not t.requires_grad and not t.is_pinned():
            src = t.pin_memory()  # one host copy into page-locked memory, then a real asynchronous transfer
        out[i] = src.to(target, non_blocking=non_blocking)
        created.append(out[i])
        host.append(src)
    return out, created, host


def copy_out(sources: list[Any], non_blocking: bool) -> list[Any]:
    """Copy tensors to the CPU; returns once every copy is complete.

    With ``non_blocking``, CUDA tensors are copied asynchronously into
    page-locked memory and one event per source device is waited for (an
    asynchronous copy into pageable memory is never issued).
    """
    import torch

    out = []
    devices = set()
    for t in sources:
        if non_blocking and t.device.type == "cuda" and type(t) is torch.Tensor and t.layout == torch.strided and not t.requires_grad:
            dst = torch.empty_like(t, device="cpu", pin_memory=True)
            dst.copy_(t, non_blocking=True)
            devices.add(t.device)
        else:
            dst = t.to("cpu")
        out.append(dst)
    for dev in devices:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(dev))
        done.synchronize()
    return out
