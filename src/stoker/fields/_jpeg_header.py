"""Read a JPEG file's frame header without decoding it: can its bytes be stored as they are?

:func:`jpeg_info` walks the markers from SOI up to the first SOS and reads the
frame header (SOF): precision, size, components and their sampling factors,
the coding process (baseline, extended, progressive; Huffman or arithmetic),
and the Adobe APP14 colour transform. :func:`passthrough_problem` says why a
JPEG cannot be stored as-is by :class:`~stoker.fields.RGBImageField`, or
``None`` when it can: an 8-bit Huffman-coded baseline, extended or progressive
JPEG, 1 component (grayscale) or 3 components in YCbCr with one of
libjpeg-turbo's chroma subsamplings (4:4:4, 4:2:2, 4:2:0, 4:4:0, 4:1:1,
4:4:1), which ends with the EOI marker (a truncated file does not).

Reference: ITU-T T.81 (JPEG), B.1.1.3 (markers) and B.2.2 (frame header);
Adobe Technical Note 5116 (APP14).
"""

from __future__ import annotations

from dataclasses import dataclass

#: the SOF markers (frame headers) and their coding processes; 0xC4 (DHT), 0xC8 (JPG) and 0xCC (DAC) are not frames
_SOF = {
    0xC0: "baseline",
    0xC1: "extended",
    0xC2: "progressive",
    0xC3: "lossless",
    0xC5: "differential sequential",
    0xC6: "differential progressive",
    0xC7: "differential lossless",
    0xC9: "extended, arithmetic",
    0xCA: "progressive, arithmetic",
    0xCB: "lossless, arithmetic",
    0xCD: "differential sequential, arithmetic",
    0xCE: "differential progressive, arithmetic",
    0xCF: "differential lossless, arithmetic",
}
#: processes that libjpeg-turbo decodes in every build and that TurboJPEG crops and scales
_STORABLE = ("baseline", "extended", "progressive")
#: luma (horizontal, vertical) sampling factors of TurboJPEG's subsamplings, chroma being 1x1
_SUBSAMPLING = {(1, 1): "444", (2, 1): "422", (2, 2): "420", (1, 2): "440", (4, 1): "411", (1, 4): "441"}
#: markers without a length: SOI, EOI, TEM, RST0..RST7
_STANDALONE = {0xD8, 0xD9, 0x01, *range(0xD0, 0xD8)}


@dataclass(frozen=True)
class JpegInfo:
    """What a JPEG's frame header says.

    Attributes:
        height, width: the image's size [pixels] (height 0: defined later by a DNL marker).
        process: ``'baseline'``, ``'progressive'``, ... (see T.81, table B.1).
        precision: bits per sample (8 or 12 for lossy JPEG).
        components: ``(id, horizontal, vertical)`` sampling of each component.
        adobe_transform: the APP14 ``Adobe`` segment's colour transform (0: none,
            RGB or CMYK; 1: YCbCr; 2: YCCK), ``None`` without that segment.
        ends_with_eoi: the data ends with the EOI marker ``FF D9``.
    """

    height: int
    width: int
    process: str
    precision: int
    components: tuple[tuple[int, int, int], ...]
    adobe_transform: int | None
    ends_with_eoi: bool

    @property
    def subsampling(self) -> str | None:
        """``'gray'``, ``'420'``, ... or ``None`` when libjpeg-turbo's TurboJPEG has no name for it."""
        if len(self.components) == 1:
            return "gray"
        if len(self.components) == 3 and all((h, v) == (1, 1) for _, h, v in self.components[1:]):
            return _SUBSAMPLING.get(self.components[0][1:])
        return None


def jpeg_info(data: bytes | bytearray | memoryview) -> JpegInfo | None:
    """Parse the markers of ``data`` up to the first scan; ``None`` when it is not a JPEG with a frame header."""
    buf = data if isinstance(data, bytes) else bytes(data)  # indexing bytes is the quickest way through the markers
    n = len(buf)
    if n < 4 or buf[0] != 0xFF or buf[1] != 0xD8:
        return None
    pos, frame, adobe = 2, None, None
    while pos < n:
        if buf[pos] != 0xFF:
            return None  # garbage between segments
        pos += 1
        while pos < n and buf[pos] == 0xFF:  # fill bytes
            pos += 1
        if pos >= n:
            return None
        marker = buf[pos]
        pos += 1
        if marker in _STANDALONE:
            if marker == 0xD9:  # EOI before any scan
                return None
            continue
        if pos + 2 > n:
            return None
        length = (buf[pos] << 8) | buf[pos + 1]
        if length < 2 or pos + length > n:
            return None
        if marker == 0xDA:  # the first scan: every header before it has been seen
            break
        if marker in _SOF:
            segment = buf[pos + 2 : pos + length]
            if frame is not None or len(segment) < 6:
                return None  # two frames (hierarchical) or a short header
            count = segment[5]
            if len(segment) < 6 + 3 * count:
                return None
            comps = tuple((segment[6 + 3 * c], segment[7 + 3 * c] >> 4, segment[7 + 3 * c] & 15) for c in range(count))
            frame = (marker, segment[0], (segment[1] << 8) | segment[2], (segment[3] << 8) | segment[4], comps)
        elif marker == 0xEE and length >= 14 and buf.startswith(b"Adobe", pos + 2):
            adobe = buf[pos + 13]
        pos += length
    if frame is None:
        return None
    marker, precision, height, width, comps = frame
    return JpegInfo(
        height=height,
        width=width,
        process=_SOF[marker],
        precision=precision,
        components=comps,
        adobe_transform=adobe,
        ends_with_eoi=buf.endswith(b"\xff\xd9"),
    )


def passthrough_problem(info: JpegInfo, max_resolution: int | None) -> str | None:
    """Why a JPEG described by ``info`` must be decoded and re-encoded, or ``None`` when its bytes can be stored as they are."""
    if info.process not in _STORABLE:
        return f"a {info.process} JPEG"
    if info.precision != 8:
        return f"a {info.precision}-bit JPEG"
    if info.height == 0 or info.width == 0:
        return "a JPEG whose height is given by a DNL marker"
    if max_resolution is not None and max(info.height, info.width) > max_resolution:
        return f"larger than max_resolution={max_resolution}: {info.width}x{info.height}"
    if len(info.components) == 3:
        ids = tuple(c[0] for c in info.components)
        if info.adobe_transform == 0 or (info.adobe_transform is None and ids == (ord("R"), ord("G"), ord("B"))):
            return "an RGB (not YCbCr) JPEG"
    elif len(info.components) != 1:
        return f"a JPEG with {len(info.components)} components (CMYK or YCCK)"
    if info.subsampling is None:
        return f"a JPEG with sampling factors {[c[1:] for c in info.components]} that libjpeg-turbo cannot crop"
    if not info.ends_with_eoi:
        return "a JPEG that does not end with the EOI marker (truncated?)"
    return None
