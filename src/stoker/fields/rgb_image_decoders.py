"""Compatibility path: ``stoker.fields.rgb_image_decoders`` is :mod:`stoker.decoders.rgb_image` (moved in issue 31); kept for code that imports it."""

from stoker.decoders.rgb_image import (
    DEFAULT_CROP_RATIO,
    DEFAULT_MAX_SCRATCH_BYTES,
    JPEG_ROWS_OFFSET,
    KERNEL_FUNCTIONS,
    MODE_RAW,
    TJERR_WARNING,
    AllocationQuery,
    CenterCropRGBImageDecoder,
    PipelineError,
    RandomResizedCropRGBImageDecoder,
    SampleDecoder,
    SimpleRGBImageDecoder,
    State,
    TurboJPEG,
)

__all__ = [
    "DEFAULT_CROP_RATIO",
    "DEFAULT_MAX_SCRATCH_BYTES",
    "JPEG_ROWS_OFFSET",
    "KERNEL_FUNCTIONS",
    "MODE_RAW",
    "TJERR_WARNING",
    "AllocationQuery",
    "CenterCropRGBImageDecoder",
    "PipelineError",
    "RandomResizedCropRGBImageDecoder",
    "SampleDecoder",
    "SimpleRGBImageDecoder",
    "State",
    "TurboJPEG",
]
