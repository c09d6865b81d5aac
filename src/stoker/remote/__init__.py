"""Datasets in object storage: the storage layer under the format.

::

    _store.py     Store: one dataset prefix of an object store (S3, GCS, Azure,
                  HTTP(S)) behind read / read_range / download / upload / write /
                  delete / size; open_store(url)
    _requests.py  how each of a Store's requests runs: on the calling thread's
                  event loop (interruptible), retried, counted, described
    _cache.py     ShardCache: whole shards downloaded into a local folder shared
                  by every process of a node, pinned while read, published by
                  atomic rename
    _cache_room.py  the cache's disk: bounded at all times, each download
                  reserved first, evicted by the loader's priority

This package imports nothing of stoker but :mod:`stoker.errors`,
:mod:`stoker._cache_roots` and :mod:`stoker.observe` (see docs/ARCHITECTURE.md);
the datasets (:mod:`stoker.dataset`) and the loader use it. The client
library (obstore, ``pip install "stoker[remote]"``) is imported when a store
is opened, not with this package.
"""

from __future__ import annotations

from stoker.remote._cache import ShardCache, default_cache_dir
from stoker.remote._store import Store, is_url, open_store

__all__ = ["ShardCache", "Store", "default_cache_dir", "is_url", "open_store"]
