"""FFCV's ``ffcv.transforms.ops`` path: the tensor and device operations.

Re-exports :class:`ToTensor`, :class:`ToTorchImage`, :class:`Convert` and
:class:`View` (defined in :mod:`stoker.transforms.tensor`) and
:class:`ToDevice` (defined in :mod:`stoker.transforms.device`).
"""

from stoker.transforms.device import ToDevice
from stoker.transforms.tensor import Convert, ToTensor, ToTorchImage, View

__all__ = ["Convert", "ToDevice", "ToTensor", "ToTorchImage", "View"]
