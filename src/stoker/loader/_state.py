"""The Loader's saved state: ``state_dict()`` and ``load_state_dict()``, elastic resume included.

A state is a plain dict: its version, the seed, the epoch and the batches this rank handed out in it, the world size
and the positions earlier runs handed out (``seen``), and the configuration the position depends on (the dataset,
batch size, order, ``drop_last``, indices; a mix's counts), which a loader refuses to take from another configuration,
naming each difference. On another number of ranks, the positions nobody has handed out are split anew
(:mod:`stoker.loader.distributed`). Functions of the Loader (:class:`~stoker.loader._view.LoaderView`); its methods
of the same names call them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from stoker.errors import StokerError
from stoker.loader._checks import check_seed
from stoker.loader._share import NOTHING_SEEN, batches_in, seen_in
from stoker.loader._view import LoaderView
from stoker.loader.distributed import check_intervals, resolve_rank, seen_after, share_batches

STATE_VERSION = 4  # 3: RANDOM orders from the compiled shuffle (a version-2 position would resume another order); 4: elastic
READ_VERSIONS = (3, 4)  # a version-3 state is a version-4 one with its world size in the config and nothing seen before


def _indices_sha256(indices: np.ndarray | None, n: int) -> str:
    """The digest of the int64 indices (``None``: ``0 .. n - 1``, hashed a piece at a time, never made whole)."""
    digest = hashlib.sha256()
    if indices is not None:
        digest.update(np.ascontiguousarray(indices, dtype=np.int64).tobytes())
    for start in range(0, n if indices is None else 0, 1 << 20):
        digest.update(np.arange(start, min(n, start + (1 << 20)), dtype=np.int64).tobytes())
    return digest.hexdigest()[:32]


def config(loader: LoaderView) -> dict[str, Any]:
    """What the position in an epoch depends on, besides the seed (and a mix's counts: its state's ``mix``)."""
    if loader._mix is not None:
        return {
            **loader._mix.config(),
            "batch_size": loader.batch_size,
            "order": loader.order.name,
            "drop_last": loader.drop_last,
            "chunk_size": loader.chunk_size,
            "window_chunks": loader.window_chunks,
            **({"window_shards": loader.window_shards} if loader.window_shards != 1 else {}),
        }
    if loader._indices_digest is None:
        loader._indices_digest = _indices_sha256(loader._indices, loader._num_indices)
    read_heads = getattr(loader.reader, "read_heads", None)
    if read_heads is not None:  # (a dataset in a store: every shard's checksum-table CRC is in its head)
        read_heads()
    files = [shard for shard in getattr(loader.reader, "shards", [loader.reader])]
    dataset: dict[str, Any] = {
        "num_samples": len(loader.reader),
        "file_size": sum(r.file_size for r in files),
        "field_table_crc": files[0].field_table_crc,
        "checksum_table_crc": files[0].checksum_table_crc,
    }
    if len(files) > 1:  # every shard: its samples, size and checksum-table CRC, in order
        dataset["shards"] = [[len(r), r.file_size, r.checksum_table_crc] for r in files]
    return {
        "dataset": dataset,
        "batch_size": loader.batch_size,
        "order": loader.order.name,
        "drop_last": loader.drop_last,
        "indices": {"count": loader._num_indices, "sha256": loader._indices_digest},
        "chunk_size": loader.chunk_size,
        "window_chunks": loader.window_chunks,
        **({"window_shards": loader.window_shards} if loader.window_shards != 1 else {}),  # (states saved before it read as 1)
    }


def state_dict(loader: LoaderView, unseen: Any) -> dict[str, Any]:
    """``Loader.state_dict``: where the loader is (that of the last batch handed out, less ``unseen``)."""
    epoch, consumed = loader._position
    if isinstance(unseen, bool) or not isinstance(unseen, (int, np.integer)) or not 0 <= unseen <= consumed:
        raise ValueError(f"unseen must be an int in [0, {consumed}] (the batches handed out in epoch {epoch}); got {unseen!r}")
    if not loader._loop_running() and not (loader._ran_to_end and consumed >= batches_in(loader, epoch)):
        # no loop runs: where the next `for` starts, the next epoch after one left early (break, close(), an error,
        # with its batches ahead of a consumer). One that ran to its end counts `unseen` back below (a consumer that
        # read its end ahead still holds them)
        epoch, consumed = loader._next_epoch, loader._skip_batches
    else:
        consumed -= int(unseen)
    if consumed >= batches_in(loader, epoch):
        epoch, consumed = epoch + 1, 0
    return {
        "version": STATE_VERSION,
        "seed": loader.seed,
        "epoch": epoch,
        "batches_consumed": consumed,
        "world_size": loader.world_size,
        "rank": loader.rank,
        "seen": seen_in(loader, epoch).tolist(),
        "config": config(loader),
        "path": str(loader.reader.path),
        **({"mix": loader._mix.state()} if loader._mix is not None else {}),
    }


def load_state_dict(loader: LoaderView, state: Any) -> None:
    """``Loader.load_state_dict``: check ``state`` against this loader, then make the next iteration go on after it."""
    if not isinstance(state, Mapping):
        raise StokerError(f"load_state_dict needs the dict returned by state_dict(); got {type(state).__name__}")
    version = state.get("version")
    if version not in READ_VERSIONS:
        raise StokerError(
            f"loader state of version {version!r}; this stoker reads versions {list(READ_VERSIONS)} (save it again with state_dict())"
        )
    missing = {"seed", "epoch", "batches_consumed", "config"} - set(state)
    if missing:
        raise StokerError(f"loader state lacks {sorted(missing)}")
    for key in ("seed", "epoch", "batches_consumed"):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise StokerError(f"loader state: {key} must be an int >= 0; got {value!r}")
    saved_ranks = state.get("world_size", state["config"].get("world_size") if isinstance(state["config"], Mapping) else None)
    schedule = loader._mix.saved_schedule(state) if loader._mix is not None else None  # a mix: the counts of every epoch
    n = loader._num_indices if schedule is None else schedule.length(int(state["epoch"]))
    try:
        saved_ranks = resolve_rank(True, 0, saved_ranks)[1]
        seen = check_intervals(state.get("seen", []), n)
    except (TypeError, ValueError) as exc:
        raise StokerError(f"loader state: {exc}") from None
    n_batches = share_batches(n, seen, saved_ranks, loader.batch_size, loader.drop_last)
    if state["batches_consumed"] > n_batches:
        raise StokerError(
            f"loader state: batches_consumed is {state['batches_consumed']}, more than the {n_batches} batches of an epoch"
            + (f" on {saved_ranks} ranks" if saved_ranks > 1 else "")
        )
    seed = check_seed(state["seed"])
    _refuse_other_config(loader, state, seed)
    loader.close()
    loader.seed = seed
    epoch, consumed = int(state["epoch"]), int(state["batches_consumed"])
    if consumed == n_batches and (consumed > 0 or saved_ranks == loader.world_size):  # the saved run had finished the epoch
        epoch, consumed, seen = epoch + 1, 0, NOTHING_SEEN
    elif saved_ranks != loader.world_size:  # every rank of the saved run handed out `consumed` batches of its share
        seen = seen_after(n, seen, saved_ranks, loader.batch_size, loader.drop_last, [consumed] * saved_ranks)
        consumed = 0
    if loader._mix is not None and schedule is not None:  # the counts of every epoch, as the saved run had them
        loader._mix.adopt(schedule)
    loader._seen = (epoch, seen) if len(seen) else None
    loader._next_epoch, loader._skip_batches = epoch, consumed
    loader._position = (epoch, consumed)
    loader._ran_to_end = False


def _refuse_other_config(loader: LoaderView, state: Mapping[str, Any], seed: int) -> None:
    """Raise naming every difference between the configuration ``state`` was saved with and ``loader``'s (seed included)."""
    differences = _differences(state["config"], config(loader))
    saved_config = state["config"] if isinstance(state["config"], Mapping) else {}
    if not loader._chunk_size_given and saved_config.get("chunk_size") == 8 * _int_or(saved_config.get("batch_size"), -1):
        # both the default, 8 batches: it differs only because batch_size does (named above), which the user set
        differences = [d for d in differences if not d.startswith("chunk_size: ")]
    elif not loader._chunk_size_given:
        differences = [d + " (the default: 8 batches)" if d.startswith("chunk_size: ") else d for d in differences]
    saved_shards = state["config"].get("window_shards", 1) if isinstance(state["config"], Mapping) else 1
    if saved_shards != loader.window_shards and loader.window_shards == 1:  # (a loader with window_shards > 1 compares it above)
        differences.append(f"window_shards: saved {saved_shards!r}, this loader 1")
    if loader._explicit_seed and seed != loader.seed:
        differences.append(f"seed: saved {seed}, this loader {loader.seed}")
    if differences:
        raise StokerError(
            "loader state was saved by a loader that yields other batches: " + "; ".join(differences)
            + " (build the Loader with the same dataset and arguments, or start afresh)"
        )  # fmt: skip


def _int_or(value: Any, default: int) -> int:
    """``value`` if it is an int (not a bool), else ``default`` (a saved state's field, not yet checked)."""
    return int(value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else default


def _differences(saved: Any, current: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``saved`` against ``current``, key by key (nested mappings as ``outer.inner``): ``"<key>: saved ..., this loader ..."``."""
    if not isinstance(saved, Mapping):
        return [f"{prefix or 'config'}: saved {saved!r}, this loader {dict(current)!r}"]
    out = []
    for key, value in current.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.extend(_differences(saved.get(key), value, name + "."))
        elif saved.get(key) != value:
            out.append(f"{name}: saved {saved.get(key)!r}, this loader {value!r}")
    return out
