"""Compatibility path: ``stoker.integrations.arrow`` is :mod:`stoker.convert.arrow` (moved in issue 31); kept for code that imports it."""

from stoker.convert.arrow import from_huggingface, from_parquet, infer_fields, write_arrow, write_shard

__all__ = ["from_huggingface", "from_parquet", "infer_fields", "write_arrow", "write_shard"]
