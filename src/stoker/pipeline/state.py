"""The state of a batch between two operations of a pipeline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the layouts of an image sample: (height, width, channels), as decoders make them, or (channels, height, width)
IMAGE_LAYOUTS = ("HWC", "CHW")


@dataclass(frozen=True)
class State:
    """What an operation receives: per-sample shape, dtype, device, layout, and whether it is compilable.

    Attributes:
        jit_mode: ``True`` while the data is a numpy array on the CPU, so the
            next operation can be compiled with Numba.
        device: where the data lives (a ``torch.device`` once it is a tensor;
            ignored in jit mode).
        shape: the shape of *one sample* (the batch dimension is implicit).
        dtype: a numpy dtype in jit mode, a torch dtype otherwise.
        layout: what the three dimensions of an image sample are: ``"HWC"``
            (height, width, channels; image decoders declare it), ``"CHW"``
            (after ``NormalizeImage`` or ``ToTorchImage``), or ``None`` for
            samples that are not images or whose layout nobody declared.
            Image operations read it, never guess it from the shape. It has a
            default, so FFCV's ``State(jit_mode, device, shape, dtype)`` works;
            ``replace(state, shape=...)`` keeps it, so an operation that
            changes the layout must set it. A layout describes 3-dimensional
            samples only: with any other shape it becomes ``None``.

    Raises:
        TypeError: a ``shape`` that is not a tuple.
        ValueError: a ``layout`` other than ``"HWC"``, ``"CHW"`` or ``None``.

    Example:
        >>> import numpy as np
        >>> from dataclasses import replace
        >>> image = State(True, None, (32, 48, 3), np.dtype("u1"), layout="HWC")
        >>> replace(image, shape=(3, 32, 48), layout="CHW").image_size()
        (32, 48, 3)
        >>> replace(image, shape=(4608,)).layout is None
        True
    """

    jit_mode: bool
    device: Any
    shape: tuple[int, ...]
    dtype: Any
    layout: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple):
            raise TypeError(f"State.shape must be a tuple; got {type(self.shape).__name__} {self.shape!r}")
        if self.layout is not None and self.layout not in IMAGE_LAYOUTS:
            raise ValueError(f"State.layout must be 'HWC', 'CHW' or None; got {self.layout!r}")
        if self.layout is not None and len(self.shape) != 3:
            # an FFCV operation that flattens images, replace(state, shape=(n,)), does not know about layouts
            object.__setattr__(self, "layout", None)

    def image_size(self, op: object = None) -> tuple[int, int, int]:
        """The ``(height, width, channels)`` of image samples, read through :attr:`layout`.

        Args:
            op: the operation asking, named in the error.

        Raises:
            ValueError: the samples are not images of a known layout; the
                message names ``op``, the shape and the layout, and says how
                to declare a layout.
        """
        name = type(op).__name__ if op is not None else "this operation"
        if self.layout == "HWC":
            h, w, c = self.shape
            return h, w, c
        if self.layout == "CHW":
            c, h, w = self.shape
            return h, w, c
        expects = f"{name} expects image samples, (height, width, channels) or (channels, height, width)"
        if len(self.shape) != 3:
            raise ValueError(f"{expects}; got sample shape {self.shape}, layout None")
        raise ValueError(
            f"{expects}; got sample shape {self.shape}, layout None: the layout of these samples is unknown. "
            "Image decoders declare it; for other arrays, put before it an operation whose declare_state_and_memory "
            "returns replace(previous_state, layout='HWC') (or 'CHW')"
        )
