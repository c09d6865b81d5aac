"""RGB images, stored raw or as JPEG: :class:`RGBImageField`."""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

from stoker._splitmix import mix64
from stoker.fields._compat import reexport
from stoker.fields._jpeg_header import jpeg_info, passthrough_problem
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


def open_rgb(source: str | os.PathLike[str] | bytes) -> np.ndarray:
    """Decode an image file (a path or its bytes) with Pillow to an HWC uint8 RGB array, as torchvision's loader does.

    The pixels are those of ``Image.convert('RGB')``: grayscale, palette and
    CMYK become RGB, transparency is dropped (the colour under a transparent
    pixel is kept, not blended), EXIF orientation is not applied.

    Raises:
        Exception: whatever Pillow raises for a file it cannot read
            (``PIL.UnidentifiedImageError``, ``OSError`` for a truncated file, ...).
    """
    from PIL import Image

    with Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source) as img:
        if img.mode in ("P", "PA") and "transparency" in img.info:
            # the same RGB values as convert('RGB'), without Pillow's warning about palette transparency
            return np.asarray(img.convert("RGBA").convert("RGB"), dtype=np.uint8)
        return np.asarray(img.convert("RGB"), dtype=np.uint8)


def decode_image_file(source: str | os.PathLike[str] | bytes, name: str | None = None) -> np.ndarray:
    """:func:`open_rgb`, with Pillow's errors turned into a ``ValueError`` that names the file.

    Args:
        source: the file's path, or its bytes.
        name: how to name the file in errors (default: the path, or "the image bytes").

    Raises:
        ValueError: Pillow cannot decode it; the message names the file and Pillow's reason.
    """
    from PIL import UnidentifiedImageError

    what = name or ("the image bytes" if isinstance(source, (bytes, bytearray, memoryview)) else os.fspath(source))
    try:
        return open_rgb(source)
    except UnidentifiedImageError as exc:
        raise ValueError(f"cannot decode {what}: not an image that Pillow can identify") from exc
    except Exception as exc:  # Pillow raises many types for broken files (OSError, SyntaxError, ValueError, ...)
        raise ValueError(f"cannot decode {what}: {type(exc).__name__}: {exc}") from exc


def _read_file(path: str | os.PathLike[str]) -> bytes:
    try:  # os.open and one os.read: no buffered file object (a fifth of the time for a 50 KB file)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        try:
            size = os.fstat(fd).st_size
            data = os.read(fd, size + 1)  # one byte more: a file that grew, or a size of 0 (a pipe, /proc), reads on
            if size and len(data) == size:
                return data
            return data + _read_rest(fd) if data else data  # a short read, a file that grew, or no size known
        finally:
            os.close(fd)
    except OSError as exc:
        hint = " (a str or os.PathLike value is an image file's path; else give an HWC uint8 array, a PIL image or the file's bytes)"
        raise ValueError(f"cannot read the image file {os.fspath(path)!r}: {exc.strerror or exc}{hint}") from exc


def _read_rest(fd: int) -> bytes:
    """What is left to read from ``fd`` up to its end."""
    parts = []
    while chunk := os.read(fd, 1 << 20):
        parts.append(chunk)
    return b"".join(parts)


def _pixels_loaded(image: Any) -> bool:
    """Whether a PIL image has decoded its pixels (which may then have been edited in place)."""
    state = vars(image)
    return state.get("_im", state.get("im")) is not None  # Pillow >= 11 keeps them in ``_im``, older ones in ``im``


