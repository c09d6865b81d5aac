"""What the Loader's parts read of it: :class:`LoaderView`, a protocol that :class:`~stoker.loader.Loader` fulfils.

The parts below the API (the consumer loop, producers, planning, accounting, the saved state, the figures, each
epoch's share; ``compile()``'s warm-up) are given the Loader and read or set its attributes; they name its type as
``LoaderView``, never import ``stoker.loader.loader``, so the Loader's module sits above all of them (the ``loader``
contract of ``pyproject.toml``). mypy checks that the Loader fulfils the protocol where it hands itself to a part.
This module runs nothing: its imports are type hints only.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from stoker.dataset._remote import RemoteShards
    from stoker.dataset.sharded import ShardedReader
    from stoker.format import _verify
    from stoker.format.reader import Reader
    from stoker.loader._epoch import Epoch, _Producers
    from stoker.loader._extras import BatchExtras
    from stoker.loader._graph import FieldPipeline
    from stoker.loader._mix import Mix
    from stoker.loader._planner import Plan
    from stoker.loader._tuning import Tuner
    from stoker.loader.order import OrderOption, PreparedOrder
    from stoker.observe._recorder import Recorder


class LoaderView(Protocol):
    """A :class:`~stoker.loader.Loader` as its parts see it (see ``Loader.__init__`` for what each attribute holds)."""

    # ---- arguments, as checked
    batch_size: int
    num_workers: int
    os_cache: bool
    order: OrderOption
    drop_last: bool
    named: bool
    seed: int
    rank: int
    world_size: int
    chunk_size: int
    window_chunks: int
    window_shards: int
    check_data: bool
    batches_ahead: int
    recompile: bool
    _compile: bool | None
    _debug: bool | None
    _explicit_seed: bool
    _chunk_size_given: bool
    _consumer_holds: int

    # ---- the dataset and the samples used
    reader: Reader | ShardedReader
    remote: RemoteShards | None
    _mix: Mix | None
    _indices: np.ndarray | None
    _num_indices: int
    _indices_digest: str | None
    _identity: list[tuple[int, int, int, int]]
    _data_check: _verify.DataCheck | None
    _data_covered: bool

    # ---- pipelines, slots and the producers (made by _build and _allocate)
    pipelines: list[FieldPipeline]
    _extras: BatchExtras
    _reentrant: bool
    _producers: int
    _tokens_per_producer: int
    _num_slots: int
    _allocated: bool
    _slot_counter: int
    _plan: Plan | None
    _pool: _Producers | None
    _ring_memory: Any
    _transfer: Any
    _last_slots: tuple[int | None, int | None]

    # ---- where the loader is
    _next_epoch: int
    _skip_batches: int
    _seen: tuple[int, np.ndarray] | None
    _position: tuple[int, int]
    _run_start: tuple[int, int]
    _starting: threading.Lock
    _ran_to_end: bool
    _compile_garbage: bool
    _active: weakref.ref[Epoch] | None
    _prepared_order: PreparedOrder | None
    _order_buffers: list[np.ndarray | None]

    # ---- figures (stats(), report())
    wait_seconds: dict[str, float]
    _producer_seconds: list[dict[str, dict[str, float]]]
    _producer_wait: list[dict[str, float]]
    _loop_seconds: dict[str, dict[str, float]]
    _held: list[int]
    _made_by_loop: list[int]
    _tuner: Tuner
    _warned_held: bool
    _recorder: Recorder | None

    @property
    def indices(self) -> np.ndarray: ...

    @property
    def output_names(self) -> list[str]: ...

    def __iter__(self) -> Iterator[tuple[Any, ...] | dict[str, Any]]: ...

    def close(self) -> None: ...

    def state_dict(self, unseen: int = 0) -> dict[str, Any]: ...

    def _batches_in(self, epoch: int) -> int: ...

    def _epoch_share(self, epoch: int, prepared: bool = False) -> tuple[np.ndarray, np.ndarray]: ...

    def _prepare_order(self, epoch: int) -> PreparedOrder | None: ...

    def _note_held(self) -> None: ...

    def _build(self) -> None: ...

    def _allocate(self) -> None: ...

    def _loop_running(self) -> bool: ...

    def _still_iterating(self) -> bool: ...
