"""RGB images, stored raw or as JPEG: :class:`RGBImageField`."""

from __future__ import annotations

from typing import Any

import numpy as np

from stoker._splitmix import mix64
from stoker.fields._compat import reexport
from stoker.fields.base import Field

MODE_RAW = 0
MODE_JPEG = 1
WRITE_MODES = ("raw", "jpg", "smart", "proportion")


def to_rgb_array(value: Any) -> np.ndarray:
    """Turn a PIL image or an array into a C-contiguous HWC uint8 RGB array.

    Grayscale (``HW``, ``HW1``, PIL ``L``/``1``/``P`` without transparency,
    ``CMYK``, ``YCbCr``) is converted to RGB. Images with alpha are rejected:
    dropping transparency silently would change the picture.

    Raises:
        TypeError: not an image, or a dtype other than uint8.
        ValueError: a shape or PIL mode that is not an RGB picture.
    """
    if hasattr(value, "mode") and hasattr(value, "convert"):  # a PIL image
        mode = value.mode
        if mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode == "P" and "transparency" in value.info):
            raise ValueError(
                f"expected an RGB image; got a PIL image of mode '{mode}' with alpha: call image.convert('RGB') yourself to choose how to drop transparency"
            )
        if mode not in ("RGB", "L", "1", "P", "CMYK", "YCbCr"):
            raise ValueError(f"expected an RGB image; got a PIL image of mode '{mode}', which has no lossless RGB form: convert it first")
        if mode != "RGB":
            value = value.convert("RGB")
        return np.asarray(value, dtype=np.uint8).copy(order="C")
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        value = value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(f"expected an HWC uint8 array or a PIL image; got {type(value).__name__}")
    if value.dtype != np.uint8:
        raise TypeError(f"expected an HWC uint8 array; got dtype {value.dtype} (scale and cast to uint8 first)")
    if value.ndim == 2 or (value.ndim == 3 and value.shape[2] == 1):
        value = np.repeat(value.reshape(value.shape[0], value.shape[1], 1), 3, axis=2)
    if value.ndim != 3 or value.shape[2] != 3:
        hint = " (4 channels: RGBA; drop or blend alpha first)" if value.ndim == 3 and value.shape[2] == 4 else ""
        hint = hint or (" (looks like CHW: transpose to HWC)" if value.ndim == 3 and value.shape[0] == 3 else "")
        raise ValueError(f"expected an HWC RGB image of shape (height, width, 3); got shape {value.shape}{hint}")
    if value.shape[0] == 0 or value.shape[1] == 0:
        raise ValueError(f"expected a non-empty image; got shape {value.shape}")
    return np.ascontiguousarray(value)


def resize_to_max(image: np.ndarray, max_resolution: int) -> np.ndarray:
    """Downscale so that the longer side is ``max_resolution`` (area interpolation)."""
    h, w = image.shape[:2]
    if max(h, w) <= max_resolution:
        return image
    from PIL import Image

    scale = max_resolution / max(h, w)
    new_w, new_h = max(1, round(w * scale)), max(1, round(h * scale))
    return np.asarray(Image.fromarray(image).resize((new_w, new_h), Image.Resampling.BOX))


def encode_jpeg(image: np.ndarray, quality: int) -> bytes:
    """JPEG-encode an HWC uint8 RGB array with libjpeg-turbo (4:2:0 subsampling)."""
    import simplejpeg

    return bytes(simplejpeg.encode_jpeg(image, quality=quality, colorspace="RGB", colorsubsampling="420"))


def decode_jpeg(data: bytes | memoryview | np.ndarray) -> np.ndarray:
    """Decode JPEG bytes to an HWC uint8 RGB array (libjpeg-turbo, accurate DCT)."""
    import simplejpeg

    return simplejpeg.decode_jpeg(bytes(data), colorspace="RGB", fastdct=False, fastupsample=False)


