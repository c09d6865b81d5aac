"""Write a ``ray.data.Dataset`` into stoker shards in parallel, on a laptop or a Ray cluster.

:func:`write_ray_dataset` runs ``ds.write_datasink`` with a
sink made by :func:`stoker_datasink`: each Ray write task converts its blocks to one Arrow
table and writes it as one stoker shard (:func:`stoker.convert.arrow.write_shard`),
named after the write's generation and the task's index (``shard-g1f0c9a3e-00007.stoker``).
The writer renames a complete temporary file onto that name, so a task that
Ray retries replaces its shard instead of adding a second one, and no partial
shard is ever visible. The write is one transaction of the folder
(:class:`stoker.dataset._transaction.FolderTransaction`), held by the driver:
when every task is done, the driver renames the manifest listing the shards
in the dataset's order into place (the commit), then deletes the shards of
the dataset it replaced; a failed write deletes the shards it wrote and
leaves the previous dataset (or none) as it was.

On a cluster, ``directory`` must be a folder that every node and the driver
see at the same path (a shared file system): tasks write shards there, the
driver reads their headers for the manifest. Or it is the URL of an object
store prefix (``s3://bucket/train/``): each task writes its shard in a local
temporary folder, uploads it straight to the store, and returns its header's
summary; the driver puts the manifest last
(:class:`stoker.dataset._remote_transaction.RemoteTransaction`). The tasks open
the store with the ``storage_options`` given (pickled to them) or, by
default, with the credentials of their node's environment.

``ray`` is an optional dependency (``pip install 'ray[data]'``), imported when
:func:`write_ray_dataset` is called, not with this module.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from stoker.convert.arrow import infer_fields, write_shard
from stoker.dataset._manifest import shard_info
from stoker.dataset._remote_transaction import RemoteTransaction, info_from_dict, info_to_dict, open_transaction, staging_folder
from stoker.dataset._transaction import FolderTransaction, shard_file_name
from stoker.dataset.shards import MANIFEST_NAME
from stoker.fields import Field

__all__ = ["stoker_datasink", "write_ray_dataset"]

_INSTALL = "pip install 'ray[data]'"


def _ray_data() -> Any:
    try:
        import ray.data
    except ImportError as exc:
        raise ImportError(f"stoker.convert.ray needs Ray Data: {_INSTALL}") from exc
    return ray.data


def _datasink_class() -> type:
    """The class of :func:`stoker_datasink`'s sinks, a subclass of ``ray.data.Datasink`` (made once Ray is imported)."""
    global _Sink
    if _Sink is not None:
        return _Sink
    ray_data = _ray_data()

    class _StokerDatasink(ray_data.Datasink):  # type: ignore[misc,name-defined]
        """Tasks write ``shard-g<GEN>-<task>.stoker``; the driver's transaction (not pickled) begins, commits or aborts."""

        def __init__(self, tx: FolderTransaction, fields: dict[str, Field], min_rows_per_shard: int | None) -> None:
            self.directory = os.fspath(tx.folder.resolve())
            #: a URL destination: each task uploads its shard there
            self.url = tx.destination if isinstance(tx, RemoteTransaction) else None
            self.storage_options = tx.storage_options if isinstance(tx, RemoteTransaction) else None
            self.generation = tx.generation
            self.fields = fields
            self._min_rows = min_rows_per_shard
            self._tx: FolderTransaction | None = tx

        def __getstate__(self) -> dict[str, Any]:
            return {**self.__dict__, "_tx": None}  # the transaction (and its lock) stays on the driver

        @property
        def min_rows_per_write(self) -> int | None:
            return self._min_rows

        def get_name(self) -> str:
            return "StokerShards"

        def on_write_start(self, schema: Any = None) -> None:
            if self._tx is not None and self._tx.state == "new":
                self._tx.begin()  # before any task runs: lock the folder, delete what earlier writes left

        def write(self, blocks: Iterable[Any], ctx: Any) -> dict[str, Any] | None:
            import pyarrow as pa
            from ray.data.block import BlockAccessor

            tables = [BlockAccessor.for_block(b).to_arrow() for b in blocks]
            tables = [t.select(list(self.fields)) for t in tables if t.num_rows]
            if not tables:
                return None
            table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
            name = shard_file_name(self.generation, ctx.task_idx)
            try:
                if self.url is None:
                    rows = write_shard(table, Path(self.directory) / name, self.fields)
                    return {"task": int(ctx.task_idx), "name": name, "rows": rows}
                from stoker.remote import open_store

                with staging_folder() as staging:  # locked while the task lives: a killed task's is removed by a later write
                    path = staging / name
                    rows = write_shard(table, path, self.fields)
                    info = shard_info(path, record=True)
                    open_store(self.url, self.storage_options).upload(name, path)
            except Exception as exc:
                exc.add_note(f"while writing {name} (Ray write task {ctx.task_idx}); sample indices count the rows of this task")
                raise
            return {"task": int(ctx.task_idx), "name": name, "rows": rows, "info": info_to_dict(info)}

        def on_write_complete(self, write_result: Any) -> None:
            done = sorted((r for r in write_result.write_returns if r), key=lambda r: r["task"])
            if not done:
                raise ValueError(f"no rows to write into {self.directory}: the Ray dataset is empty")
            if self._tx is None:
                raise RuntimeError("on_write_complete runs on the driver, with the sink that the driver made")
            if isinstance(self._tx, RemoteTransaction):
                for r in done:
                    self._tx.record(info_from_dict(r["info"]))  # uploaded by its task
            self._tx.commit([r["name"] for r in done])

        def on_write_failed(self, error: Exception) -> None:
            if self._tx is not None:
                self._tx.abort()

    _Sink = _StokerDatasink
    return _Sink


