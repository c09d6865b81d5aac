"""Image functions for flow stages: decode, resize, batch, normalize; the work runs without the GIL."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

import numba
import numpy as np

from stoker import _numba_cache
from stoker.io import _jpeg

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only

ImageSource = bytes | bytearray | memoryview | np.ndarray | str | os.PathLike[str]

_JPEG_MAGIC = b"\xff\xd8\xff"


def _size(size: Any) -> tuple[int, int] | None:
    if size is None:
        return None
    if isinstance(size, (int, np.integer)):
        size = (size, size)
    try:
        h, w = (int(s) for s in size)
        whole = all(s == int(s) for s in size)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"size must be None, an int or (height, width); got {size!r}") from None
    if not whole:
        raise ValueError(f"size must be whole numbers of pixels (height, width); got {size!r}")
    if h < 1 or w < 1:
        raise ValueError(f"size must be positive (height, width); got {size!r}")
    return h, w


def _bytes(item: ImageSource) -> np.ndarray:
    """The encoded image as a uint8 array (a file is read: I/O releases the GIL)."""
    if isinstance(item, (str, os.PathLike)):
        with open(item, "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8)
    if isinstance(item, np.ndarray):
        if item.dtype != np.uint8 or item.ndim != 1:
            raise ValueError(f"encoded image arrays must be 1-D uint8; got {item.ndim}-D {item.dtype}")
        return np.ascontiguousarray(item)
    if isinstance(item, (bytes, bytearray, memoryview)):
        return np.frombuffer(item, dtype=np.uint8)
    raise TypeError(f"an image is bytes, a 1-D uint8 array or a path; got {type(item).__name__}")


def _name(item: ImageSource) -> str | None:
    """The path of an item given as one (errors name it), else ``None``."""
    return os.fspath(item) if isinstance(item, (str, os.PathLike)) else None


def _is_jpeg(data: np.ndarray) -> bool:
    return data.shape[0] >= 3 and bytes(data[:3]) == _JPEG_MAGIC


def _pillow(data: np.ndarray) -> np.ndarray:
    """Any format Pillow reads, as HWC uint8 RGB (Pillow releases the GIL while it decodes)."""
    from PIL import Image

    with Image.open(io.BytesIO(data.tobytes())) as img:
        return np.asarray(img.convert("RGB"))


def decode_image(
    data_or_path: ImageSource,
    size: int | tuple[int, int] | None = None,
    crop: tuple[int, int, int, int] | None = None,
    *,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Decode one image to HWC uint8 RGB, optionally cropped then resized.

    JPEG is decoded by libjpeg-turbo (at 1/2, 1/4 or 1/8 scale in the DCT domain when
    the output is that much smaller) and resized by the Loader's kernels (area
    averaging when shrinking, bilinear when enlarging), with the GIL released for the
    whole call: N threads decode N images at once. Other formats go through Pillow, and so
    do the JPEGs libjpeg-turbo cannot read: CMYK and YCCK ones (it does not convert them to
    RGB), and any it stops at that Pillow reads (e.g. with a corrupt-data warning).

    Args:
        data_or_path: the encoded bytes (``bytes``, a 1-D uint8 array) or a file's path.
        size: the output's ``(height, width)`` (or an int for a square); ``None``: the crop's size.
        crop: ``(y, x, height, width)`` of the region to keep [pixels of the source]; ``None``: all of it.
        out: an array of the output's shape to write into (e.g. one image of a batch).

    Returns:
        ``(height, width, 3)`` uint8 (``out`` itself when it is given as one image).

    Raises:
        ValueError: neither libjpeg-turbo nor Pillow can decode the data (their messages),
            or ``size`` / ``crop`` / ``out`` do not fit.

    Example:
        >>> import io, numpy as np
        >>> from PIL import Image
        >>> buf = io.BytesIO()
        >>> Image.fromarray(np.full((40, 60, 3), 128, np.uint8)).save(buf, format="JPEG", quality=90)
        >>> decode_image(buf.getvalue(), size=(20, 30)).shape
        (20, 30, 3)
    """
    data = _bytes(data_or_path)
    if _is_jpeg(data) and (out is None or out.ndim == 3):  # the one-image path: two compiled calls, no per-call arrays
        image = _jpeg.decode_one(data, _size(size), crop, out)
        if image is not None:
            return image
    if out is not None:
        batch = out[None] if out.ndim == 3 else out
    else:
        batch = None
    image = _decode_many([data], [_name(data_or_path)], size, None if crop is None else [crop], batch)[0]
    return out if out is not None and out.ndim == 3 else image


