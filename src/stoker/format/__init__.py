"""The single stoker file: its layout (:mod:`stoker.format.spec`), reader, writer and data check.

::

    spec.py         the on-disk layout (magic, version, header, field table), and nothing else
    reader.py       Reader: one file, memory-mapped, checked at open
    writer.py       DatasetWriter (and its workers, write-behind sink, atomic publishing)
    _verify.py      the data check: per-block CRC-32, lazily, once per block
    _validated.py   the record of files already checked whole
    _webdataset.py  WebDataset tar shards as the writer's input (FFCV's ``from_webdataset``)

Datasets of many files (``ShardedReader``, ``write_shards``, ``open_dataset``, ...) are the layer above:
:mod:`stoker.dataset`.
"""

from stoker.format.reader import Reader
from stoker.format.writer import DatasetWriter

__all__ = ["DatasetWriter", "Reader"]
