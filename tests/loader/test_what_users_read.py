"""What a user reads (issue 43, item 8): ``len()``, state mismatches, a missing path.

* ``len(loader)`` is the number of batches the next ``for`` yields: a whole epoch, the rest of one after a resume
  (on as many ranks as saved it, or on another number), the next epoch after ``break``. A pure-numpy model of the
  ranks' blocks (the docstring of :mod:`stoker.loader.distributed`) gives the batches each rank's next ``for`` yields.
* ``state_dict()`` is where the next ``for`` starts once no loop runs (an epoch left by ``break``, dropped, closed:
  the next epoch), and the last batch received inside a running loop; a compile's garbage does not change that.
* A state of another ``batch_size`` names ``batch_size``, not the default ``chunk_size`` that follows from it.
* A missing dataset path is a ``FileNotFoundError`` (and still a ``DatasetFormatError``), naming the path.

The batches are made by Python producers (``python_producers_unless_long``): the subject here is the loader's
bookkeeping, not the producer loop.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.errors import DatasetFormatError, StokerError
from stoker.loader import Loader, OrderOption

from .._profile import examples

pytestmark = pytest.mark.usefixtures("python_producers_unless_long")


def _loader(path: Path, n: int, batch_size: int, drop_last: bool, rank: int = 0, world_size: int = 1, **kwargs: Any) -> Loader:
    """The first ``n`` rows of ``table_path`` (``y[i] = i``), ``y`` only."""
    ranks: dict[str, Any] = {"distributed": True, "rank": rank, "world_size": world_size} if world_size > 1 else {}
    return Loader(path, batch_size=batch_size, indices=np.arange(n), pipelines={"x": None}, drop_last=drop_last,
                  num_workers=1, seed=3, **ranks, **kwargs)  # fmt: skip


def _epoch(loader: Loader) -> list[list[int]]:
    """The next ``for``: each batch's ``y``."""
    return [batch[0].reshape(-1).tolist() for batch in loader]


# ---- the reference model: SEQUENTIAL order, ranks' contiguous blocks, an elastic resume ----------------------------


