"""FFCV's ``ffcv.transforms.common`` path: :class:`Squeeze` (defined in :mod:`stoker.transforms.tensor`)."""

from stoker.transforms.tensor import Squeeze

__all__ = ["Squeeze"]
