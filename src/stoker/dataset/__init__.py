"""Datasets of many files: a folder (or URL) of shards and its manifest, read and written as one dataset.

::

    _manifest.py            the manifest: shard names, sizes, checksums, the fields' hash
    _transaction.py         writing a folder of shards as one transaction (manifest last, atomically)
    _remote_transaction.py  the same transaction against an object store
    _vstore.py              several files (or a bounded page cache of them) seen as one array
    sharded.py              ShardedReader and open_dataset: a folder of shards read as one Reader
    shards.py               ShardedWriter and write_shards
    _store_reader.py        the one reader of shards from stores (local files and cached downloads), for one dataset or a mix
    _remote.py              a dataset at a URL: manifest, heads, shard downloads through the node cache, checks
    _remote_schedule.py     the shards of the coming epoch downloaded ahead, pinned while batches read them
    _remote_heads.py        the shards' heads (everything but the data), read with range requests
    mixed.py                several datasets mixed into one (their stores behind one cache)

Below the Loader, above the single file (:mod:`stoker.format`) and the storage (:mod:`stoker.remote`).
"""

from stoker.dataset.sharded import ShardedReader, open_dataset
from stoker.dataset.shards import ShardedWriter, write_shards

__all__ = ["ShardedReader", "ShardedWriter", "open_dataset", "write_shards"]
