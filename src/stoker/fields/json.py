"""JSON values: :class:`JSONField`."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from stoker.fields.base import Field


class JSONField(Field):
    """Any JSON-serialisable value per sample, stored as UTF-8 JSON.

    In a loader the field decodes to padded bytes (``BytesDecoder``); turn a
    batch back into Python values with :meth:`JSONField.unpack`, in your loop
    or as the last operation of the field's pipeline
    (``[BytesDecoder(), ToTensor(), JSONField.unpack]`` yields a list of
    values). ``Loader(return_lengths=True)`` also yields each value's length.
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
    def unpack(batch: Any, lengths: Any = None) -> list[Any]:
        """Decode a batch of zero-padded JSON bytes to a list of Python values, one per sample.

        Args:
            batch: ``(B, width)`` uint8, each value's UTF-8 JSON text padded
                with zeros (``BytesDecoder``'s output), a tensor or an array.
            lengths: each value's length in bytes, ``(B,)``
                (``Loader(return_lengths=True)`` yields them): each row is
                decoded from exactly its first ``lengths[i]`` bytes. Without
                them the padding is stripped, which is exact too: JSON text
                as written never ends with a zero byte.

        Returns:
            The values, in batch order.

        Raises:
            ValueError: ``batch`` is not two-dimensional, or ``lengths`` does
                not hold one length in ``[0, width]`` per row.

        Example:
            >>> JSONField.unpack(np.array([[123, 125, 0], [91, 49, 93]], np.uint8), [2, 3])
            [{}, [1]]
        """
        arr = batch.numpy() if hasattr(batch, "numpy") else np.asarray(batch)
        if arr.ndim != 2:
            raise ValueError(f"JSONField.unpack needs a (batch, width) array of bytes; got shape {arr.shape}")
        if lengths is None:
            return [json.loads(bytes(row).rstrip(b"\x00").decode("utf-8")) for row in arr]
        n = lengths.numpy() if hasattr(lengths, "numpy") else np.asarray(lengths)
        if n.shape != (len(arr),) or n.dtype.kind not in "iu" or (len(n) and (n.min() < 0 or n.max() > arr.shape[1])):
            raise ValueError(
                f"JSONField.unpack: lengths must hold one integer in [0, {arr.shape[1]}] per row ({len(arr)} rows); "
                f"got {n.dtype} of shape {n.shape} (pass the field's lengths from Loader(return_lengths=True))"
            )
        return [json.loads(bytes(row[:k]).decode("utf-8")) for row, k in zip(arr, n.tolist())]

    def default_decoder(self) -> Any:
        from stoker.decoders import BytesDecoder

        return BytesDecoder()
