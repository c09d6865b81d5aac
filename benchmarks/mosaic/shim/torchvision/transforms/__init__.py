"""torchvision.transforms, as far as ``streaming.vision`` needs it (``functional.to_tensor``)."""

from . import functional

__all__ = ["functional"]
