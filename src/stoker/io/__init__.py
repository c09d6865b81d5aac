"""Image functions for :mod:`stoker.flow` stages, that release the GIL for the whole call.

``decode_image`` / ``decode_images`` decode JPEG with libjpeg-turbo and resize with the
Loader's kernels (other formats, and CMYK or YCCK JPEGs, through Pillow); ``resize``, ``normalize`` and
``to_tensor_batch`` work on images and NHWC batches. Threads running them decode
in parallel. The ``spdl.io`` names of SPDL's image examples (``demux_image``,
``decode_packets``, ``get_video_filter_desc``, ``convert_frames``, ``to_torch``) are
here too, so such code runs with ``spdl.io`` -> ``stoker.io``.

Compiled code is built on first use, never at import.
"""

from stoker.io._image import decode_image, decode_images, normalize, resize, to_tensor_batch
from stoker.io._spdl import FilterDesc, ImagePackets, convert_frames, decode_packets, demux_image, get_video_filter_desc, to_torch

__all__ = [
    "FilterDesc",
    "ImagePackets",
    "convert_frames",
    "decode_image",
    "decode_images",
    "decode_packets",
    "demux_image",
    "get_video_filter_desc",
    "normalize",
    "resize",
    "to_tensor_batch",
    "to_torch",
]
