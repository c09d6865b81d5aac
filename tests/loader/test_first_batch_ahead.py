"""The next epoch's first batch, made ahead by producer 0 (``stoker.loader._producers.Ahead``), against a numpy model.

A table of small (height, width, 3) images and their labels, read with a random flip whose draws come from
(seed, epoch, position). The model re-derives each batch from the documented contract: the epoch's order
(:func:`stoker.loader.order.epoch_order`), the batches, each sample's flip (``tests/transforms/reference.py``'s
seeds and draws). Every batch must equal the model and a loader that makes nothing ahead
(``_engine.MAKE_FIRST_AHEAD = False``), whatever was made ahead and whatever changed between epochs
(``set_epoch``, ``load_state_dict``, a ``break``, ``expect_held``, ``close()``). The counter of first batches
handed over as they were made ahead (``RingMemory.firsts_ahead``) says whether it was used; no test depends on
timing: where a test needs the batch made, it waits for it (up to 30 s; it takes a millisecond).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.fields import IntField, NDArrayField
from stoker.loader import Loader, OrderOption, _engine
from stoker.loader.order import epoch_order
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State
from stoker.transforms import RandomHorizontalFlip, ToTensor
from stoker.writer import DatasetWriter

from .._profile import examples
from ..transforms import reference as ref
from .conftest import loader_threads, other_loaders_threads

pytestmark = pytest.mark.compiled_loop  # (the compiled producer loop: tests/conftest.py)

N, H, W = 40, 6, 5
FLIP_SALT = ref.salt(1, 2)  # field "img" (the second), operation 2 (after the decoder and DeclareHWC)
WAIT_S = 30.0  # a generous bound for a batch of 40 tiny images: no test depends on how long it takes


class DeclareHWC(Operation):
    """Declares the arrays (height, width, channels) images, so that the flip takes them (a reentrant no-op)."""

    reentrant = True

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        return replace(previous_state, layout="HWC"), None

    def generate_code(self) -> Callable[..., Any]:
        return lambda batch, dst: batch


def images() -> np.ndarray:
    return np.random.default_rng(11).integers(0, 256, (N, H, W, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("first_ahead") / "images.stoker"
    fields = {"label": IntField(), "img": NDArrayField(shape=(H, W, 3), dtype=np.dtype("uint8"))}
    DatasetWriter(out, fields, num_workers=1, progress=False).from_arrays({"label": np.arange(N), "img": images()})
    return out


def make_loader(path: Path, seed: int, batch_size: int, num_workers: int, **kw: Any) -> Loader:
    pipelines = {"label": [IntDecoder(), ToTensor()], "img": [NDArrayDecoder(), DeclareHWC(), RandomHorizontalFlip(0.5), ToTensor()]}
    return Loader(path, batch_size=batch_size, num_workers=num_workers, order=OrderOption.RANDOM, seed=seed, pipelines=pipelines, **kw)


def model_epoch(seed: int, epoch: int, batch_size: int, skip: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """The model's (labels, images) batches of ``epoch`` from batch ``skip``."""
    order = epoch_order(OrderOption.RANDOM, np.arange(N), seed, epoch, 1, 1)  # (chunks: QUASI_RANDOM only)
    pictures = images()
    out = []
    for lo in range(skip * batch_size, N, batch_size):
        positions = np.arange(lo, min(lo + batch_size, N))
        batch = order[positions]
        x = pictures[batch].copy()
        flip = ref.uniform(ref.sample_seeds(seed, epoch, positions, FLIP_SALT), 0) < 0.5
        x[flip] = x[flip][:, :, ::-1]
        out.append((batch, x))
    return out


def as_numpy(batch: Any) -> tuple[np.ndarray, np.ndarray]:
    """A copy: the loader may reuse the batch's memory once it is released."""
    label, img = batch
    return label.numpy()[:, 0].copy(), img.numpy().copy()


def assert_batches(got: list[tuple[np.ndarray, np.ndarray]], want: list[tuple[np.ndarray, np.ndarray]], where: str) -> None:
    assert len(got) == len(want), f"{where}: {len(got)} batches, the model has {len(want)}"
    for b, ((labels, img), (want_labels, want_img)) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(labels, want_labels, err_msg=f"{where}, batch {b}")
        np.testing.assert_array_equal(img, want_img, err_msg=f"{where}, batch {b}")


def firsts_ahead(loader: Loader) -> int:
    return int(getattr(loader._ring_memory, "firsts_ahead", 0))