def _pil_jpeg_bytes(image: Any) -> bytes | None:
    """The bytes of the JPEG file a PIL image was opened from, while its pixels are still those of the file; else ``None``."""
    if getattr(image, "format", None) != "JPEG":
        return None
    fp = getattr(image, "fp", None)
    if fp is not None and hasattr(fp, "getvalue"):  # opened from a BytesIO
        data = bytes(fp.getvalue())
    elif getattr(image, "filename", ""):
        try:
            data = _read_file(image.filename)
        except ValueError:
            return None  # the file is gone: the pixels already in memory are what the user has
    else:
        return None
    if _pixels_loaded(image):  # decoded, perhaps edited in place since: store the file only if the pixels are still its own
        from PIL import Image

        with Image.open(io.BytesIO(data)) as source:
            if source.size != image.size or source.mode != image.mode or not np.array_equal(np.asarray(source), np.asarray(image)):
                return None
    else:  # not decoded yet: its pixels are the file's, unless draft() asked for a reduced size or mode
        info = jpeg_info(data)
        if info is None or image.size != (info.width, info.height) or image.mode != ("L" if len(info.components) == 1 else "RGB"):
            return None
    return data


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

    A value is an HWC (or HW) uint8 array or tensor, a PIL image, an image
    file's path (``str`` or ``os.PathLike``) or its bytes (see :meth:`encode`).
    A JPEG file that is to be stored as JPEG is kept as it is, byte for byte,
    when it can be: no quality is lost and no time spent re-encoding it.

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

    def _use_jpeg(self, nbytes: int, index: int) -> bool:
        """Whether the write mode asks for a JPEG of an image of ``nbytes`` raw bytes (``smart`` then also compares sizes)."""
        if self.write_mode == "jpg":
            return True
        if self.write_mode == "proportion":
            return int(mix64(np.asarray(index, dtype=np.uint64))) / 2.0**64 < self.compress_probability
        if self.write_mode == "smart":
            return nbytes > self.smart_threshold
        return False

    def encode(self, value: Any, index: int) -> tuple[dict[str, Any], bytes | None]:
        """Encode one image: an HWC uint8 array (or tensor), a PIL image, an image file's path or its bytes.

        A JPEG file (a path, its bytes, or a PIL image opened from it and not
        modified) that the write mode stores as JPEG is stored as its original
        bytes, without decoding, when libjpeg-turbo can decode, crop and scale
        it as it is and it fits ``max_resolution`` (see
        :func:`~stoker.fields._jpeg_header.passthrough_problem`). Any other file
        is decoded as torchvision's loader does (``convert('RGB')``, alpha dropped)
        and encoded as an array.
        """
        data: bytes | None = None
        if isinstance(value, (str, os.PathLike)):
            data = _read_file(value)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            data = bytes(value)
        elif hasattr(value, "mode") and hasattr(value, "convert"):
            jpeg = _pil_jpeg_bytes(value)
            stored = None if jpeg is None else self._stored_as_is(jpeg, index)
            if stored is not None:
                return stored
        if data is not None:
            stored = self._stored_as_is(data, index)
            if stored is not None:
                return stored
            name = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
            value = decode_image_file(data, name)
        image = to_rgb_array(value)
        if self.max_resolution is not None:
            image = resize_to_max(image, self.max_resolution)
        h, w = image.shape[:2]
        mode, payload = MODE_RAW, image.tobytes()
        if self._use_jpeg(image.nbytes, index):
            jpeg = encode_jpeg(image, self.jpeg_quality)
            if self.write_mode != "smart" or len(jpeg) < len(payload):
                mode, payload = MODE_JPEG, jpeg
        return {"height": h, "width": w, "mode": mode}, payload

    def stores_as_is(self, data: bytes, index: int = 0) -> bool:
        """Whether :meth:`encode` stores these file bytes as they are (no decoding) as sample ``index``."""
        return self._stored_as_is(data, index) is not None

    def _stored_as_is(self, data: bytes, index: int) -> tuple[dict[str, Any], bytes] | None:
        """``(metadata, data)`` when ``data`` is a JPEG file to store unchanged; ``None`` when it must be decoded."""
        info = jpeg_info(data)
        if info is None or passthrough_problem(info, self.max_resolution) is not None:
            return None
        raw = info.height * info.width * 3
        if not self._use_jpeg(raw, index) or (self.write_mode == "smart" and len(data) >= raw):
            return None
        return {"height": info.height, "width": info.width, "mode": MODE_JPEG}, data

    def read_one(self, meta: np.void, payload: Any) -> np.ndarray:
        h, w = int(meta["height"]), int(meta["width"])
        if int(meta["mode"]) == MODE_JPEG:
            image = decode_jpeg(payload)
            if image.shape != (h, w, 3):
                raise ValueError(f"JPEG decodes to shape {image.shape}, metadata says {(h, w, 3)}")
            return image
        return np.frombuffer(bytes(payload), dtype=np.uint8).reshape(h, w, 3)

    def default_decoder(self) -> Any:
        from stoker.decoders.rgb_image import SimpleRGBImageDecoder

        return SimpleRGBImageDecoder()


#: FFCV's decoders of this module, defined in the pipeline layer and re-exported lazily (see :mod:`stoker.fields._compat`)
_REEXPORTS = {
    "CenterCropRGBImageDecoder": "stoker.decoders.rgb_image",
    "RandomResizedCropRGBImageDecoder": "stoker.decoders.rgb_image",
    "SimpleRGBImageDecoder": "stoker.decoders.rgb_image",
}


def __getattr__(name: str) -> Any:
    """``from stoker.fields.rgb_image import CenterCropRGBImageDecoder`` as in FFCV: the decoder class itself, imported on first use."""
    return reexport(__name__, name, _REEXPORTS)
