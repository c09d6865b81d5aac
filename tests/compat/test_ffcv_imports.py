"""FFCV 1.0.2's user-facing names import from the same module paths with ``ffcv`` -> ``stoker``.

Each row of :data:`FFCV_NAMES` is (FFCV's module path, name, the stoker module
that defines the name). The compatibility modules only re-export: the object
imported from FFCV's path must be the very object defined in stoker's module.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

_DEC = "stoker.decoders.arrays"
_IMG_DEC = "stoker.decoders.rgb_image"
_TENSOR = "stoker.transforms.tensor"
_DEVICE = "stoker.transforms.device"
_COLOR = "stoker.transforms.color_jitter"

#: (module path as in FFCV, name, the module of stoker that defines it)
FFCV_NAMES: list[tuple[str, str, str]] = [
    # top level
    ("stoker", "DatasetWriter", "stoker.format.writer"),
    ("stoker", "Loader", "stoker.loader.loader"),
    # writer
    ("stoker.writer", "DatasetWriter", "stoker.format.writer"),
    # loader
    ("stoker.loader", "Loader", "stoker.loader.loader"),
    ("stoker.loader", "OrderOption", "stoker.loader.order"),
    ("stoker.loader.loader", "Loader", "stoker.loader.loader"),
    ("stoker.loader.loader", "OrderOption", "stoker.loader.order"),
    # fields
    ("stoker.fields", "BytesField", "stoker.fields.bytes"),
    ("stoker.fields", "Field", "stoker.fields.base"),
    ("stoker.fields", "FloatField", "stoker.fields.basics"),
    ("stoker.fields", "IntField", "stoker.fields.basics"),
    ("stoker.fields", "JSONField", "stoker.fields.json"),
    ("stoker.fields", "NDArrayField", "stoker.fields.ndarray"),
    ("stoker.fields", "RGBImageField", "stoker.fields.rgb_image"),
    ("stoker.fields", "TorchTensorField", "stoker.fields.torch_tensor"),
    ("stoker.fields.base", "Field", "stoker.fields.base"),
    ("stoker.fields.basics", "FloatDecoder", _DEC),
    ("stoker.fields.basics", "FloatField", "stoker.fields.basics"),
    ("stoker.fields.basics", "IntDecoder", _DEC),
    ("stoker.fields.basics", "IntField", "stoker.fields.basics"),
    ("stoker.fields.bytes", "BytesDecoder", _DEC),
    ("stoker.fields.bytes", "BytesField", "stoker.fields.bytes"),
    ("stoker.fields.json", "JSONField", "stoker.fields.json"),
    ("stoker.fields.ndarray", "NDArrayDecoder", _DEC),
    ("stoker.fields.ndarray", "NDArrayField", "stoker.fields.ndarray"),
    ("stoker.fields.ndarray", "TorchTensorField", "stoker.fields.torch_tensor"),
    ("stoker.fields.rgb_image", "CenterCropRGBImageDecoder", _IMG_DEC),
    ("stoker.fields.rgb_image", "RGBImageField", "stoker.fields.rgb_image"),
    ("stoker.fields.rgb_image", "RandomResizedCropRGBImageDecoder", _IMG_DEC),
    ("stoker.fields.rgb_image", "SimpleRGBImageDecoder", _IMG_DEC),
    ("stoker.fields.decoders", "BytesDecoder", _DEC),
    ("stoker.fields.decoders", "CenterCropRGBImageDecoder", _IMG_DEC),
    ("stoker.fields.decoders", "FloatDecoder", _DEC),
    ("stoker.fields.decoders", "IntDecoder", _DEC),
    ("stoker.fields.decoders", "NDArrayDecoder", _DEC),
    ("stoker.fields.decoders", "RandomResizedCropRGBImageDecoder", _IMG_DEC),
    ("stoker.fields.decoders", "SimpleRGBImageDecoder", _IMG_DEC),
    # transforms
    ("stoker.transforms", "Convert", _TENSOR),
    ("stoker.transforms", "Cutout", "stoker.transforms.cutout"),
    ("stoker.transforms", "ImageMixup", "stoker.transforms.mixup"),
    ("stoker.transforms", "LabelMixup", "stoker.transforms.mixup"),
    ("stoker.transforms", "ModuleWrapper", "stoker.transforms.module"),
    ("stoker.transforms", "NormalizeImage", "stoker.transforms.normalize"),
    ("stoker.transforms", "RandomHorizontalFlip", "stoker.transforms.flip"),
    ("stoker.transforms", "RandomTranslate", "stoker.transforms.translate"),
    ("stoker.transforms", "Squeeze", _TENSOR),
    ("stoker.transforms", "ToDevice", _DEVICE),
    ("stoker.transforms", "ToTensor", _TENSOR),
    ("stoker.transforms", "ToTorchImage", _TENSOR),
    ("stoker.transforms", "View", _TENSOR),
    ("stoker.transforms", "RandomBrightness", _COLOR),
    ("stoker.transforms", "RandomContrast", _COLOR),
    ("stoker.transforms", "RandomSaturation", _COLOR),
    ("stoker.transforms.color_jitter", "RandomBrightness", _COLOR),
    ("stoker.transforms.color_jitter", "RandomContrast", _COLOR),
    ("stoker.transforms.color_jitter", "RandomSaturation", _COLOR),
    ("stoker.transforms", "MixupToOneHot", "stoker.transforms.mixup_one_hot"),
    ("stoker.transforms", "Poison", "stoker.transforms.poisoning"),
    ("stoker.transforms", "RandomResizedCrop", "stoker.transforms.random_resized_crop"),
    ("stoker.transforms", "ReplaceLabel", "stoker.transforms.replace_label"),
    ("stoker.transforms.random_resized_crop", "RandomResizedCrop", "stoker.transforms.random_resized_crop"),
    ("stoker.transforms.poisoning", "Poison", "stoker.transforms.poisoning"),
    ("stoker.transforms.replace_label", "ReplaceLabel", "stoker.transforms.replace_label"),
    ("stoker.transforms.common", "Squeeze", _TENSOR),
    ("stoker.transforms.ops", "Convert", _TENSOR),
    ("stoker.transforms.ops", "ToDevice", _DEVICE),
    ("stoker.transforms.ops", "ToTensor", _TENSOR),
    ("stoker.transforms.ops", "ToTorchImage", _TENSOR),
    ("stoker.transforms.ops", "View", _TENSOR),
    ("stoker.transforms.cutout", "Cutout", "stoker.transforms.cutout"),
    ("stoker.transforms.flip", "RandomHorizontalFlip", "stoker.transforms.flip"),
    ("stoker.transforms.mixup", "ImageMixup", "stoker.transforms.mixup"),
    ("stoker.transforms.mixup", "LabelMixup", "stoker.transforms.mixup"),
    ("stoker.transforms.mixup", "MixupToOneHot", "stoker.transforms.mixup_one_hot"),
    ("stoker.transforms.module", "ModuleWrapper", "stoker.transforms.module"),
    ("stoker.transforms.normalize", "NormalizeImage", "stoker.transforms.normalize"),
    ("stoker.transforms.translate", "RandomTranslate", "stoker.transforms.translate"),
    # pipeline
    ("stoker.pipeline.allocation_query", "AllocationQuery", "stoker.pipeline.allocation_query"),
    ("stoker.pipeline.compiler", "Compiler", "stoker.pipeline.compiler"),
    ("stoker.pipeline.operation", "Operation", "stoker.pipeline.operation"),
    ("stoker.pipeline.state", "State", "stoker.pipeline.state"),
]


@pytest.mark.parametrize(("path", "name", "home"), FFCV_NAMES, ids=[f"{p}.{n}" for p, n, _ in FFCV_NAMES])
def test_ffcv_name_imports_from_ffcv_path(path: str, name: str, home: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from {path} import {name}", namespace)  # the statement an FFCV user writes, with ffcv -> stoker
    obj = namespace[name]
    defined = getattr(importlib.import_module(home), name)
    assert obj is defined, f"{path}.{name} is not {home}.{name}: a second implementation"
    assert getattr(obj, "__module__", None) == home


def test_table_has_no_duplicates() -> None:
    pairs = [(path, name) for path, name, _ in FFCV_NAMES]
    assert len(pairs) == len(set(pairs))


@pytest.mark.parametrize("path", ["stoker.fields.basics", "stoker.fields.bytes", "stoker.fields.ndarray", "stoker.fields.rgb_image"])
def test_schema_modules_raise_attribute_error_for_unknown_names(path: str) -> None:
    module = importlib.import_module(path)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchDecoder'"):
        module.NoSuchDecoder  # noqa: B018
    assert not hasattr(module, "NoSuchDecoder")


def test_schema_modules_do_not_import_the_pipeline_layer() -> None:
    """The decoder re-exports of the field modules are lazy: importing the schema loads no decoder or pipeline module."""
    code = (
        "import sys\n"
        "import stoker.fields.basics, stoker.fields.bytes, stoker.fields.json, stoker.fields.ndarray, stoker.fields.rgb_image\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('stoker.pipeline', 'stoker.decoders', 'stoker.fields.decoders')))\n"
        "assert not loaded, loaded\n"
        "from stoker.fields.basics import IntDecoder\n"
        "assert 'stoker.decoders.arrays' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
