"""The stoker file format: its layout (:mod:`stoker.format.spec`), reader and writer, and sharded datasets."""

from stoker.format.reader import Reader
from stoker.format.sharded import ShardedReader, open_dataset
from stoker.format.shards import ShardedWriter, write_shards
from stoker.format.writer import DatasetWriter

__all__ = ["DatasetWriter", "Reader", "ShardedReader", "ShardedWriter", "open_dataset", "write_shards"]
