"""A new install's first epoch goes over to the compiled producer loop at a batch boundary (issue 44).

While the producer loop compiles in the background, Python producers make the epoch's
batches; once it has compiled, the loop's next ``next()`` stops them and begins the
compiled loop at the batch it is about to hand over (``CompiledEpoch._switch``).

* Against a numpy model (the epoch's order, each image flipped or not) and bit for bit
  against a loader whose loop was compiled before its first batch (a warm cache) and one
  with Python producers for the whole epoch: the same batches with a switch at any batch
  ``k``; hypothesis over seeds, batch sizes, producers (1-3) and ``k`` (0 .. the epoch's
  batches). ``Plan.ready_at`` makes the compiled loop count as compiling until batch
  ``k`` of the epoch, and the loop asks at every batch (``SWITCH_LOOK_NS = 0``): the
  switch itself is the real one, driven without waiting for a compile.
* Batches the user keeps across the switch are never overwritten; ``break`` right after
  the switch leaves the loader ready for its next epoch.
* A real background compilation (empty caches of its own): the epoch switches before its
  end, to the same batches (``long``: the loop's compile takes 10-60 s on a busy 2-core
  machine; ``make test`` covers the switch with the hook above, and
  ``test_cold_start.py`` the background compilation itself).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stoker.decoders import IntDecoder, SimpleRGBImageDecoder
from stoker.errors import StokerError
from stoker.fields import IntField, RGBImageField
from stoker.loader import Loader, OrderOption, _engine, _planner
from stoker.pipeline import cache as pipeline_cache
from stoker.pipeline import native
from stoker.transforms import RandomHorizontalFlip, Squeeze, ToTensor
from stoker.writer import DatasetWriter

from .._profile import examples

pytestmark = [pytest.mark.skipif(not native.available(), reason="the compiled producer loop needs Linux"), pytest.mark.compiled_loop]

N = 150
IMAGES = np.random.default_rng(0).integers(0, 256, (N, 6, 5, 3), dtype=np.uint8)  # left-right asymmetric


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Raw 6x5 images and their labels ``0 ... N-1``."""
    path = tmp_path_factory.mktemp("switch") / "images.stoker"
    fields = {"image": RGBImageField(), "label": IntField()}
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset(list(zip(IMAGES, range(N))))
    return path


def _pipelines() -> dict[str, list[Any]]:
    return {"image": [SimpleRGBImageDecoder(), RandomHorizontalFlip(), ToTensor()], "label": [IntDecoder(), ToTensor(), Squeeze()]}


Batches = list[tuple[np.ndarray, np.ndarray]]


def _loader(path: Path, seed: int, batch_size: int, num_workers: int = 1, **kw: Any) -> Loader:
    return Loader(path, batch_size=batch_size, num_workers=num_workers, order=OrderOption.RANDOM, seed=seed, pipelines=_pipelines(), **kw)


