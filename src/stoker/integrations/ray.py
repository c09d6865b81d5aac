"""Compatibility path: ``stoker.integrations.ray`` is :mod:`stoker.convert.ray` (moved in issue 31); kept for code that imports it."""

from stoker.convert.ray import stoker_datasink, write_ray_dataset

__all__ = ["stoker_datasink", "write_ray_dataset"]