def wait_made_ahead(loader: Loader, required: bool = True) -> None:
    """Wait until producer 0 has made the next epoch's first batch (the loop has taken every batch of this one)."""
    ahead = getattr(loader._ring_memory, "ahead", None)
    if ahead is None:
        assert not required, "no batch of the next epoch is to be made ahead"
        return
    deadline = time.monotonic() + WAIT_S
    while not ahead.settled and time.monotonic() < deadline:
        time.sleep(0.001)
    assert ahead.done or not required, f"the next epoch's first batch was not made ahead (settled: {ahead.settled}, {WAIT_S} s)"


def run_epoch(loader: Loader, stop_after: int | None = None, wait: bool = True, save_at: int | None = None) -> tuple[list[Any], Any]:
    """One epoch: its batches (copies), every one taken (and the one made ahead waited for, ``wait``) before the end,
    or ``stop_after`` taken then ``break``; the state saved after batch ``save_at`` (or ``None``)."""
    got, state = [], None
    it = iter(loader)
    n = len(it)
    for b in range(n if stop_after is None else min(n, stop_after)):
        got.append(as_numpy(next(it)))
        if b == save_at:
            state = loader.state_dict()
    if stop_after is None:
        if wait:
            wait_made_ahead(loader, required=False)
        assert next(it, None) is None
    del it
    return got, state


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_the_next_epochs_first_batch_is_made_ahead_and_handed_over(path: Path, num_workers: int) -> None:
    """Epoch 1's first batch is made by producer 0 while the loop still holds epoch 0's last batches, then handed over
    by iter() as it was; every batch equals the model, and no thread outlives the loader."""
    before = other_loaders_threads()
    loader = make_loader(path, 7, 4, num_workers)
    for epoch in range(3):
        it = iter(loader)
        got = [as_numpy(next(it)) for _ in range(len(it))]
        wait_made_ahead(loader)  # (the last batch is in the user's hands: the next epoch's first is made meanwhile)
        assert next(it, None) is None
        del it
        assert_batches(got, model_epoch(7, epoch, 4), f"epoch {epoch}")
        assert firsts_ahead(loader) == epoch  # epochs 1 and 2 began with the batch made ahead
    loader.close()
    assert not set(loader_threads()) - before