def _per_rank(count: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    return count // (world_size * batch_size) * batch_size if drop_last else -(-count // world_size)


def _blocks(positions: list[int], world_size: int, batch_size: int, drop_last: bool) -> list[list[int]]:
    """Every rank's block of ``positions`` (padded by repeating the first ones without ``drop_last``, cut with it)."""
    share = _per_rank(len(positions), world_size, batch_size, drop_last)
    padded = positions + [positions[j % len(positions)] for j in range(share * world_size - len(positions))] if positions else []
    return [padded[r * share : (r + 1) * share] for r in range(world_size)]


def _batches(block: list[int], batch_size: int, drop_last: bool) -> list[list[int]]:
    out = [block[i : i + batch_size] for i in range(0, len(block), batch_size)]
    return [b for b in out if len(b) == batch_size] if drop_last else out


def _left_after(n: int, world_size: int, batch_size: int, drop_last: bool, k: int) -> list[int]:
    """The positions of an epoch of ``n`` that no rank handed out after ``k`` batches each (in lockstep)."""
    share = _per_rank(n, world_size, batch_size, drop_last)
    seen = {r * share + j for r in range(world_size) for j in range(min(k * batch_size, share)) if r * share + j < n}
    return [p for p in range(n) if p not in seen]


@settings(max_examples=examples(ci=6, long=60), deadline=None)
@given(
    n=st.integers(1, 40),
    batch_size=st.integers(1, 9),
    drop_last=st.booleans(),
    saved_ranks=st.integers(1, 3),
    resumed_ranks=st.integers(1, 3),
    data=st.data(),
)
def test_len_is_the_batches_the_next_for_yields(
    table_path: Path, n: int, batch_size: int, drop_last: bool, saved_ranks: int, resumed_ranks: int, data: st.DataObject
) -> None:
    """A fresh epoch, a resume at a drawn batch on as many or another number of ranks, the epoch after it: ``len()``
    before each ``for`` is the number of batches it yields, and they are the model's."""
    whole = _batches(_blocks(list(range(n)), saved_ranks, batch_size, drop_last)[0], batch_size, drop_last)
    saving = _loader(table_path, n, batch_size, drop_last, 0, saved_ranks)
    assert len(saving) == len(whole), "a fresh epoch: all its batches"
    k = data.draw(st.integers(0, len(whole)), label="resume after batch")
    it = iter(saving)
    got = [next(it)[0].reshape(-1).tolist() for _ in range(k)]
    assert got == whole[:k]
    state = saving.state_dict()  # inside the loop: the rank-0 state of a job stepping in lockstep
    del it
    saving.close()
    if k == len(whole):  # the saved run had finished the epoch: a resume starts the next one, whole
        expect = [_batches(b, batch_size, drop_last) for b in _blocks(list(range(n)), resumed_ranks, batch_size, drop_last)]
    elif resumed_ranks == saved_ranks:  # every rank goes on in its own block
        blocks = _blocks(list(range(n)), saved_ranks, batch_size, drop_last)
        expect = [_batches(b, batch_size, drop_last)[k:] for b in blocks]
    else:  # the positions nobody handed out, split again
        left = _left_after(n, saved_ranks, batch_size, drop_last, k)
        expect = [_batches(b, batch_size, drop_last) for b in _blocks(left, resumed_ranks, batch_size, drop_last)]
    for rank in range(resumed_ranks):
        resumed = _loader(table_path, n, batch_size, drop_last, rank, resumed_ranks)
        resumed.load_state_dict(state)
        announced = len(resumed)
        yielded = _epoch(resumed)
        assert announced == len(yielded), f"rank {rank}: len() said {announced} batches, the next for yielded {len(yielded)}"
        assert yielded == expect[rank]
        assert len(resumed) == len(_epoch(resumed)), "the epoch after the resumed one"
        resumed.close()


def test_len_inside_a_loop_is_what_the_loop_yields_and_stays(table_path: Path) -> None:
    """``len(loader)`` inside a ``for`` does not count down (``epoch * len(loader) + step`` stays right); the iterator's does."""
    loader = _loader(table_path, 100, 10, False)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    loader.close()
    resumed = _loader(table_path, 100, 10, False)
    resumed.load_state_dict(state)
    it = iter(resumed)
    seen = []
    for step, _ in enumerate(it):
        seen.append((len(resumed), len(it), step))
    assert [s[0] for s in seen] == [9] * 9, "the resumed loop yields 9 batches; len() says 9 at every step"
    assert [s[1] for s in seen] == list(range(8, -1, -1))
    assert len(resumed) == 10, "the loop is over: the next epoch is whole"
    resumed.close()


# ---- state_dict() after break: where the next for starts ---------------------------------------------------------


def _rest(loader: Loader, state: dict[str, Any]) -> list[list[int]]:
    """What a resume from ``state`` yields: the batches of its epoch after ``batches_consumed`` (one rank, no ``seen``)."""
    samples = loader.epoch_indices(state["epoch"]).tolist()
    batches = [samples[i : i + loader.batch_size] for i in range(0, len(samples), loader.batch_size)]
    return batches[state["batches_consumed"] :]


@settings(max_examples=examples(ci=6, long=80), deadline=None)
@given(
    n=st.integers(1, 50),
    batch_size=st.integers(1, 9),
    drop_last=st.booleans(),
    order=st.sampled_from([OrderOption.SEQUENTIAL, OrderOption.RANDOM, OrderOption.QUASI_RANDOM]),
    world_size=st.integers(1, 2),
    data=st.data(),
)
def test_state_dict_after_break_resumes_what_the_next_for_yields(
    table_path: Path, n: int, batch_size: int, drop_last: bool, order: OrderOption, world_size: int, data: st.DataObject
) -> None:
    """Loops left at drawn batches (``break``, an iterator dropped, ``close()``, or run to the end), epoch after epoch:
    ``state_dict()`` then, loaded into a new loader, yields exactly what the original loader's next ``for`` yields
    (FFCV's rule: a ``for`` is an epoch, ``break`` ends it). A state saved inside the loop resumes after its batch."""
    kwargs: dict[str, Any] = {"order": order}
    loader = _loader(table_path, n, batch_size, drop_last, 0, world_size, **kwargs)
    for _loop in range(data.draw(st.integers(1, 3), label="loops")):
        k = data.draw(st.integers(0, len(loader)), label="batches taken")
        how = data.draw(st.sampled_from(["break", "drop", "close"] if k else ["drop", "close"]), label="left by")
        inside: dict[str, Any] | None = None
        if how == "break":
            for i, _batch in enumerate(loader):
                if i + 1 == k:
                    inside = loader.state_dict()  # what a user saves: inside the loop, before break
                    break
        else:
            it = iter(loader)
            for _ in range(k):
                next(it)
            inside = loader.state_dict()  # a loop paused between next() calls: still running
            if how == "close":
                loader.close()
            del it
        assert inside is not None
        state = loader.state_dict()
        resumed = _loader(table_path, n, batch_size, drop_last, 0, world_size, **kwargs)
        resumed.load_state_dict(state)
        announced = len(resumed)
        yielded = _epoch(resumed)
        going_on = _epoch(loader)  # the original loader's next for
        assert yielded == going_on, f"{how} after {k} batches: the resume yields other batches than the loader's next for"
        assert announced == len(going_on)
        again = _loader(table_path, n, batch_size, drop_last, 0, world_size, **kwargs)
        again.load_state_dict(inside)
        assert _epoch(again) == _rest(loader, inside), f"a state saved inside the loop, after {k} batches"
        resumed.close()
        again.close()
    loader.close()


def test_state_dict_after_break_needs_no_garbage_collection(table_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile in the loop's thread (Numba's typing) leaves garbage in a reference cycle that holds the frames on that
    thread's stack, the epoch's among them: after ``break`` the epoch must not count as running until the collector
    runs (here: never, it is off). Simulated: a ``next()`` that compiles and leaves such a cycle."""
    import gc

    import numba

    from stoker.loader._engine import CompiledEpoch

    original = CompiledEpoch._next_batch

    def compiling(self: CompiledEpoch) -> Any:
        batch = original(self)
        if self.consumed == 2:

            def plus_one(a: int) -> int:
                return a + 1

            numba.njit(plus_one)(1)  # a compilation in the loop's thread
            try:
                raise ValueError("an overload that does not apply")
            except ValueError as exc:
                cycle: list[Any] = [exc]  # garbage holding this frame (and self), as Numba's typing leaves
                cycle.append(cycle)
        return batch

    monkeypatch.setattr(CompiledEpoch, "_next_batch", compiling)
    loader = _loader(table_path, 50, 10, False)
    gc.disable()
    try:
        for i, _batch in enumerate(loader):
            if i == 2:
                break
        state = loader.state_dict()
        assert (state["epoch"], state["batches_consumed"]) == (1, 0), "the epoch left by break is over"
        assert len(loader) == 5
        assert _epoch(loader) == _rest(loader, state)
    finally:
        gc.enable()
    loader.close()


# ---- a state mismatch names what the user set --------------------------------------------------------------------


def test_a_mismatch_names_batch_size_not_the_default_chunk_size(table_path: Path) -> None:
    kwargs: dict[str, Any] = {"order": OrderOption.QUASI_RANDOM, "seed": 1, "pipelines": {"x": None}, "num_workers": 1}
    saved = Loader(table_path, batch_size=20, **kwargs).state_dict()
    with pytest.raises(StokerError) as caught:
        Loader(table_path, batch_size=10, **kwargs).load_state_dict(saved)
    assert "batch_size: saved 20, this loader 10" in str(caught.value)
    assert "chunk_size" not in str(caught.value), "the default chunk_size follows batch_size: only batch_size is named"
    # a chunk_size the user set, here or in the saved run, is named
    with pytest.raises(StokerError, match=r"chunk_size: saved 160, this loader 100;?"):
        Loader(table_path, batch_size=10, chunk_size=100, **kwargs).load_state_dict(saved)
    explicit = Loader(table_path, batch_size=20, chunk_size=50, **kwargs).state_dict()
    with pytest.raises(StokerError, match=r"chunk_size: saved 50, this loader 160 \(the default: 8 batches\)"):
        Loader(table_path, batch_size=20, **kwargs).load_state_dict(explicit)


# ---- a missing path ----------------------------------------------------------------------------------------------


def test_a_missing_path_is_a_file_not_found_error_naming_it(tmp_path: Path, table_path: Path) -> None:
    from stoker.cli.inspect import describe
    from stoker.cli.main import main
    from stoker.dataset import open_dataset
    from stoker.format.reader import Reader

    missing = tmp_path / "nowhere" / "train.stoker"
    for opener in (
        lambda: Loader(missing, batch_size=4),
        lambda: Loader(str(tmp_path / "nowhere") + "/", batch_size=4),
        lambda: Loader([table_path, missing], batch_size=4),
        lambda: Loader(str(tmp_path / "*.stoker"), batch_size=4),
        lambda: Reader(missing),
        lambda: open_dataset(missing),
        lambda: describe(missing),
    ):
        with pytest.raises(FileNotFoundError) as caught:
            opener()
        assert str(tmp_path) in str(caught.value) and str(tmp_path) in caught.value.filename
        assert isinstance(caught.value, DatasetFormatError), "still a DatasetFormatError, as before"
    with pytest.raises(FileNotFoundError) as caught:
        Loader(missing, batch_size=4)
    copy = pickle.loads(pickle.dumps(caught.value))  # (across processes, as a writer's or a rank's error travels)
    assert type(copy) is type(caught.value) and str(copy) == str(caught.value) and copy.filename == str(missing)
    assert main(["inspect", str(missing)]) == 1
