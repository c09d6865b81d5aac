"""The single stoker file: its layout (:mod:`stoker.format.spec`), reader, writer and data check.

::

    spec.py         the on-disk layout (magic, version, header, field table), and nothing else
    reader.py       Reader: one file, memory-mapped, checked at open
    writer.py       DatasetWriter (and its workers, write-behind sink, atomic publishing)
    _verify.py      the data check: per-block CRC-32, lazily, once per block
    _validated.py   the record of files already checked whole
    _webdataset.py  WebDataset tar shards as the writer's input (FFCV's ``from_webdataset``)

Datasets of many files (``ShardedReader``, ``write_shards``, ...) live in :mod:`stoker.dataset`;
they are still offered here, imported on first use, for code that imports them from this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stoker.format.reader import Reader
from stoker.format.writer import DatasetWriter

if TYPE_CHECKING:
    from stoker.dataset.sharded import ShardedReader, open_dataset
    from stoker.dataset.shards import ShardedWriter, write_shards

__all__ = ["DatasetWriter", "Reader", "ShardedReader", "ShardedWriter", "open_dataset", "write_shards"]

_DATASET = ("ShardedReader", "ShardedWriter", "open_dataset", "write_shards")


def __getattr__(name: str) -> Any:
    # compatibility: the sharded names moved up to stoker.dataset (issue 31); imported on first use so that
    # importing the single-file layer never imports the layer above it
    if name in _DATASET:
        import stoker.dataset

        return getattr(stoker.dataset, name)
    raise AttributeError(f"module 'stoker.format' has no attribute {name!r}")