_Sink: type | None = None


def stoker_datasink(
    directory: str | os.PathLike[str] | FolderTransaction,
    fields: Mapping[str, Field],
    min_rows_per_shard: int | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    """A ``ray.data.Datasink`` that writes one stoker shard per write task, then commits the manifest.

    For ``ds.write_datasink(stoker_datasink(...))`` yourself; :func:`write_ray_dataset`
    also checks the fields, refuses an existing dataset unless told, and keeps
    the dataset's order. The sink replaces a dataset already in the folder
    (when its write succeeds).

    Args:
        directory: the dataset's folder or object store URL, or the driver's transaction of it.
        fields: column name -> Field (see :func:`stoker.convert.arrow.infer_fields`).
        min_rows_per_shard: Ray gathers blocks until a write task has at least
            this many rows; ``None``: one task per block (as Ray chooses).
        storage_options: for a URL (see :func:`stoker.remote.open_store`).
    """
    if isinstance(directory, FolderTransaction):
        tx = directory
    else:
        tx = open_transaction(directory, overwrite=True, storage_options=storage_options)
    return _datasink_class()(tx, dict(fields), min_rows_per_shard)


def _arrow_schema(ds: Any) -> Any:
    """The dataset's Arrow schema (from Ray's metadata; else from its first row)."""
    import pyarrow as pa

    schema = ds.schema()
    base = getattr(schema, "base_schema", schema)
    if isinstance(base, pa.Schema):
        return base
    return ds.take_batch(1, batch_format="pyarrow").schema


def write_ray_dataset(
    ds: Any,
    directory: str | os.PathLike[str],
    fields: Mapping[str, Field] | None = None,
    *,
    min_rows_per_shard: int | None = None,
    overwrite: bool = False,
    preserve_order: bool = True,
    concurrency: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Path | str:
    """Write a ``ray.data.Dataset`` into a folder of stoker shards, in parallel, and its manifest.

    One shard per Ray write task: by default one per block, so
    ``override_num_blocks=`` (or ``ds.repartition(n)``) sets the number of
    shards; ``min_rows_per_shard`` gathers small blocks. ``Loader(directory)``
    then reads every row once, in the dataset's order.

    Args:
        ds: the Ray dataset.
        directory: the dataset's folder (created if needed); on a cluster, a
            path that every node sees (a shared file system). Or an object
            store's URL (``s3://bucket/train/``): every task uploads its shard.
        fields: column name -> Field, the columns to write; ``None``: every
            column, fields inferred from the Arrow schema (see
            :mod:`stoker.convert.arrow`; images need ``RGBImageField()``).
        min_rows_per_shard: see above.
        overwrite: replace a stoker dataset already in ``directory`` (once
            the new one is complete; a failed write leaves it as it was).
        preserve_order: run the write with Ray's ``preserve_order`` (restored
            afterwards), so that shard ``k`` holds the ``k``-th part of the
            dataset. ``False`` may be faster; the shards' order is then Ray's.
        concurrency: at most this many write tasks at once (Ray's default: as
            many as the cluster's CPUs allow).
        storage_options: for a URL: credentials, endpoint, retries (see
            :func:`stoker.remote.open_store`), also used by the tasks.

    Returns:
        The manifest's path (for a URL: the manifest's URL).

    Raises:
        ImportError: Ray Data is not installed.
        KeyError, TypeError: a field names an unknown column or cannot hold
            its column (before any task runs).
        ValueError: the dataset has no rows.
        FileExistsError: ``directory`` holds a dataset and not ``overwrite``.
        SampleError: a value a field refuses (raised by Ray, possibly wrapped
            in a ``RayTaskError`` of the same type; the note names the shard).

    Example:
        >>> ds = ray.data.read_images("s3://bucket/train/", include_paths=True)  # doctest: +SKIP
        >>> write_ray_dataset(ds, "/shared/train-stoker", {"image": RGBImageField(write_mode="jpg"), "label": IntField()})  # doctest: +SKIP
    """
    ray_data = _ray_data()
    if not isinstance(ds, ray_data.Dataset):
        raise TypeError(f"expected a ray.data.Dataset; got {type(ds).__name__}")
    if min_rows_per_shard is not None and (
        isinstance(min_rows_per_shard, bool) or not isinstance(min_rows_per_shard, int) or min_rows_per_shard < 1
    ):
        raise ValueError(f"min_rows_per_shard must be an int >= 1 or None; got {min_rows_per_shard!r}")
    resolved = infer_fields(_arrow_schema(ds), fields)
    options = ds.context.execution_options
    saved = options.preserve_order
    options.preserve_order = bool(preserve_order) or saved
    try:
        with open_transaction(directory, overwrite=overwrite, storage_options=storage_options) as tx:  # begun here: refuses, locks, cleans
            ds.write_datasink(stoker_datasink(tx, resolved, min_rows_per_shard), concurrency=concurrency)
            if tx.state != "committed":
                raise RuntimeError(f"Ray finished writing {directory} without committing its manifest")
    finally:
        options.preserve_order = saved
    return tx.url + MANIFEST_NAME if isinstance(tx, RemoteTransaction) else tx.folder / MANIFEST_NAME
