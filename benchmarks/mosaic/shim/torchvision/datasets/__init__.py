"""``VisionDataset``: the base class of ``streaming.vision``'s datasets (the parts they use)."""

from __future__ import annotations

from typing import Any

import torch.utils.data

__all__ = ["VisionDataset"]


class _Both:
    """torchvision's ``StandardTransform``: ``transform`` on the input, ``target_transform`` on the target."""

    def __init__(self, transform: Any = None, target_transform: Any = None) -> None:
        self.transform, self.target_transform = transform, target_transform

    def __call__(self, x: Any, y: Any) -> tuple[Any, Any]:
        if self.transform is not None:
            x = self.transform(x)
        if self.target_transform is not None:
            y = self.target_transform(y)
        return x, y


class VisionDataset(torch.utils.data.Dataset):
    """As torchvision's: keeps ``root`` and the transforms; ``transforms`` may not be given with the other two."""

    def __init__(self, root: Any = None, transforms: Any = None, transform: Any = None, target_transform: Any = None) -> None:
        self.root = root
        if transforms is not None and (transform is not None or target_transform is not None):
            raise ValueError("Only transforms or transform/target_transform can be passed as argument")
        self.transform, self.target_transform = transform, target_transform
        self.transforms = transforms if transforms is not None else _Both(transform, target_transform)
