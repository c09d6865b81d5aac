"""Compatibility path: converting other libraries' datasets lives in :mod:`stoker.convert` (issue 31).

``from stoker.integrations import write_arrow`` and ``stoker.integrations.arrow`` / ``.ray`` keep working.
"""

from stoker.convert.arrow import from_huggingface, from_parquet, infer_fields, write_arrow
from stoker.convert.ray import write_ray_dataset

__all__ = ["from_huggingface", "from_parquet", "infer_fields", "write_arrow", "write_ray_dataset"]
