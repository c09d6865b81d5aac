"""The stoker file format: its layout (:mod:`stoker.format.spec`), reader and writer."""

from stoker.format.reader import Reader
from stoker.format.writer import DatasetWriter

__all__ = ["DatasetWriter", "Reader"]
