"""Converting other libraries' datasets into stoker shards.

* :mod:`stoker.integrations.arrow`: Arrow tables and record batches, Parquet
  files or folders, Hugging Face ``datasets.Dataset`` (needs ``pyarrow``);
* :mod:`stoker.integrations.ray`: a ``ray.data.Dataset``, written in parallel
  by Ray's tasks (needs ``ray[data]``).

Both write a folder of shards and, last, its manifest; ``Loader(folder)``
reads it as one dataset. Nothing here imports ``pyarrow``, ``datasets`` or
``ray`` until a function is called.
"""

from stoker.integrations.arrow import from_huggingface, from_parquet, infer_fields, write_arrow
from stoker.integrations.ray import write_ray_dataset

__all__ = ["from_huggingface", "from_parquet", "infer_fields", "write_arrow", "write_ray_dataset"]
