"""Variable-size byte strings: :class:`BytesField`."""

from __future__ import annotations

from typing import Any

import numpy as np

from stoker.fields._compat import reexport
from stoker.fields.base import Field, expect_bytes


class BytesField(Field):
    """Arbitrary bytes per sample (encoded audio, serialized protobufs...).

    Accepts ``bytes``, ``bytearray``, ``memoryview`` or a 1-D ``uint8`` array
    (FFCV's form); empty values are allowed.
    """

    TYPE_NAME = "bytes"
    storage = "heap"

    def to_args(self) -> dict[str, Any]:
        return {}

    def encode(self, value: Any, index: int) -> tuple[dict[str, Any], bytes | None]:
        return {}, expect_bytes(value)

    def read_one(self, meta: np.void, payload: Any) -> np.ndarray:
        return np.frombuffer(bytes(payload), dtype=np.uint8)

    def default_decoder(self) -> Any:
        from stoker.decoders import BytesDecoder

        return BytesDecoder()


#: FFCV's decoders of this module, defined in the pipeline layer and re-exported lazily (see :mod:`stoker.fields._compat`)
_REEXPORTS = {
    "BytesDecoder": "stoker.decoders.arrays",
}


def __getattr__(name: str) -> Any:
    """``from stoker.fields.bytes import BytesDecoder`` as in FFCV: the decoder class itself, imported on first use."""
    return reexport(__name__, name, _REEXPORTS)
