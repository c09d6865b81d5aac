"""JSON values: :class:`JSONField`."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from stoker.fields.base import Field


class JSONField(Field):
    """Any JSON-serialisable value per sample, stored as UTF-8 JSON.

    In a loader the field decodes to padded bytes (``BytesDecoder``); turn a
    batch back into Python values with :meth:`JSONField.unpack`.
    """

    TYPE_NAME = "json"
    storage = "heap"

    def to_args(self) -> dict[str, Any]:
        return {}

    def encode(self, value: Any, index: int) -> tuple[dict[str, Any], bytes | None]:
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"expected a JSON-serialisable value; {exc}") from None
        return {}, text.encode("utf-8")

    def read_one(self, meta: np.void, payload: Any) -> Any:
        return json.loads(bytes(payload).decode("utf-8"))

    @staticmethod
    def unpack(batch: Any) -> list[Any]:
        """Decode a batch of zero-padded JSON bytes (``(B, max_size)`` uint8) to values."""
        arr = batch.numpy() if hasattr(batch, "numpy") else np.asarray(batch)
        return [json.loads(bytes(row).rstrip(b"\x00").decode("utf-8")) for row in arr]

    def default_decoder(self) -> Any:
        from stoker.fields.decoders import BytesDecoder

        return BytesDecoder()
