"""Run any ``torch.nn.Module`` or Python callable on each batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State


class ModuleWrapper(Operation):
    """Wraps a ``torch.nn.Module`` or a callable taking and returning a batch.

    It runs in Python once per batch, after the compiled part of the pipeline.
    A module gets a tensor (a numpy batch is turned into one first); a plain
    callable gets the batch as it is. A callable or module placed directly in
    a pipeline is wrapped in this automatically.
    """

    def __init__(self, module: Callable[..., Any]) -> None:
        if not callable(module):
            raise TypeError(f"ModuleWrapper needs a callable or a torch.nn.Module; got {type(module).__name__}")
        self.module = module

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        return replace(previous_state, jit_mode=False), None

    def generate_code(self) -> Callable[..., Any]:
        module = self.module
        is_module = type(module).__module__.startswith("torch") or hasattr(module, "parameters")

        def run_module(batch: Any, dst: Any) -> Any:
            if is_module and isinstance(batch, np.ndarray):
                import torch

                batch = torch.from_numpy(batch)
            return module(batch)

        return run_module

    def __repr__(self) -> str:
        name = getattr(self.module, "__name__", None) or type(self.module).__name__
        return f"ModuleWrapper({name})"
