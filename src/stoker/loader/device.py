"""CUDA side of the loader: its own stream, and events that guard buffer reuse."""

from __future__ import annotations

from typing import Any


class CudaSync:
    """Orders the loader's copies against the user's stream, per batch slot.

    * The loader copies on its own stream; the batch handed to the user carries
      an event, and the user's current stream waits on it (no host sync).
    * Before a slot's buffers are written again, the loader waits for the copy
      out of its pinned memory to finish (host side) and makes its stream wait
      for the work the user queued on that slot's device memory.
    """

    def __init__(self, device: Any, num_slots: int) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.copied: list[Any] = [None] * num_slots
        self.released: list[Any] = [None] * num_slots

    def before_slot(self, slot: int) -> None:
        """Producer: wait until slot ``slot`` may be overwritten."""
        if self.copied[slot] is not None:
            self.copied[slot].synchronize()
        if self.released[slot] is not None:
            self.stream.wait_event(self.released[slot])

    def stream_context(self) -> Any:
        """Producer: run the batch's tensor operations on the loader's stream."""
        return self.torch.cuda.stream(self.stream)

    def after_batch(self, slot: int) -> Any:
        """Producer: record the end of the batch's copies; returns the event."""
        event = self.torch.cuda.Event()
        event.record(self.stream)
        self.copied[slot] = event
        return event

    def hand_over(self, event: Any) -> None:
        """Consumer: make the user's current stream wait for the batch."""
        self.torch.cuda.current_stream(self.device).wait_event(event)

    def release(self, slot: int) -> None:
        """Consumer: the user moved on from slot ``slot``; mark where its stream is."""
        event = self.torch.cuda.Event()
        event.record(self.torch.cuda.current_stream(self.device))
        self.released[slot] = event
