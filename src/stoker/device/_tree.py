"""Walking nested batches: :func:`tree_map` applies a function to every tensor and rebuilds the containers;
:func:`tree_tensors` lists the tensors of the same walk.

Containers walked: dicts (and every ``Mapping``), lists, tuples, named tuples,
``torch.return_types`` and other tuple subclasses, and dataclass instances.
Everything else (strings, numbers, numpy arrays, sets, arbitrary objects) is a
leaf returned as it is.

A container none of whose contents changed is returned as it is (the same
object), as ``Tensor.to`` returns the tensor itself when there is nothing to
do; a container with a changed element is rebuilt with its own type:

* ``dict`` -> a new ``dict``; other mutable mappings (``OrderedDict``,
  ``defaultdict``, subclasses) -> a shallow ``copy.copy`` whose changed values
  are set again, which keeps the type, its order and attributes such as
  ``default_factory``; read-only mappings -> ``type(m)(items)``, else a
  ``dict``.
* ``list`` -> a new ``list``; list subclasses -> ``copy.copy`` then
  ``out[:] = items``.
* tuples -> ``tuple(items)``; named tuples -> ``type(t)._make(items)``; other
  tuple subclasses -> ``type(t)(items)``.
* dataclasses -> ``copy.copy`` whose changed fields are set with
  ``object.__setattr__``: frozen dataclasses, ``init=False`` fields and slots
  work, and ``__post_init__`` does not run again (it could recompute a field
  from a tensor on the old device). Only fields are walked, not other
  attributes.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

_STRINGS = (str, bytes, bytearray, memoryview)
_UNSET = object()


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every tensor ``t`` replaced by ``fn(t)``; containers rebuilt only where something changed.

    Args:
        fn: called once per tensor occurrence (a tensor that appears twice is
            passed twice), in depth-first order (dicts in their iteration order).
        tree: a tensor, a leaf, or nested containers of them (see the module's docstring).

    Returns:
        The rebuilt tree (``tree`` itself when ``fn`` returned every tensor unchanged).

    Raises:
        ValueError: a container contains itself.
    """
    import torch

    return _map(fn, tree, torch.Tensor, set())


def tree_tensors(tree: Any) -> list[Any]:
    """Every tensor of ``tree``, at any depth, in :func:`tree_map`'s order (the containers it walks; nothing rebuilt).

    Args:
        tree: a tensor, a leaf, or nested containers of them.

    Returns:
        The tensors (one that appears twice is listed twice).

    Raises:
        ValueError: a container contains itself.
    """
    import torch

    found: list[Any] = []

    def collect(t: Any) -> Any:
        found.append(t)
        return t  # unchanged: no container is rebuilt

    _map(collect, tree, torch.Tensor, set())
    return found


def _map(fn: Callable[[Any], Any], tree: Any, tensor_type: type, active: set[int]) -> Any:
    if isinstance(tree, tensor_type):
        return fn(tree)
    if isinstance(tree, _STRINGS) or (not isinstance(tree, (Mapping, list, tuple)) and not _is_dataclass_instance(tree)):
        return tree
    key = id(tree)
    if key in active:
        raise ValueError(f"the batch contains itself (a {type(tree).__name__} inside itself): cannot walk a cyclic structure")
    active.add(key)
    try:
        if isinstance(tree, Mapping):
            return _map_mapping(fn, tree, tensor_type, active)
        if isinstance(tree, list):
            items = [_map(fn, v, tensor_type, active) for v in tree]
            if all(a is b for a, b in zip(items, tree)):
                return tree
            if type(tree) is list:
                return items
            out = copy.copy(tree)
            out[:] = items
            return out
        if isinstance(tree, tuple):
            items = [_map(fn, v, tensor_type, active) for v in tree]
            if all(a is b for a, b in zip(items, tree)):
                return tree
            if type(tree) is tuple:
                return tuple(items)
            if hasattr(tree, "_fields") and hasattr(tree, "_make"):  # a named tuple
                return type(tree)._make(items)
            return type(tree)(items)
        return _map_dataclass(fn, tree, tensor_type, active)
    finally:
        active.discard(key)


def _map_mapping(fn: Callable[[Any], Any], tree: Mapping[Any, Any], tensor_type: type, active: set[int]) -> Any:
    changed = {}
    for k, v in tree.items():
        new = _map(fn, v, tensor_type, active)
        if new is not v:
            changed[k] = new
    if not changed:
        return tree
    if type(tree) is dict:
        return {k: changed.get(k, v) for k, v in tree.items()}
    if isinstance(tree, MutableMapping):
        out = copy.copy(tree)
        for k, v in changed.items():
            out[k] = v
        return out
    items = {k: changed.get(k, v) for k, v in tree.items()}
    try:
        return type(tree)(items)  # type: ignore[call-arg]
    except TypeError:
        return items


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _map_dataclass(fn: Callable[[Any], Any], tree: Any, tensor_type: type, active: set[int]) -> Any:
    changed = {}
    for f in dataclasses.fields(tree):
        old = getattr(tree, f.name, _UNSET)
        if old is _UNSET:  # an init=False field never set
            continue
        new = _map(fn, old, tensor_type, active)
        if new is not old:
            changed[f.name] = new
    if not changed:
        return tree
    out = copy.copy(tree)
    for name, value in changed.items():
        object.__setattr__(out, name, value)
    return out
