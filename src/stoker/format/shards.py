"""Compatibility path: ``stoker.format.shards`` is :mod:`stoker.dataset.shards` (moved in issue 31); kept for code that imports it."""

from stoker.dataset.shards import (
    MANIFEST_NAME,
    ShardedWriter,
    ShardInfo,
    fields_hash,
    open_files,
    read_manifest,
    resolve_dataset,
    shard_info,
    write_manifest,
    write_shards,
)

__all__ = [
    "MANIFEST_NAME",
    "ShardInfo",
    "ShardedWriter",
    "fields_hash",
    "open_files",
    "read_manifest",
    "resolve_dataset",
    "shard_info",
    "write_manifest",
    "write_shards",
]
