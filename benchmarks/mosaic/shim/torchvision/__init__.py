"""A stand-in for torchvision in the Mosaic benchmark's environment (not the real package).

``import streaming`` imports ``streaming.vision``, whose dataset classes
(``StreamingImageNet``...) subclass ``torchvision.datasets.VisionDataset`` and
use ``torchvision.transforms.functional.to_tensor``. The only torchvision
wheels that pip can reach here are CUDA builds, whose ``_C`` extension cannot
load beside the CPU build of torch (``operator torchvision::nms does not
exist`` at import). This package gives those two names with torchvision's
behaviour, so that ``import streaming`` works; the benchmark itself uses
neither (it subclasses ``streaming.StreamingDataset`` and does its own
decoding with Pillow). ``setup_env.sh`` copies it into the environment; it has
no ``dist-info``, so ``transformers`` and pip see no torchvision installed.
"""

from . import datasets, transforms

__version__ = "0.0+stoker.shim"
__all__ = ["datasets", "transforms"]
