"""libjpeg-turbo's TurboJPEG 3 API, called from compiled code through ctypes.

The library comes from a wheel: ``turbojpeg==0.0.2`` (pinned in
``pyproject.toml``) bundles libjpeg-turbo 3's ``libturbojpeg.so`` as
``turbojpeg.libs/libturbojpeg-<hash>.so.0.3.0``, a file its ``RECORD`` lists;
no system library or compiler is needed. Every ``tj3`` function used is looked
up at load, so another layout or an older library fails there, with its path,
rather than in compiled code.

Pointers are passed as ``size_t``; the small structs TurboJPEG takes by value
(``tjscalingfactor``, ``tjregion``) are passed as packed 64-bit integers,
which is how the x86-64 and AArch64 calling conventions pass them.

Everything here is loaded on first use, never at import.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
from functools import cache
from typing import Any

from stoker.errors import PipelineError

#: the distribution that bundles the library, and the pattern of the library's path inside it
DISTRIBUTION = "turbojpeg"
_LIBRARY_DIR = "turbojpeg.libs"
_LIBRARY_PREFIX = "libturbojpeg"

TJINIT_DECOMPRESS = 1
TJPARAM_SUBSAMP = 4
TJPARAM_JPEGWIDTH = 5
TJPARAM_JPEGHEIGHT = 6
TJPARAM_COLORSPACE = 8
TJPARAM_FASTUPSAMPLE = 9
TJPARAM_FASTDCT = 10
TJPF_RGB = 0
#: TJCS values (tj3Get(TJPARAM_COLORSPACE)): libjpeg-turbo converts RGB, YCbCr and GRAY JPEGs to RGB, not CMYK or YCCK ones
TJCS_RGB, TJCS_YCBCR, TJCS_GRAY, TJCS_CMYK, TJCS_YCCK = 0, 1, 2, 3, 4
#: tj3GetErrorCode: the call went wrong but produced an image that may be corrupt / the call failed
TJERR_WARNING, TJERR_FATAL = 0, 1
#: bytes of libjpeg-turbo's error messages, NUL included (JMSG_LENGTH_MAX)
ERROR_MESSAGE_BYTES = 200
#: libjpeg's largest image side [pixels] (JPEG_MAX_DIMENSION)
JPEG_MAX_DIMENSION = 65535
#: where memory libjpeg-turbo decodes into should start [bytes past a 64-byte boundary]: its x86 colour conversion
#: (jsimd_ycc_*_convert, SSE2 and AVX2) writes a row that starts on a 16- or 32-byte boundary with non-temporal stores,
#: which bypass the cache, so the operation that reads the pixels next finds them in memory (measured: 32x32 JPEGs
#: decoded into a batch that starts on such a boundary, 110,000-133,000 images/s; 8 or 16 bytes past one, 157,000-173,000)
JPEG_ROWS_OFFSET = 8
#: iMCU width in pixels for each TJSAMP value (444, 422, 420, GRAY, 440, 411, 441)
MCU_WIDTH = (8, 16, 16, 8, 8, 32, 8)

#: (name, argument types, result type) of every function used; ``p`` is a pointer or handle
_P, _I = ctypes.c_size_t, ctypes.c_int
_FUNCTIONS: tuple[tuple[str, list[Any], Any], ...] = (
    ("tj3Init", [_I], _P),
    ("tj3Destroy", [_P], None),
    ("tj3Set", [_P, _I, _I], _I),
    ("tj3Get", [_P, _I], _I),
    ("tj3DecompressHeader", [_P, _P, _P], _I),
    ("tj3SetScalingFactor", [_P, ctypes.c_uint64], _I),
    ("tj3SetCroppingRegion", [_P, ctypes.c_uint64, ctypes.c_uint64], _I),
    ("tj3Decompress8", [_P, _P, _P, _P, _I, _I], _I),
    ("tj3GetErrorStr", [_P], _P),
    ("tj3GetErrorCode", [_P], _I),
)
#: the functions compiled kernels call, in the order of their pointer array (see ``_kernels``)
KERNEL_FUNCTIONS = (
    "tj3DecompressHeader",
    "tj3Get",
    "tj3SetScalingFactor",
    "tj3SetCroppingRegion",
    "tj3Decompress8",
    "tj3GetErrorStr",
    "tj3GetErrorCode",
)


def _library_path() -> str | None:
    """The bundled library, found through the files the installed wheel declares; ``None`` when not installed."""
    try:
        files = importlib.metadata.files(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    found = sorted(
        str(f.locate())
        for f in files or ()
        if len(f.parts) == 2 and f.parts[0] == _LIBRARY_DIR and f.name.startswith(_LIBRARY_PREFIX) and ".so" in f.name
    )
    return found[0] if found else None


class TurboJPEG:
    """The ctypes functions of libturbojpeg; ``TurboJPEG.load()`` returns ``None`` when it is not installed.

    Raises:
        PipelineError: the library cannot be loaded, or lacks a function used
            (named, with the library's path).
    """

    def __init__(self, path: str) -> None:
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            raise PipelineError(f"libjpeg-turbo at {path} cannot be loaded: {exc} (reinstall it: pip install turbojpeg==0.0.2)") from exc
        self.path = path
        self.functions: dict[str, Any] = {}
        for name, args, res in _FUNCTIONS:
            try:
                f = getattr(lib, name)
            except AttributeError:
                raise PipelineError(
                    f"libjpeg-turbo at {path} has no function {name}: stoker needs the TurboJPEG 3 API "
                    f"(libjpeg-turbo >= 3.0, as bundled by pip install turbojpeg==0.0.2)"
                ) from None
            f.argtypes, f.restype = args, res
            self.functions[name] = f
        fns = self.functions
        self.init, self.destroy, self.set = fns["tj3Init"], fns["tj3Destroy"], fns["tj3Set"]

    @staticmethod
    @cache
    def load() -> TurboJPEG | None:
        path = _library_path()
        return None if path is None else TurboJPEG(path)

    def kernel_pointers(self) -> list[int]:
        """Addresses of :data:`KERNEL_FUNCTIONS`, in that order, for compiled code."""
        return [int(ctypes.cast(self.functions[name], ctypes.c_void_p).value or 0) for name in KERNEL_FUNCTIONS]

    def new_handles(self, count: int, fast_dct: bool, fast_upsample: bool) -> list[int]:
        """``count`` decompression handles (one per thread); free them with :meth:`destroy_handles`."""
        handles: list[int] = []
        for _ in range(count):
            h = self.init(TJINIT_DECOMPRESS)
            if not h:
                self.destroy_handles(handles)
                raise MemoryError("tj3Init failed: no memory for a libjpeg-turbo decompressor")
            self.set(h, TJPARAM_FASTDCT, int(fast_dct))
            self.set(h, TJPARAM_FASTUPSAMPLE, int(fast_upsample))
            handles.append(h)
        return handles

    def destroy_handles(self, handles: list[int]) -> None:
        for h in handles:
            if h:
                self.destroy(h)
