"""``to_tensor`` as torchvision's: a PIL image or HWC uint8 array -> float32 CHW tensor in [0, 1]."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["to_tensor"]


def to_tensor(pic: Any) -> torch.Tensor:
    arr = np.asarray(pic)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    out = torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))
    return out.float().div(255) if out.dtype == torch.uint8 else out
