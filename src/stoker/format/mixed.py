"""Compatibility path: ``stoker.format.mixed`` is :mod:`stoker.dataset.mixed` (moved in issue 31); kept for code that imports it."""

from stoker.dataset.mixed import MixedReader, MixedShards, open_mixed

__all__ = ["MixedReader", "MixedShards", "open_mixed"]
