"""Decoders: the operations that read a field's stored values into batch memory.

::

    _base.py      the decoder base class and its field-type check
    arrays.py     IntDecoder, FloatDecoder, NDArrayDecoder, BytesDecoder, RaggedArrayDecoder
    rgb_image.py  SimpleRGBImageDecoder, CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder

They sit above the fields' schema (:mod:`stoker.fields`), the pipeline's compiler
(:mod:`stoker.pipeline`) and the image kernels (:mod:`stoker.image`).
FFCV's paths (``stoker.fields.decoders``, ``stoker.fields.rgb_image``) re-export them.
"""

from stoker.decoders.arrays import BytesDecoder, FloatDecoder, IntDecoder, NDArrayDecoder, RaggedArrayDecoder
from stoker.decoders.rgb_image import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder

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
