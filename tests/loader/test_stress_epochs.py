"""Random sequences of epochs (full, broken off, resumed from a state_dict, set_epoch), batch sizes, workers, orders,
indices and per-batch delays in compiled code, against a numpy model: every batch right, kept batches never
overwritten. (Written by a review of the work-ahead and kept tables; it found them sound.)"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.loader import Loader, OrderOption
from stoker.loader._engine import CompiledEpoch
from stoker.pipeline import native
from stoker.transforms import ToTensor

from .._profile import examples
from .test_engine import _OwnMemory, _reference_batches, _table

DELAYS = np.zeros(1000, dtype=np.int64)  # ns of spin per sample index (first row of a batch); set by each example


class Jitter(_OwnMemory):
    """A copy that first spins DELAYS[first sample] ns: batches finish out of order, some while the loop waits."""

    def generate_code(self):  # type: ignore[no-untyped-def]
        addr, n = int(DELAYS.ctypes.data), len(DELAYS)
        clock, asp = native.monotonic_ns, native.address_as_pointer

        def jitter(batch, dst):  # type: ignore[no-untyped-def]
            tab = numba.carray(asp(addr), (n,), np.int64)
            if batch.shape[0] > 0:
                k = int(batch[0, 0]) // 100
                ns = tab[k % n]
                if ns > 0:
                    end = clock() + ns
                    while clock() < end:
                        pass
            for i in range(batch.shape[0]):
                for j in range(batch.shape[1]):
                    dst[i, j] = batch[i, j]
            return dst

        return jitter


action = st.one_of(
    st.tuples(st.just("full"), st.integers(0, 3)),
    st.tuples(st.just("break"), st.integers(0, 8), st.integers(0, 3)),
    st.tuples(st.just("set_epoch"), st.integers(0, 3)),
    st.tuples(st.just("resume"), st.integers(0, 6)),
    st.tuples(st.just("drop_kept"), st.integers(0, 0)),
)


@pytest.mark.filterwarnings("ignore::stoker.loader.loader.HeldBatchesWarning")
@settings(max_examples=examples(ci=4, long=30), deadline=None, suppress_health_check=list(HealthCheck))
@given(
    batch_size=st.integers(3, 120),
    num_workers=st.integers(1, 4),
    ahead=st.one_of(st.none(), st.integers(1, 5)),
    order=st.sampled_from([OrderOption.SEQUENTIAL, OrderOption.RANDOM, OrderOption.QUASI_RANDOM]),
    drop_last=st.booleans(),
    seed=st.integers(0, 1000),
    actions=st.lists(action, min_size=1, max_size=6),
    delays=st.lists(st.tuples(st.integers(0, 999), st.sampled_from([20_000, 200_000, 2_000_000])), max_size=30),
    indices=st.one_of(st.none(), st.lists(st.integers(0, 999), min_size=0, max_size=400)),
)
def test_stress(table_path: Path, batch_size, num_workers, ahead, order, drop_last, seed, actions, delays, indices) -> None:
    X, y = _table(table_path)
    DELAYS[:] = 0
    for k, ns in delays:
        DELAYS[k] = ns
    pipelines = {"x": [NDArrayDecoder(), Jitter(), ToTensor()], "y": [IntDecoder(), ToTensor()]}
    kept: list[tuple[str, Any, Any, Any]] = []

    def check_kept():
        for what, xb, yb, (xr, yr) in kept:
            np.testing.assert_array_equal(xb.numpy(), xr, err_msg=f"kept {what} x")
            np.testing.assert_array_equal(yb.numpy().reshape(-1), yr, err_msg=f"kept {what} y")

    with Loader(
        table_path,
        batch_size=batch_size,
        num_workers=num_workers,
        batches_ahead=ahead,
        order=order,
        seed=seed,
        drop_last=drop_last,
        pipelines=pipelines,
        indices=indices,
    ) as loader:
        for a in [*actions, ("full", 1)]:
            what = a[0]
            if what == "set_epoch":
                loader.set_epoch(a[1])
                continue
            if what == "drop_kept":
                kept.clear()
                continue
            if what == "resume":
                k = min(a[1], len(loader) - loader._skip_batches)
                epoch = loader._next_epoch
                it = iter(loader)
                for _ in range(k):
                    next(it)
                state = loader.state_dict()
                del it
                gc.collect()
                loader.load_state_dict(state)
                continue
            epoch, first = loader._next_epoch, loader._skip_batches
            it = iter(loader)
            assert isinstance(it, CompiledEpoch)  # the path under test (the Python one has tests of its own)
            ref = _reference_batches(loader, epoch, X, y)[first:]
            limit = a[1] if what == "break" else None
            keep_every = a[-1]
            seen = 0
            for b, (xb, yb) in enumerate(it):
                assert b < len(ref), f"epoch {epoch}: more batches than the model ({len(ref)})"
                xr, yr = ref[b]
                np.testing.assert_array_equal(xb.numpy(), xr, err_msg=f"epoch {epoch} batch {first + b} x")
                np.testing.assert_array_equal(yb.numpy().reshape(-1), yr, err_msg=f"epoch {epoch} batch {first + b} y")
                if keep_every and b % keep_every == 0:
                    kept.append((f"e{epoch}b{first + b}", xb, yb, ref[b]))
                seen += 1
                if limit is not None and seen >= limit:
                    break
            if limit is None:
                assert seen == len(ref), (seen, len(ref))
            del it
            check_kept()
        check_kept()
