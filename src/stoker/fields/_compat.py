"""Lazy re-exports from the schema modules, for FFCV's import paths.

FFCV defines each decoder next to its field (``from ffcv.fields.basics import
IntDecoder``, ``from ffcv.fields.rgb_image import CenterCropRGBImageDecoder``).
In stoker the field modules are the storage schema and the decoders belong to
the pipeline layer above it (:mod:`stoker.decoders.arrays`,
:mod:`stoker.decoders.rgb_image`), which imports the schema. A plain
import at the end of a schema module would make the schema import the pipeline
layer whenever it is loaded (and, for ``rgb_image``, form a cycle). Instead each
schema module defines a module ``__getattr__`` that calls :func:`reexport`: the
decoder module is imported only when a user asks the schema module for a
decoder name, and the object returned is the decoder class itself. The same
mechanism gives ``stoker.fields.ndarray.TorchTensorField``, which subclasses
``NDArrayField`` in its own module (a plain import would be a cycle).
"""

from __future__ import annotations

import importlib
from typing import Any


def reexport(module: str, name: str, names: dict[str, str]) -> Any:
    """The attribute ``name`` of the module that ``names`` maps it to.

    Args:
        module: the name of the module asking (for the error message).
        name: the attribute looked up.
        names: attribute name -> the module that defines it.

    Returns:
        The attribute, taken from its defining module.

    Raises:
        AttributeError: ``name`` is not one of ``names``.
    """
    source = names.get(name)
    if source is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return getattr(importlib.import_module(source), name)
