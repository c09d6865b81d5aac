"""Coalescing small tensors: pack them into one byte buffer, copy that once, and cut views out of the copy.

::

    tensors:   a (int64, 3)   b (bool, 2x2)   c (float32, ())
    staging:   |a a a . . . . |b b b b . . . |c . . . . . . |      one uint8 buffer, each tensor
               0              64             128           132     at a multiple of ALIGNMENT bytes
    device:    the same bytes, copied once; a, b, c are views of it with their dtype and shape

Every tensor is written in C order, so the views are contiguous whatever the
source's strides were (a transposed or sliced source is copied element by
element into its span). The spans of every dtype share one buffer: a span
starts at a multiple of :data:`ALIGNMENT` bytes, which is a multiple of every
element size, so ``buffer[span].view(dtype)`` is always valid and kernels
reading the views get aligned memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: bytes: every packed tensor starts at a multiple of this (a multiple of every dtype's size, and of a cache line)
ALIGNMENT = 64

_VIEWABLE: dict[Any, bool] = {}  # dtype -> whether a uint8 buffer can be viewed as it


@dataclass(frozen=True)
class Span:
    """Where one tensor lies in a packed buffer."""

    offset: int  # [bytes], a multiple of ALIGNMENT
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _viewable(dtype: torch.dtype) -> bool:
    """Whether bytes can be reinterpreted as ``dtype`` (not quantized and the like); probed once per dtype."""
    known = _VIEWABLE.get(dtype)
    if known is None:
        import torch

        try:
            torch.zeros(ALIGNMENT, dtype=torch.uint8).view(dtype)
            known = True
        except (RuntimeError, TypeError):
            known = False
        _VIEWABLE[dtype] = known
    return known


def can_pack(t: torch.Tensor) -> bool:
    """Whether ``t`` may be packed: a plain, dense CPU tensor, outside autograd, of a dtype bytes can be viewed as.

    Tensor subclasses, tensors that require grad (their copies must stay in
    the graph), sparse and quantized tensors are moved one by one instead.
    """
    import torch

    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and not t.requires_grad
        and not t.is_quantized
        and _viewable(t.dtype)
    )


def layout(tensors: list[torch.Tensor], alignment: int = ALIGNMENT) -> tuple[list[Span], int]:
    """The span of each tensor in a packed buffer, and the buffer's size [bytes]."""
    spans = []
    end = 0
    for t in tensors:
        offset = -(-end // alignment) * alignment
        nbytes = t.numel() * t.element_size()
        spans.append(Span(offset, nbytes, t.dtype, tuple(t.shape)))
        end = offset + nbytes
    return spans, end


def view(buffer: torch.Tensor, span: Span) -> torch.Tensor:
    """The tensor ``span`` describes, as a view of the uint8 ``buffer`` (on any device)."""
    return buffer[span.offset : span.offset + span.nbytes].view(span.dtype).view(span.shape)


def pack(tensors: list[torch.Tensor], pin: bool = False, alignment: int = ALIGNMENT) -> tuple[torch.Tensor, list[Span]]:
    """Copy CPU ``tensors`` into one new uint8 buffer.

    Args:
        tensors: CPU tensors for which :func:`can_pack` holds, of any strides.
        pin: allocate the buffer in page-locked memory (PyTorch's caching host
            allocator), so that a copy out of it can be asynchronous.
        alignment: see :data:`ALIGNMENT`.

    Returns:
        The buffer and each tensor's span; :func:`unpack` turns them back into tensors.
    """
    import torch

    spans, size = layout(tensors, alignment)
    buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    for t, span in zip(tensors, spans):
        view(buffer, span).copy_(t)
    return buffer, spans


def unpack(buffer: torch.Tensor, spans: list[Span]) -> list[torch.Tensor]:
    """The tensors packed in ``buffer`` (or in a copy of it on another device): contiguous views sharing its memory."""
    return [view(buffer, span) for span in spans]
