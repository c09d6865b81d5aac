"""What a batch carries besides its fields: the samples' dataset indices and the lengths of variable-size fields.

``Loader(return_indices=True)`` adds the batch's indices in the file, and
``Loader(return_lengths=True)`` each bytes, JSON or ragged field's lengths,
both as fresh ``(B,)`` int64 CPU tensors (never slot memory: a batch you keep
keeps its own). In tuples a field's lengths follow the field and the indices
come last; in dicts they are ``"<field>_lengths"`` and ``"index"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker.loader._checks import INDEX_KEY, LENGTH_COLUMNS

if TYPE_CHECKING:
    from stoker.fields.base import Field
    from stoker.format.reader import Reader
    from stoker.loader._graph import FieldPipeline


def output_names(fields: Sequence[str], with_lengths: Sequence[str], return_indices: bool) -> list[str]:
    """The names of a batch's outputs, in order: each field, its lengths after it, the indices last."""
    names: list[str] = []
    for name in fields:
        names.append(name)
        if name in with_lengths:
            names.append(f"{name}_lengths")
    if return_indices:
        names.append(INDEX_KEY)
    return names


def _decoded_width(pipeline: FieldPipeline) -> int | None:
    """Entries per sample that the field's decoder keeps (``RaggedArrayDecoder(max_length=...)`` cuts longer samples)."""
    from stoker.decoders import BytesDecoder, RaggedArrayDecoder

    first = pipeline.steps[0]
    if isinstance(first.op, (BytesDecoder, RaggedArrayDecoder)) and first.query is not None and first.query.shape:
        return int(first.query.shape[0])
    return None


class BatchExtras:
    """Adds indices and lengths to the outputs of one batch.

    Args:
        reader: the file's reader (its metadata holds every sample's length).
        fields: the file's fields.
        with_lengths: names of the loaded fields whose lengths are yielded.
        return_indices: whether the batch's dataset indices are yielded.
    """

    def __init__(self, reader: Reader, fields: Mapping[str, Field], with_lengths: Sequence[str], return_indices: bool) -> None:
        self.reader = reader
        self.with_lengths = list(with_lengths)
        self.columns = {name: f"{name}/{LENGTH_COLUMNS[fields[name].TYPE_NAME]}" for name in self.with_lengths}
        self.return_indices = return_indices

    def __bool__(self) -> bool:
        return bool(self.with_lengths) or self.return_indices

    def names(self, fields: Sequence[str]) -> list[str]:
        """The names of a batch's outputs, in order (:func:`output_names`)."""
        return output_names(fields, self.with_lengths, self.return_indices)

    def lengths(self, pipeline: FieldPipeline, indices: np.ndarray) -> Any:
        """The ``(B,)`` int64 lengths of ``pipeline``'s field for the samples ``indices``, as the batch holds them."""
        import torch

        stored = self.reader.metadata[self.columns[pipeline.name]][indices].astype(np.int64)
        width = _decoded_width(pipeline)
        if width is not None:
            np.minimum(stored, width, out=stored)
        return torch.from_numpy(stored)

    def add(self, pipelines: Sequence[FieldPipeline], outputs: Sequence[Any], indices: np.ndarray) -> list[Any]:
        """``outputs`` (one per pipeline) with the lengths after their fields and the indices last."""
        import torch

        out: list[Any] = []
        for pipeline, value in zip(pipelines, outputs):
            out.append(value)
            if pipeline.name in self.columns:
                out.append(self.lengths(pipeline, indices))
        if self.return_indices:
            out.append(torch.from_numpy(np.array(indices, dtype=np.int64, copy=True)))
        return out
