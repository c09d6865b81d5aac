"""FFCV-compatible import path: ``from stoker.writer import DatasetWriter``."""

from stoker.format.writer import DatasetWriter

__all__ = ["DatasetWriter"]
