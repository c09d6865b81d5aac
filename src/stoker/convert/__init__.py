"""Conversion from other formats into stoker files and shards.

::

    imagefolder.py  a folder of images in class sub-folders (``stoker convert imagefolder``)
    arrow.py        Arrow tables, Parquet files, Hugging Face datasets (needs ``pyarrow``)
    ray.py          a ``ray.data.Dataset``, written by Ray's tasks (needs ``ray[data]``)

WebDataset tar shards are read by the writer itself (``DatasetWriter.from_webdataset``, FFCV's
method; :mod:`stoker.format._webdataset`). Nothing here imports ``pyarrow``, ``datasets`` or ``ray``
until a function is called.
"""

from stoker.convert.arrow import from_huggingface, from_parquet, infer_fields, write_arrow
from stoker.convert.imagefolder import convert_image_folder
from stoker.convert.ray import write_ray_dataset

__all__ = ["convert_image_folder", "from_huggingface", "from_parquet", "infer_fields", "write_arrow", "write_ray_dataset"]