class RGBImageField(Field):
    """An RGB image per sample, of any size, stored raw or as JPEG.

    Args:
        write_mode: ``'raw'`` (uncompressed), ``'jpg'`` (always JPEG),
            ``'smart'`` (JPEG when the raw image is larger than
            ``smart_threshold`` bytes and the JPEG is smaller) or
            ``'proportion'`` (JPEG with probability ``compress_probability``,
            drawn from the sample index, so reproducible).
        max_resolution: if set, images whose longer side exceeds it are
            downscaled (area interpolation) so that the longer side equals it.
        jpeg_quality: libjpeg quality, 1..100.
        compress_probability: used by ``'proportion'``.
        smart_threshold: used by ``'smart'`` [bytes].
    """

    TYPE_NAME = "rgb_image"
    storage = "heap"

    def __init__(
        self,
        write_mode: str = "raw",
        max_resolution: int | None = None,
        jpeg_quality: int = 90,
        compress_probability: float = 0.5,
        smart_threshold: int = 64 * 64 * 3,
    ) -> None:
        if write_mode not in WRITE_MODES:
            raise ValueError(f"write_mode must be one of {WRITE_MODES}; got {write_mode!r}")
        if max_resolution is not None and int(max_resolution) < 1:
            raise ValueError(f"max_resolution must be >= 1 or None; got {max_resolution}")
        if not 1 <= int(jpeg_quality) <= 100:
            raise ValueError(f"jpeg_quality must be in 1..100; got {jpeg_quality}")
        if not 0.0 <= float(compress_probability) <= 1.0:
            raise ValueError(f"compress_probability must be in [0, 1]; got {compress_probability}")
        self.write_mode = write_mode
        self.max_resolution = None if max_resolution is None else int(max_resolution)
        self.jpeg_quality = int(jpeg_quality)
        self.compress_probability = float(compress_probability)
        self.smart_threshold = int(smart_threshold)

    def metadata_columns(self) -> list[tuple[str, str]]:
        return [("ptr", "<u8"), ("size", "<u8"), ("height", "<u4"), ("width", "<u4"), ("mode", "u1")]

    def to_args(self) -> dict[str, Any]:
        return {
            "write_mode": self.write_mode,
            "max_resolution": self.max_resolution,
            "jpeg_quality": self.jpeg_quality,
            "compress_probability": self.compress_probability,
            "smart_threshold": self.smart_threshold,
        }

    def _use_jpeg(self, image: np.ndarray, index: int) -> bool:
        if self.write_mode == "jpg":
            return True
        if self.write_mode == "proportion":
            return int(mix64(np.asarray(index, dtype=np.uint64))) / 2.0**64 < self.compress_probability
        if self.write_mode == "smart":
            return image.nbytes > self.smart_threshold
        return False

    def encode(self, value: Any, index: int) -> tuple[dict[str, Any], bytes | None]:
        image = to_rgb_array(value)
        if self.max_resolution is not None:
            image = resize_to_max(image, self.max_resolution)
        h, w = image.shape[:2]
        mode, payload = MODE_RAW, image.tobytes()
        if self._use_jpeg(image, index):
            jpeg = encode_jpeg(image, self.jpeg_quality)
            if self.write_mode != "smart" or len(jpeg) < len(payload):
                mode, payload = MODE_JPEG, jpeg
        return {"height": h, "width": w, "mode": mode}, payload

    def read_one(self, meta: np.void, payload: Any) -> np.ndarray:
        h, w = int(meta["height"]), int(meta["width"])
        if int(meta["mode"]) == MODE_JPEG:
            image = decode_jpeg(payload)
            if image.shape != (h, w, 3):
                raise ValueError(f"JPEG decodes to shape {image.shape}, metadata says {(h, w, 3)}")
            return image
        return np.frombuffer(bytes(payload), dtype=np.uint8).reshape(h, w, 3)

    def default_decoder(self) -> Any:
        from stoker.fields.rgb_image_decoders import SimpleRGBImageDecoder

        return SimpleRGBImageDecoder()


#: FFCV's decoders of this module, defined in the pipeline layer and re-exported lazily (see :mod:`stoker.fields._compat`)
_REEXPORTS = {
    "CenterCropRGBImageDecoder": "stoker.fields.rgb_image_decoders",
    "RandomResizedCropRGBImageDecoder": "stoker.fields.rgb_image_decoders",
    "SimpleRGBImageDecoder": "stoker.fields.rgb_image_decoders",
}


def __getattr__(name: str) -> Any:
    """``from stoker.fields.rgb_image import CenterCropRGBImageDecoder`` as in FFCV: the decoder class itself, imported on first use."""
    return reexport(__name__, name, _REEXPORTS)
