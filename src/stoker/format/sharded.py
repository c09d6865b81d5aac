"""Compatibility path: ``stoker.format.sharded`` is :mod:`stoker.dataset.sharded` (moved in issue 31); kept for code that imports it."""

from stoker.dataset.sharded import ShardedReader, open_dataset

__all__ = ["ShardedReader", "open_dataset"]
