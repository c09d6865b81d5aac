"""Mixed-up labels as soft one-hot targets: :class:`MixupToOneHot` (FFCV's ``ffcv.transforms.mixup.MixupToOneHot``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State


class MixupToOneHot(Operation):
    """Turns :class:`~stoker.transforms.LabelMixup`'s ``(label, partner's label, lam)`` rows into one-hot targets.

    Row ``i`` becomes ``lam * one_hot(label) + (1 - lam) * one_hot(partner)``,
    ``(batch, num_classes)`` in the dtype and on the device of the rows (a
    sample paired with itself gets 1 at its label). Place it after
    ``LabelMixup`` and ``ToTensor`` (and ``ToDevice``, if any): it runs with
    torch, after the compiled part of the pipeline.

    Args:
        num_classes: the number of classes, >= 1; every label must be below it.

    Raises:
        ValueError: ``num_classes`` < 1; at build time, a numpy batch or
            samples that are not ``(3,)`` rows.
    """

    reentrant = True

    def __init__(self, num_classes: int) -> None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"MixupToOneHot: num_classes must be an int >= 1; got {num_classes!r}")
        self.num_classes = num_classes

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        if previous_state.jit_mode:
            raise ValueError("MixupToOneHot works on tensors: place it after LabelMixup and ToTensor")
        if previous_state.shape != (3,):
            raise ValueError(
                f"MixupToOneHot expects LabelMixup's (label, partner's label, lam) rows, sample shape (3,); got {previous_state.shape}"
            )
        shape = (self.num_classes,)
        return replace(previous_state, shape=shape), AllocationQuery(shape, previous_state.dtype, previous_state.device)

    def generate_code(self) -> Callable[..., Any]:
        def mixup_to_one_hot(batch: Any, dst: Any) -> Any:
            out = dst[: batch.shape[0]]
            out.zero_()
            lam = batch[:, 2:3].to(out.dtype)
            out.scatter_add_(1, batch[:, 0:1].long(), lam)
            out.scatter_add_(1, batch[:, 1:2].long(), 1 - lam)
            return out

        return mixup_to_one_hot

    def __repr__(self) -> str:
        return f"MixupToOneHot(num_classes={self.num_classes})"
