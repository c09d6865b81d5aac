"""libjpeg-turbo's TurboJPEG 3 API, called from compiled code through ctypes.

The library comes from a wheel (the ``turbojpeg`` package bundles
``libturbojpeg.so``); no system library or compiler is needed. Pointers are
passed as ``size_t``; the small structs TurboJPEG takes by value
(``tjscalingfactor``, ``tjregion``) are passed as packed 64-bit integers,
which is how the x86-64 and AArch64 calling conventions pass them.

Everything here is loaded on first use, never at import.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
from functools import cache
from typing import Any

TJINIT_DECOMPRESS = 1
TJPARAM_SUBSAMP = 4
TJPARAM_JPEGWIDTH = 5
TJPARAM_JPEGHEIGHT = 6
TJPARAM_FASTUPSAMPLE = 9
TJPARAM_FASTDCT = 10
TJPF_RGB = 0
#: iMCU width in pixels for each TJSAMP value (444, 422, 420, GRAY, 440, 411, 441)
MCU_WIDTH = (8, 16, 16, 8, 8, 32, 8)


def _library_path() -> str | None:
    spec = importlib.util.find_spec("turbojpeg")
    if spec is None or spec.origin is None:
        return None
    found = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "turbojpeg.libs", "libturbojpeg*.so*")))
    return found[0] if found else None


class TurboJPEG:
    """The ctypes functions of libturbojpeg; ``TurboJPEG.load()`` returns ``None`` when it is not installed."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        p, i = ctypes.c_size_t, ctypes.c_int

        def fn(name: str, args: list[Any], res: Any) -> Any:
            f = getattr(lib, name)
            f.argtypes, f.restype = args, res
            return f

        self.path = path
        self.init = fn("tj3Init", [i], p)
        self.destroy = fn("tj3Destroy", [p], None)
        self.set = fn("tj3Set", [p, i, i], i)
        self.get = fn("tj3Get", [p, i], i)
        self.decompress_header = fn("tj3DecompressHeader", [p, p, p], i)
        self.set_scaling_factor = fn("tj3SetScalingFactor", [p, ctypes.c_uint64], i)
        self.set_cropping_region = fn("tj3SetCroppingRegion", [p, ctypes.c_uint64, ctypes.c_uint64], i)
        self.decompress8 = fn("tj3Decompress8", [p, p, p, p, i, i], i)
        self.error_str = fn("tj3GetErrorStr", [p], ctypes.c_char_p)

    @staticmethod
    @cache
    def load() -> TurboJPEG | None:
        path = _library_path()
        return None if path is None else TurboJPEG(path)

    def new_handles(self, count: int, fast_dct: bool, fast_upsample: bool) -> list[int]:
        """``count`` decompression handles (one per thread)."""
        handles = []
        for _ in range(count):
            h = self.init(TJINIT_DECOMPRESS)
            if not h:
                raise MemoryError("tj3Init failed")
            self.set(h, TJPARAM_FASTDCT, int(fast_dct))
            self.set(h, TJPARAM_FASTUPSAMPLE, int(fast_upsample))
            handles.append(h)
        return handles
