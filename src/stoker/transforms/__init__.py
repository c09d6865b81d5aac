"""Transforms: operations placed after a decoder in a field's pipeline.

``from stoker.transforms import ToTensor, ToDevice, ToTorchImage, ...`` as in FFCV.
"""

from stoker.transforms.device import ToDevice
from stoker.transforms.module import ModuleWrapper
from stoker.transforms.tensor import Convert, Squeeze, ToTensor, ToTorchImage, View

__all__ = ["Convert", "ModuleWrapper", "Squeeze", "ToDevice", "ToTensor", "ToTorchImage", "View"]
