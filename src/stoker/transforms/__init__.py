"""Transforms: operations placed after a decoder in a field's pipeline.

``from stoker.transforms import ToTensor, ToDevice, ToTorchImage, ...`` as in FFCV.
"""

from stoker.transforms.color_jitter import RandomBrightness, RandomContrast, RandomSaturation
from stoker.transforms.cutout import Cutout
from stoker.transforms.device import ToDevice
from stoker.transforms.flip import RandomHorizontalFlip
from stoker.transforms.mixup import ImageMixup, LabelMixup
from stoker.transforms.mixup_one_hot import MixupToOneHot
from stoker.transforms.module import ModuleWrapper
from stoker.transforms.normalize import NormalizeImage
from stoker.transforms.poisoning import Poison
from stoker.transforms.random_resized_crop import RandomResizedCrop
from stoker.transforms.replace_label import ReplaceLabel
from stoker.transforms.tensor import Convert, Squeeze, ToTensor, ToTorchImage, View
from stoker.transforms.translate import RandomTranslate

__all__ = [
    "Convert",
    "Cutout",
    "ImageMixup",
    "LabelMixup",
    "MixupToOneHot",
    "ModuleWrapper",
    "NormalizeImage",
    "Poison",
    "RandomBrightness",
    "RandomContrast",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "RandomSaturation",
    "RandomTranslate",
    "ReplaceLabel",
    "Squeeze",
    "ToDevice",
    "ToTensor",
    "ToTorchImage",
    "View",
]