def _copy(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    return batch[0].numpy().copy(), batch[1].numpy().copy()


def _check_model(loader: Loader, epoch: int, got: Batches, batch_size: int) -> None:
    """The numpy model: batch ``b`` holds the epoch's order's samples, each image as written or mirrored."""
    order = loader.epoch_indices(epoch)
    assert len(got) == -(-len(order) // batch_size), "one batch per batch_size samples"
    for b, (image, label) in enumerate(got):
        idx = order[b * batch_size : (b + 1) * batch_size]
        np.testing.assert_array_equal(label, idx)
        for i, s in enumerate(idx):
            raw = IMAGES[s]
            assert np.array_equal(image[i], raw) or np.array_equal(image[i], raw[:, ::-1]), f"batch {b}, sample {s}"


def _same(got: Batches, want: Batches, what: str) -> None:
    assert len(got) == len(want), what
    for b, ((xg, yg), (xw, yw)) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(yg, yw) and np.array_equal(xg, xw), f"{what}: batch {b} differs"


_REFERENCE: dict[tuple[int, int], tuple[list[Batches], Batches]] = {}


def _references(path: Path, seed: int, batch_size: int) -> tuple[list[Batches], Batches]:
    """(a) two epochs of a loader whose loop is compiled from its first batch (a warm cache: the module compiles the
    loop once), (b) epoch 0 made by Python producers for the whole epoch, as while the loop compiles in the background
    (each head step by step; ``STOKER_COMPILED_EPOCH=0``'s Python producers call the fused heads the loop calls)."""
    key = (seed, batch_size)
    if key not in _REFERENCE:
        with _loader(path, seed, batch_size) as warm:
            compiled = [[_copy(b) for b in warm] for _ in range(2)]
            assert warm._plan is not None and warm._plan.ready, "the reference runs the compiled loop"
        with _loader(path, seed, batch_size) as python:
            _held_back(python, len(compiled[0]))  # never ready in the epoch
            it = iter(python)
            plain = [_copy(b) for b in it]
            assert not it._batches.compiled and python._plan is not None and python._plan.switched is None  # type: ignore[attr-defined]
        _REFERENCE[key] = (compiled, plain)
    return _REFERENCE[key]


@pytest.fixture
def every_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop asks whether the compiled loop is ready at every batch (not every 50 ms): the switch is where the test says."""
    monkeypatch.setattr(_engine, "SWITCH_LOOK_NS", 0, raising=False)  # (raising: the check runs on the main before issue 44 too)


def _held_back(loader: Loader, k: int) -> None:
    """The loader's loop compiled (and cached), but counted as compiling until batch ``k`` of each epoch."""
    loader.compile()
    assert loader._plan is not None and loader._plan.loop is not None and loader._plan.ready
    loader._plan.ready_at = k


@settings(max_examples=examples(ci=6, long=40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(seed=0, batch_size=16, num_workers=2, where=0.5, ahead=2)  # a switch in the middle, whatever hypothesis draws
@given(
    seed=st.integers(0, 3),
    batch_size=st.sampled_from([7, 16, 50]),
    num_workers=st.integers(1, 3),
    where=st.floats(0, 1),
    ahead=st.integers(1, 4),
)
def test_a_switch_at_any_batch_gives_the_same_batches(
    images: Path, every_batch: None, seed: int, batch_size: int, num_workers: int, where: float, ahead: int
) -> None:
    compiled, plain = _references(images, seed, batch_size)
    n = len(plain)
    k = round(where * n)  # 0: compiled from the first batch; n: Python producers for the whole epoch
    with _loader(images, seed, batch_size, num_workers, batches_ahead=ahead) as loader:
        _held_back(loader, k)
        it = iter(loader)
        assert it._batches.compiled == (k == 0)  # type: ignore[attr-defined]
        got = []
        for b, batch in enumerate(it):
            got.append(_copy(batch))
            assert it._batches.compiled == (b + 1 > k or k == 0), f"batch {b}: made by the wrong producers"  # type: ignore[attr-defined]
        plan = loader._plan
        assert plan is not None
        if 0 < k < n:
            assert plan.switched is not None and plan.switched[:2] == (0, k), plan.switched
            assert f"switched to the compiled producer loop at batch {k} of epoch 0" in loader.report()
        else:
            assert plan.switched is None, "no switch: compiled from the start, or never ready in the epoch"
        plan.ready_at = None  # the next epoch runs the loop from its first batch, as after a background compilation
        it = iter(loader)
        assert it._batches.compiled  # type: ignore[attr-defined]
        second = [_copy(b) for b in it]
    _check_model(loader, 0, got, batch_size)
    _same(got, compiled[0], f"switch at {k} vs the compiled loop throughout")
    _same(got, plain, f"switch at {k} vs Python producers throughout")
    _same(second, compiled[1], "the epoch after the switch")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("num_workers", [1, 2])
def test_kept_batches_survive_the_switch(images: Path, every_batch: None, num_workers: int) -> None:
    """Every batch kept by the user, across the switch, keeps its values (its slot gets fresh memory instead)."""
    batch_size, k = 7, 6
    compiled, _ = _references(images, 1, batch_size)
    with _loader(images, 1, batch_size, num_workers, batches_ahead=1) as loader:
        _held_back(loader, k)
        kept = list(loader)  # every batch held: the slots come round several times, before and after the switch
        assert loader._plan is not None and loader._plan.switched is not None and loader._plan.switched[1] == k
        assert loader.stats()["loader"]["kept_batches"] > 0, "slots came round while their batches were kept"
    _same([(x.numpy(), y.numpy()) for x, y in kept], compiled[0], "kept batches")


@pytest.mark.parametrize("extra", [0, 1])
def test_break_right_after_the_switch(images: Path, every_batch: None, extra: int) -> None:
    """``break`` at the switch's first batch (or the one after): the position is right, the next epoch whole."""
    batch_size, k = 16, 4
    compiled, _ = _references(images, 2, batch_size)
    with _loader(images, 2, batch_size, 2) as loader:
        _held_back(loader, k)
        got = []
        for b, batch in enumerate(loader):
            got.append(_copy(batch))
            if b == k + extra:
                state = loader.state_dict()  # (inside the loop: after this batch)
                break
        assert loader._plan is not None and loader._plan.switched is not None and loader._plan.switched[1] == k
        assert (state["epoch"], state["batches_consumed"]) == (0, k + extra + 1), state
        _same(got, compiled[0][: k + extra + 1], "before the break")
        loader._plan.ready_at = None
        second = [_copy(b) for b in loader]
    _same(second, compiled[1], "the epoch after the break")


def test_close_from_another_thread_during_the_switch_ends_the_epoch(
    images: Path, every_batch: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close()`` from another thread while the switch stops the Python producers: the epoch ends (the loop's
    ``next()`` says it was closed), and no producer of the compiled plan begins (``CompiledEpoch._restart``, shared
    with the fallback to Python producers)."""
    batch_size, k = 16, 3
    began: list[int] = []
    real_stop, real_begin = _engine.CompiledEpoch._stop_producers, _engine.CompiledEpoch._begin

    def stop(self: Any, end: Any) -> None:
        if -1 not in began and not end.by_other_thread and self._loop_thread == threading.get_ident():
            began.append(-1)  # (once: the close below stops the producers itself)
            closer = threading.Thread(target=self.close)
            closer.start()
            closer.join()
        real_stop(self, end)

    def begin(self: Any, plan_: Any, skip: int, slot_base: int) -> None:
        began.append(skip)
        real_begin(self, plan_, skip, slot_base)

    with _loader(images, 2, batch_size, 2) as loader:
        _held_back(loader, k)
        monkeypatch.setattr(_engine.CompiledEpoch, "_stop_producers", stop)
        monkeypatch.setattr(_engine.CompiledEpoch, "_begin", begin)
        it = iter(loader)
        got = [next(it) for _ in range(k)]
        with pytest.raises(StokerError, match="close"):
            next(it)
        assert began == [0, -1], began  # the epoch's own begin, then the closed switch: no begin at batch k
        assert loader._plan is not None and loader._plan.switched is None
    assert len(got) == k


# ---- a real background compilation ----------------------------------------------------------


@pytest.fixture
def background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Background compilation on, and a stoker cache of this test's own: the producer loop is in no cache (nor in this
    process's memos of compiled loops and loaded cache files: see test_cold_start.py)."""
    monkeypatch.setenv("STOKER_COMPILE_IN_BACKGROUND", "1")
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "stoker-cache"))
    monkeypatch.setattr(_planner, "_LOOPS", {})
    monkeypatch.setattr(pipeline_cache, "_LOADED", {})
    for name in [m for m in sys.modules if m.startswith("stoker_fused_")]:
        monkeypatch.delitem(sys.modules, name)
    yield


@pytest.mark.long
def test_a_real_background_compilation_switches_mid_epoch(images: Path, background: None) -> None:
    """The first epoch of a loader whose loop is in no cache: Python producers, then the loop once its child has
    compiled it (the test waits for the child after two batches: the switch is at the next batch boundary the loop
    looks at, within SWITCH_LOOK_NS), the same batches as a loader whose loop was compiled first."""
    batch_size = 7
    with _loader(images, 3, batch_size, 2) as loader:
        it = iter(loader)
        got = [_copy(next(it)), _copy(next(it))]
        plan = loader._plan
        assert plan is not None and plan.background is not None and plan.background.started, "compiling in the background"
        assert not it._batches.compiled  # type: ignore[attr-defined]
        assert plan.background.wait(600) and plan.background.error is None, plan.background.error
        got += [_copy(b) for b in it]
        switched = getattr(plan, "switched", None)
        assert switched is not None, "the epoch should have gone over to the compiled loop before its end"
        epoch, k, seconds = switched
        assert epoch == 0 and 2 <= k < len(got) and seconds > 0, switched
        assert "switched to the compiled producer loop at batch" in loader.report()
    with pytest.MonkeyPatch.context() as m:
        m.setenv("STOKER_COMPILE_IN_BACKGROUND", "0")
        with _loader(images, 3, batch_size, 2) as warm:
            want = [_copy(b) for b in warm]
    _same(got, want, "a real switch vs the loop compiled first")
