"""Compatibility path: ``stoker.fields.decoders`` is :mod:`stoker.decoders.arrays` (moved in issue 31); kept for code that imports it."""

from stoker.decoders import (
    BytesDecoder,
    CenterCropRGBImageDecoder,
    FloatDecoder,
    IntDecoder,
    NDArrayDecoder,
    RaggedArrayDecoder,
    RandomResizedCropRGBImageDecoder,
    SimpleRGBImageDecoder,
)

__all__ = [
    "BytesDecoder",
    "CenterCropRGBImageDecoder",
    "FloatDecoder",
    "IntDecoder",
    "NDArrayDecoder",
    "RaggedArrayDecoder",
    "RandomResizedCropRGBImageDecoder",
    "SimpleRGBImageDecoder",
]
