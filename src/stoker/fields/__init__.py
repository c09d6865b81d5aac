"""Typed fields of a stoker dataset.

``from stoker.fields import NDArrayField, IntField`` works as in FFCV.
"""

from stoker.fields.base import Field
from stoker.fields.basics import FloatField, IntField
from stoker.fields.bytes import BytesField
from stoker.fields.json import JSONField
from stoker.fields.ndarray import NDArrayField
from stoker.fields.ragged import RaggedArrayField
from stoker.fields.rgb_image import RGBImageField
from stoker.fields.torch_tensor import TorchTensorField

#: field classes by the type name stored in the field table
FIELD_TYPES: dict[str, type[Field]] = {
    cls.TYPE_NAME: cls for cls in (IntField, FloatField, NDArrayField, BytesField, JSONField, RaggedArrayField, RGBImageField)
}

__all__ = [
    "FIELD_TYPES",
    "BytesField",
    "Field",
    "FloatField",
    "IntField",
    "JSONField",
    "NDArrayField",
    "RGBImageField",
    "RaggedArrayField",
    "TorchTensorField",
]