def decode_images(
    items: Sequence[ImageSource],
    size: int | tuple[int, int] | None = None,
    crops: Sequence[tuple[int, int, int, int] | None] | None = None,
    *,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Decode images into one ``(n, height, width, 3)`` uint8 batch, allocated once.

    The JPEGs are decoded in one compiled call without the GIL (see :func:`decode_image`);
    other formats, and JPEGs libjpeg-turbo cannot read (CMYK, YCCK), go through Pillow, one by one.

    Args:
        items: encoded images (bytes, 1-D uint8 arrays or paths).
        size: the output's ``(height, width)`` or an int; ``None`` needs every image (or crop)
            to have one size.
        crops: one ``(y, x, height, width)`` or ``None`` per image.
        out: a ``(n, height, width, 3)`` uint8 array to write into.

    Returns:
        The batch, ``out`` if given.

    Raises:
        ValueError: an item is not a decodable image (named by its position, and its path when
            given one), sizes differ with ``size=None``, or ``crops`` / ``out`` do not fit.
        TypeError: ``items`` is one image (a path, bytes) rather than a sequence of them.
    """
    if isinstance(items, (str, bytes, bytearray, memoryview, os.PathLike)):
        raise TypeError(f"decode_images() needs a sequence of images; got one {type(items).__name__}: use decode_image() for one")
    return _decode_many([_bytes(item) for item in items], [_name(item) for item in items], size, crops, out)


def _decode_many(
    arrays: list[np.ndarray],
    names: list[str | None],
    size: int | tuple[int, int] | None,
    crops: Sequence[tuple[int, int, int, int] | None] | None,
    out: np.ndarray | None,
) -> np.ndarray:
    """:func:`decode_images` of the items' bytes ``arrays``; ``names``: their paths (or ``None``), for the errors."""
    target = _size(size)
    n = len(arrays)

    def where(i: int) -> str:
        return f"{names[i]}: item {i}" if names[i] is not None else f"item {i}"

    if crops is not None and len(crops) != n:
        raise ValueError(f"crops must have one entry per image ({n}); got {len(crops)}")
    jpeg = [i for i, a in enumerate(arrays) if _is_jpeg(a)]
    others = {i: _pillow_checked(arrays[i], where(i), "not a JPEG") for i in range(n) if not _is_jpeg(arrays[i])}
    dims = np.zeros((n, 2), dtype=np.int64)
    if jpeg:
        info, failed = _jpeg.jpeg_headers([arrays[i] for i in jpeg])
        for k, i in enumerate(jpeg):
            if k in failed:
                others[i] = _pillow_checked(arrays[i], where(i), f"not a readable JPEG: {failed[k]}")
            elif info[k, 2] in _jpeg.NOT_RGB_COLORSPACES:
                others[i] = _pillow_checked(arrays[i], where(i), "a CMYK or YCCK JPEG (libjpeg-turbo does not convert those to RGB)")
            else:
                dims[i] = info[k, :2]
        jpeg = [i for i in jpeg if i not in others]
    for i, img in others.items():
        dims[i] = img.shape[:2]
    boxes = np.zeros((n, 4), dtype=np.float64)
    for i in range(n):
        h, w = int(dims[i, 0]), int(dims[i, 1])
        c = crops[i] if crops is not None else None
        boxes[i] = _jpeg.check_crop(c, h, w) if c is not None else (0, 0, h, w)
    if target is None:
        shapes = {(int(b[2]), int(b[3])) for b in boxes}
        if len(shapes) > 1:
            raise ValueError(f"size=None needs images (or crops) of one size; got {sorted(shapes)[:4]}: pass size=(height, width)")
        target = shapes.pop() if shapes else (1, 1)
    shape = (n, target[0], target[1], 3)
    if out is None:
        out = np.empty(shape, dtype=np.uint8)
    elif out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous uint8 array of shape {shape}; got {out.dtype} {out.shape}")
    if jpeg:
        sub = out if len(jpeg) == n else np.empty((len(jpeg), *shape[1:]), dtype=np.uint8)
        failed = _jpeg.decode_jpegs([arrays[i] for i in jpeg], dims[jpeg], boxes[jpeg], sub)
        for k, message in failed.items():  # data libjpeg-turbo stops at (a warning is a failure) may be Pillow's to read
            i = jpeg[k]
            img = _pillow_checked(arrays[i], where(i), f"JPEG decoding failed: {message}")
            if img.shape[:2] != tuple(dims[i]):
                raise ValueError(f"{where(i)}: JPEG decoding failed: {message}; Pillow reads it as {img.shape[:2]}, not {tuple(dims[i])}")
            _jpeg.resize_into(img, tuple(boxes[i]), sub[k])
        if sub is not out:
            out[jpeg] = sub
    for i, img in others.items():
        _jpeg.resize_into(img, tuple(boxes[i]), out[i])
    return out


def _pillow_checked(data: np.ndarray, where: str, why: str) -> np.ndarray:
    """An item (``where``: its position, and path) read by Pillow, which it falls to because it is ``why``."""
    from PIL import UnidentifiedImageError

    try:
        return _pillow(data)
    except UnidentifiedImageError:  # (its message names Pillow's in-memory file, not the image)
        raise ValueError(f"{where}: {why}, and Pillow cannot read it: not an image format it knows") from None
    except Exception as exc:
        raise ValueError(f"{where}: {why}, and Pillow cannot read it: {type(exc).__name__}: {exc}") from None


def resize(
    image: np.ndarray,
    size: int | tuple[int, int],
    crop: tuple[int, int, int, int] | None = None,
    *,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Resize (the ``crop`` of) an HWC uint8 RGB image: area averaging when shrinking, bilinear when enlarging.

    Runs without the GIL.

    Args:
        image: ``(h, w, 3)`` uint8.
        size: ``(height, width)`` of the output, or an int.
        crop: ``(y, x, height, width)`` to keep first.
        out: an array of the output's shape to write into.

    Raises:
        ValueError: ``image`` is not HWC uint8 with 3 channels or is empty, or ``size`` / ``crop`` do not fit.
    """
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(
            f"resize() needs an (h, w, 3) uint8 array; got {getattr(image, 'dtype', type(image).__name__)} {getattr(image, 'shape', '')}"
        )
    if image.shape[0] < 1 or image.shape[1] < 1:
        raise ValueError(f"resize() needs a non-empty image; got shape {image.shape}")
    target = _size(size)
    if target is None:
        raise ValueError("resize() needs a size: (height, width) or an int; got None")
    h, w = int(image.shape[0]), int(image.shape[1])
    box = _jpeg.check_crop(crop, h, w) if crop is not None else (0, 0, h, w)
    shape = (target[0], target[1], 3)
    if out is None:
        out = np.empty(shape, dtype=np.uint8)
    elif out.shape != shape or out.dtype != np.uint8:
        raise ValueError(f"out must be uint8 of shape {shape}; got {out.dtype} {out.shape}")
    _jpeg.resize_into(image, (float(box[0]), float(box[1]), float(box[2]), float(box[3])), out)
    return out


@numba.njit(nogil=True, cache=True)
def _normalize_chw(src, a, b, dst):  # type: ignore[no-untyped-def]
    n, h, w = src.shape[0], src.shape[1], src.shape[2]
    for i in range(n):
        for c in range(3):
            ac, bc = a[c], b[c]
            for y in range(h):
                for x in range(w):
                    dst[i, c, y, x] = src[i, y, x, c] * ac + bc


@numba.njit(nogil=True, cache=True)
def _normalize_planar(src, a, b, dst):  # type: ignore[no-untyped-def]
    """NCHW uint8 -> NCHW float32, ``src * a[c] + b[c]``: plane by contiguous plane."""
    n, c, h, w = src.shape
    hw = numba.uint64(h * w)
    flat_src = src.reshape(-1)
    flat_dst = dst.reshape(-1)
    for i in range(n):
        for k in range(c):
            ak, bk = a[k], b[k]
            base = numba.uint64(i * c + k) * hw
            for p in range(hw):
                flat_dst[base + p] = flat_src[base + p] * ak + bk


@numba.njit(nogil=True, cache=True)
def _normalize_hwc(src, a, b, dst):  # type: ignore[no-untyped-def]
    flat_src = src.reshape((-1, 3))
    flat_dst = dst.reshape((-1, 3))
    for p in range(flat_src.shape[0]):
        for c in range(3):
            flat_dst[p, c] = flat_src[p, c] * a[c] + b[c]


def normalize(
    batch: Any,
    mean: Sequence[float],
    std: Sequence[float],
    *,
    scale: float = 1 / 255,
    channels_first: bool = True,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``(batch * scale - mean) / std`` of an NHWC uint8 batch, as float32, without the GIL.

    With the defaults this is ``torchvision.transforms.Normalize(mean, std)`` applied to
    ``batch.float() / 255``: ``mean`` and ``std`` are in units of ``scale`` (ImageNet's
    ``(0.485, 0.456, 0.406)``, ``(0.229, 0.224, 0.225)``).

    Args:
        batch: ``(n, h, w, 3)`` uint8 (a numpy array or a CPU tensor).
        mean: per channel.
        std: per channel, non-zero.
        scale: the factor applied to the pixels first.
        channels_first: return ``(n, 3, h, w)`` (else ``(n, h, w, 3)``).
        out: a float32 array of the output's shape to write into.

    Raises:
        ValueError: the batch is not NHWC uint8 with 3 channels, or a std is 0.
    """
    src = batch.numpy() if hasattr(batch, "numpy") and not isinstance(batch, np.ndarray) else np.asarray(batch)
    if src.dtype != np.uint8 or src.ndim != 4 or src.shape[3] != 3:
        raise ValueError(f"normalize() needs an (n, h, w, 3) uint8 batch; got {src.dtype} {src.shape}")
    m, s = np.asarray(mean, np.float64).reshape(-1), np.asarray(std, np.float64).reshape(-1)
    if m.shape != (3,) or s.shape != (3,) or (s == 0).any():
        raise ValueError(f"mean and std need 3 values each, std non-zero; got {list(m)}, {list(s)}")
    a = (scale / s).astype(np.float32)
    b = (-m / s).astype(np.float32)
    n, h, w, _ = src.shape
    shape = (n, 3, h, w) if channels_first else (n, h, w, 3)
    if out is None:
        out = np.empty(shape, dtype=np.float32)
    elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 array of shape {shape}; got {out.dtype} {out.shape}")
    if channels_first and not src.flags.c_contiguous and src.transpose(0, 3, 1, 2).flags.c_contiguous:
        _normalize_planar(src.transpose(0, 3, 1, 2), a, b, out)  # a batch held channels-first (convert_frames)
        return out
    src = np.ascontiguousarray(src)
    (_normalize_chw if channels_first else _normalize_hwc)(src, a, b, out)
    return out


def to_tensor_batch(batch: Any, *, channels_first: bool = True, contiguous: bool = False) -> Any:
    """An NHWC numpy batch as a torch tensor, sharing its memory.

    Args:
        batch: ``(n, h, w, c)`` array (uint8 from :func:`decode_images`, or any dtype).
        channels_first: give ``(n, c, h, w)`` (a permuted view, as ``tensor.permute(0, 3, 1, 2)``).
        contiguous: copy into a contiguous tensor of that layout.

    Raises:
        ValueError: the batch is not 4-D.
    """
    import torch

    arr = np.asarray(batch)
    if arr.ndim != 4:
        raise ValueError(f"to_tensor_batch() needs an (n, h, w, c) batch; got shape {arr.shape}")
    # (a batch held channels-first, from convert_frames, keeps its memory: its NCHW permutation is contiguous)
    tensor = torch.from_numpy(arr if all(s >= 0 for s in arr.strides) else np.ascontiguousarray(arr))
    if channels_first:
        tensor = tensor.permute(0, 3, 1, 2)
    return tensor.contiguous() if contiguous else tensor
