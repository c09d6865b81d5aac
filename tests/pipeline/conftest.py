"""The loader tests' datasets, shared."""

from ..loader.conftest import mixed_path, table_path

__all__ = ["mixed_path", "table_path"]