def test_a_batch_the_user_keeps_is_never_written_by_the_batch_made_ahead(path: Path) -> None:
    """The user keeps every batch of epoch 0 (5 slots, 10 batches: the slot of epoch 1's first batch holds one of
    them): the batch made ahead goes to fresh memory, and every kept batch still holds its values after epoch 1."""
    loader = make_loader(path, 3, 4, 1, batches_ahead=2)
    assert loader._num_slots < -(-N // 4)
    kept, copies = [], []
    it = iter(loader)
    for _ in range(len(it)):
        batch = next(it)
        kept.append(batch)
        copies.append(as_numpy(batch))
    wait_made_ahead(loader)
    assert next(it, None) is None
    del it
    epoch1 = [as_numpy(b) for b in loader]
    assert firsts_ahead(loader) == 1
    assert_batches(epoch1, model_epoch(3, 1, 4), "epoch 1")
    assert_batches([as_numpy(b) for b in kept], copies, "the kept batches of epoch 0")
    assert_batches(copies, model_epoch(3, 0, 4), "epoch 0")
    loader.close()


def _set_epoch(loader: Loader, state: Any) -> tuple[int, int]:
    loader.set_epoch(5)
    return 5, 0


def _load_state(loader: Loader, state: Any) -> tuple[int, int]:
    loader.load_state_dict(state)
    return 0, 2


def _expect_held(loader: Loader, state: Any) -> tuple[int, int]:
    loader.expect_held(3)
    return 1, 0


def _close(loader: Loader, state: Any) -> tuple[int, int]:
    loader.close()
    return 1, 0


@pytest.mark.parametrize(
    "change", [_set_epoch, _load_state, _expect_held, _close], ids=["set_epoch", "load_state_dict", "expect_held", "close"]
)
def test_what_changes_the_next_epoch_drops_the_batch_made_ahead(path: Path, change: Callable[[Loader, Any], tuple[int, int]]) -> None:
    """Made ahead for epoch 1, then a change: the next iter() makes its first batch again, and every batch is the model's."""
    loader = make_loader(path, 5, 4, 2)
    got, state = run_epoch(loader, save_at=1)
    assert_batches(got, model_epoch(5, 0, 4), "epoch 0")
    wait_made_ahead(loader)  # (made already: run_epoch waited for it)
    epoch, skip = change(loader, state)
    got, _ = run_epoch(loader)
    assert firsts_ahead(loader) == 0
    assert_batches(got, model_epoch(5, epoch, 4, skip), f"epoch {epoch} from batch {skip}")
    loader.close()


def test_a_break_drops_the_batch_made_ahead(path: Path) -> None:
    """A loop that breaks out of epoch 0 before its last batch: epoch 1 makes its first batch again."""
    loader = make_loader(path, 9, 4, 1)
    it = iter(loader)
    n = len(it)
    got = [as_numpy(next(it)) for _ in range(n - 1)]
    wait_made_ahead(loader)  # (made: the loop took every batch but the last, fewer than batches ahead)
    del it  # break
    assert_batches(got, model_epoch(9, 0, 4)[: n - 1], "epoch 0")
    assert_batches([as_numpy(b) for b in loader], model_epoch(9, 1, 4), "epoch 1")
    assert firsts_ahead(loader) == 0
    loader.close()


@pytest.mark.parametrize("stepped", [0.1, 0.9], ids=["little between batches", "a step"])
def test_a_loop_that_does_little_between_batches_gets_no_batch_made_ahead(
    path: Path, stepped: float, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """The tuner's rows say the loop's steps took a tenth of the last epoch (a benchmark, an evaluation pass): the
    next epoch's first batch is not made ahead (its Python parts would wait for the GIL until the loop's last
    ``next()``, which would wait for them); with a step of 0.9 of the epoch it is. Either way every batch is the
    model's. The accounting is pinned (as if 100 batches were timed): measured, it depends on the machine's load."""
    from stoker.loader import _tuning

    monkeypatch.setattr(_tuning, "waited_share", lambda rec, lo, hi: (0.0, 100))
    monkeypatch.setattr(_tuning, "stepped_share", lambda rec, lo, hi: stepped)
    loader = make_loader(path, 2, 4, 2)
    for epoch in range(4):
        got, _ = run_epoch(loader)
        assert_batches(got, model_epoch(2, epoch, 4), f"epoch {epoch}")
    # epoch 0: nothing measured yet (made ahead); epochs 1-2 chosen from the pinned rows
    assert firsts_ahead(loader) == (1 if stepped < _tuning.STEPPED_LOW else 3)
    assert loader._tuner.last is not None and loader._tuner.last.first_ahead is (stepped >= _tuning.STEPPED_LOW)
    loader.close()


@st.composite
def scripts(draw: st.DrawFn) -> list[tuple[str, int, int | None]]:
    """2-3 epochs, each ``(before it, set_epoch's epoch, batches taken before a break or None)``."""
    steps = []
    for k in range(draw(st.integers(2, 3))):
        before = draw(st.sampled_from(["none", "none", "set_epoch", "load_state_dict"] if k else ["none"]))
        steps.append((before, draw(st.integers(0, 4)), draw(st.one_of(st.none(), st.none(), st.integers(1, 6)))))
    return steps


@settings(max_examples=examples(ci=5, long=40), deadline=None, database=None)
@given(seed=st.integers(0, 2**64 - 1), batch_size=st.integers(2, 9), num_workers=st.integers(1, 3), script=scripts(), fresh=st.booleans())
def test_batches_equal_the_model_and_a_loader_that_makes_nothing_ahead(
    path: Path, seed: int, batch_size: int, num_workers: int, script: list[tuple[str, int, int | None]], fresh: bool
) -> None:
    """Whatever was made ahead and whatever happened between epochs, the same batches as the model and as a loader
    that makes nothing ahead (``fresh``: that loader runs second, so that neither order of the two is favoured)."""
    runs: dict[bool, list[list[Any]]] = {}
    for ahead in [True, False] if fresh else [False, True]:
        _engine.MAKE_FIRST_AHEAD = ahead
        try:
            loader = make_loader(path, seed, batch_size, num_workers)
            runs[ahead] = []
            state, pos = None, (0, 0)
            for before, epoch_arg, stop_after in script:
                if before == "set_epoch":
                    loader.set_epoch(epoch_arg)
                    pos = (epoch_arg, 0)
                elif before == "load_state_dict" and state is not None:
                    loader.load_state_dict(state[1])
                    pos = state[0]
                epoch, skip = pos
                got, saved = run_epoch(loader, stop_after, save_at=0)  # (saved after the first batch it hands out)
                if saved is not None and skip + 1 < -(-N // batch_size):  # (mid-epoch: the next one starts at skip + 1)
                    state = ((epoch, skip + 1), saved)
                want = model_epoch(seed, epoch, batch_size, skip)
                assert_batches(got, want[: len(got)], f"epoch {epoch} from batch {skip} (made ahead: {ahead})")
                assert stop_after is not None or len(got) == len(want)
                runs[ahead].append(got)
                pos = (epoch + 1, 0)
            event(f"first batches made ahead and handed over: {firsts_ahead(loader) > 0}" if ahead else "made nothing ahead")
            if not ahead:
                assert firsts_ahead(loader) == 0
            loader.close()
        finally:
            _engine.MAKE_FIRST_AHEAD = True
    for k, (a, b) in enumerate(zip(runs[True], runs[False], strict=True)):
        assert_batches(a, b, f"step {k}: made ahead against nothing made ahead")
