"""Compatibility path: ``stoker.format.imagefolder`` is :mod:`stoker.convert.imagefolder` (moved in issue 31); kept for code that imports it."""

from stoker.convert.imagefolder import (
    CLASSES_SUFFIX,
    IMG_EXTENSIONS,
    SAMPLED_FOR_WORKERS,
    ConversionSummary,
    ImageFolderDataset,
    SampleError,
    available_cpus,
    convert_image_folder,
    find_bad_images,
    find_images,
    image_problem,
    load_image,
)

__all__ = [
    "CLASSES_SUFFIX",
    "IMG_EXTENSIONS",
    "SAMPLED_FOR_WORKERS",
    "ConversionSummary",
    "ImageFolderDataset",
    "SampleError",
    "available_cpus",
    "convert_image_folder",
    "find_bad_images",
    "find_images",
    "image_problem",
    "load_image",
]
