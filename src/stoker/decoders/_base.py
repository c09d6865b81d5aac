"""The base of decoders: the first operation of a pipeline, which knows its field."""

from __future__ import annotations

from typing import Any

import numpy as np

from stoker.errors import PipelineError
from stoker.pipeline.operation import Operation


class _Decoder(Operation):
    """Common parts of decoders: the field is known before the state is declared."""

    #: decoders without per-thread state may run on two batches at once
    reentrant = True

    #: whether the kernel reads its ``seeds`` argument
    uses_seeds = False

    def _field_or_fail(self) -> Any:
        if self.field is None or self.reader is None:
            raise PipelineError(f"{type(self).__name__} must be the first operation of a field's pipeline")
        return self.field

    def loader_arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays passed as ``arrays`` to the kernel (views into the file)."""
        assert self.field is not None and self.reader is not None and self.field_name is not None  # noqa: S101
        return tuple(readonly(a) for a in self.field.loader_arrays(self.reader, self.field_name))


def readonly(array: np.ndarray) -> np.ndarray:
    """A read-only view of ``array`` (itself if it is read-only already).

    A file's columns are read-only when mapped and writable when a reader holds them in memory (a folder of
    shards, a store): Numba compiles a kernel once per signature, and read-only is part of an array's type, so
    giving every kernel read-only columns compiles each once instead of twice (the JPEG decoder: a minute each).
    """
    if not array.flags.writeable:
        return array
    view = array.view()
    view.flags.writeable = False
    return view


def _check_type(decoder: _Decoder, *type_names: str) -> Any:
    field = decoder._field_or_fail()
    if field.TYPE_NAME not in type_names:
        try:
            fix = f": decode it with {type(field.default_decoder()).__name__}()"
        except Exception:  # a custom field without a default decoder
            fix = ""
        raise PipelineError(
            f"{type(decoder).__name__} decodes fields of type {'/'.join(type_names)}; field '{decoder.field_name}' is "
            f"{type(field).__name__}{fix}"
        )
    return field
