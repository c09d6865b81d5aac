"""The Loader's contract with the user's loop: iteration, batch lifetime, seeds per occurrence, arguments, state.

Each test here would fail against a loader that returns wrong data silently:
held batches overwritten, nested or two-thread iteration truncated, repeated
samples sharing one augmentation, masks read as indices, a state restored
into another configuration.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoker.decoders import IntDecoder, NDArrayDecoder, RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder
from stoker.errors import DatasetFormatError, StokerError
from stoker.fields import IntField, NDArrayField, RGBImageField
from stoker.loader import Loader, OrderOption
from stoker.loader import loader as loader_module
from stoker.transforms import RandomHorizontalFlip, ToTensor
from stoker.writer import DatasetWriter

from .._profile import examples
from .conftest import loader_threads, other_loaders_threads

N_TABLE = 1000  # table_path: x[i] = 100 * i + column, y[i] = i


def _labels(batch: tuple) -> np.ndarray:
    return batch[1].numpy().ravel()


@pytest.fixture(scope="module")
def image_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Raw 12x17 images, each different and left-right asymmetric."""
    n = 20
    path = tmp_path_factory.mktemp("contract") / "images.stoker"
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 12, 17, 3), dtype=np.uint8)
    fields = {"image": RGBImageField(), "label": IntField()}
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset(list(zip(images, range(n))))
    return path


# ---- batch lifetime ---------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::UserWarning")
@settings(max_examples=examples(ci=3, long=12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch_size=st.sampled_from([7, 64, 100, 333]),
    batches_ahead=st.integers(1, 5),
    num_workers=st.sampled_from([1, 2]),
    keep_every=st.integers(1, 4),
)
def test_kept_batches_are_never_overwritten(
    table_path: Path, batch_size: int, batches_ahead: int, num_workers: int, keep_every: int
) -> None:
    """Batches kept across batches and epochs keep their values, whatever the slot count."""
    loader = Loader(
        table_path, batch_size=batch_size, num_workers=num_workers, batches_ahead=batches_ahead, order=OrderOption.RANDOM, seed=3
    )
    kept: list[tuple] = []
    expected: list[np.ndarray] = []
    for epoch in range(3):  # across iter(): the last batches of an epoch, then the next epoch's
        order = loader.epoch_indices(epoch)
        for b, batch in enumerate(loader):
            if b % keep_every == 0 or b == len(loader) - 1:
                kept.append(batch)
                expected.append(order[b * batch_size : (b + 1) * batch_size])
    for batch, labels in zip(kept, expected, strict=True):
        np.testing.assert_array_equal(_labels(batch), labels)
        np.testing.assert_array_equal(batch[0].numpy()[:, 0], labels * 100.0)


def test_keeping_many_batches_warns_once(table_path: Path) -> None:
    loader = Loader(table_path, batch_size=2, batches_ahead=1)
    with pytest.warns(loader_module.HeldBatchesWarning, match="fresh memory") as record:
        batches = list(loader)
    assert len(record) == 1
    np.testing.assert_array_equal(np.concatenate([_labels(b) for b in batches]), np.arange(N_TABLE))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("batch_size", [7, 64, 333])
def test_list_of_loader_is_correct(table_path: Path, batch_size: int) -> None:
    """``list(loader)``, the DataLoader habit, gives every batch with its own values."""
    loader = Loader(table_path, batch_size=batch_size, order=OrderOption.SEQUENTIAL, num_workers=2)
    batches = list(loader)
    got = np.concatenate([_labels(b) for b in batches])
    np.testing.assert_array_equal(got, np.arange(N_TABLE))
    np.testing.assert_array_equal(np.concatenate([b[0].numpy()[:, 3] for b in batches]), np.arange(N_TABLE) * 100.0 + 3)


def test_the_common_loop_reuses_memory(table_path: Path) -> None:
    """A loop that keeps nothing never gets fresh memory: the check costs nothing there."""
    loader = Loader(table_path, batch_size=16, order=OrderOption.RANDOM, seed=0, batches_ahead=2)
    for _ in range(2):
        total = 0
        for _, y in loader:
            total += int(y.sum())
        assert total == N_TABLE * (N_TABLE - 1) // 2
    assert loader.stats()["loader"]["kept_batches"] == 0


def test_kept_batch_after_a_break(table_path: Path) -> None:
    """The batch in hand when breaking out stays valid through the next epoch."""
    loader = Loader(table_path, batch_size=10, batches_ahead=6, num_workers=2)
    for _, y in loader:
        if int(y[0]) == 50:
            break
    held = y.numpy().copy()
    for _ in loader:
        pass
    np.testing.assert_array_equal(y.numpy(), held)


# ---- iteration ----------------------------------------------------------------------------------


def test_nested_iteration_raises(table_path: Path) -> None:
    others = other_loaders_threads()
    loader = Loader(table_path, batch_size=100)
    with pytest.raises(StokerError, match="already being iterated"):
        for _ in loader:
            for _ in loader:
                pass
    # the refused iter() started nothing; the outer epoch, dropped by the exception, parks its producers until the
    # next epoch stops them: that epoch is whole
    assert len([y for _, y in loader]) == 10
    assert loader._pool is not None and not loader._pool.busy()
    loader.close()
    assert not [t for t in loader_threads() if t.is_alive() and t not in others]


def test_a_finished_or_dropped_iterator_lets_the_next_epoch_start(table_path: Path) -> None:
    loader = Loader(table_path, batch_size=100)
    it = iter(loader)
    next(it)
    del it  # dropped: its epoch stops
    assert len(list(y for _, y in loader)) == 10
    iter(loader)  # never advanced, then closed by the loader
    loader.close()
    assert sum(1 for _ in loader) == 10


def test_two_threads_cannot_share_a_loader(table_path: Path) -> None:
    """Each thread calling iter() on one Loader: the second is refused, the first sees every sample.

    The first thread holds its epoch open until the second has tried (no sleep: a refusal collects garbage first,
    which on a busy machine took longer than a fixed pause, and the first epoch had ended by then)."""
    loader = Loader(table_path, batch_size=50)
    seen: list[np.ndarray] = []
    errors: list[BaseException] = []
    started = threading.Event()
    tried = threading.Event()

    def consume(first: bool) -> None:
        try:
            for i, (_, y) in enumerate(loader):
                seen.append(y.numpy().ravel().copy())
                if i == 0 and first:
                    started.set()
                    assert tried.wait(60), "the second thread never tried"
        except BaseException as exc:
            errors.append(exc)
        finally:
            if not first:
                tried.set()

    first = threading.Thread(target=consume, args=(True,))
    first.start()
    assert started.wait(60)
    second = threading.Thread(target=consume, args=(False,))
    second.start()
    first.join()
    second.join()
    assert len(errors) == 1 and isinstance(errors[0], StokerError) and "already being iterated" in str(errors[0])
    np.testing.assert_array_equal(np.concatenate(seen), np.arange(N_TABLE))


def test_next_from_two_threads_at_once_raises(table_path: Path) -> None:
    """One iterator shared by two threads: a next() that overlaps another one raises."""

    def slow(batch: object) -> object:
        time.sleep(0.5)
        return batch

    loader = Loader(table_path, batch_size=100, pipelines={"x": None, "y": [IntDecoder(), ToTensor(), slow]})
    it = iter(loader)
    errors: list[BaseException] = []

    def grab() -> None:
        try:
            next(it)
        except BaseException as exc:
            errors.append(exc)

    a = threading.Thread(target=grab)
    a.start()
    time.sleep(0.1)
    grab()
    a.join()
    assert len(errors) == 1 and "two threads" in str(errors[0])
    loader.close()


def test_set_epoch_chooses_the_epoch(table_path: Path) -> None:
    loader = Loader(table_path, batch_size=100, order=OrderOption.RANDOM, seed=4)
    first = [_labels(b).copy() for b in loader]
    second = [_labels(b).copy() for b in loader]
    loader.set_epoch(0)
    again = [_labels(b).copy() for b in loader]
    loader.set_epoch(1)
    assert loader.state_dict()["epoch"] == 1
    again2 = [_labels(b).copy() for b in loader]
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(second, again2, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any((a != b).any() for a, b in zip(first, second, strict=True))
    with pytest.raises(ValueError, match="epoch"):
        loader.set_epoch(-1)


# ---- randomness per occurrence ------------------------------------------------------------------


def test_repeated_samples_get_their_own_augmentation(image_path: Path) -> None:
    """indices=[i] * k: every copy draws its own flip and crop."""
    k = 64
    flip = Loader(image_path, batch_size=k, indices=[3] * k, seed=0, pipelines={
        "image": [SimpleRGBImageDecoder(), RandomHorizontalFlip(), ToTensor()], "label": None})  # fmt: skip
    (images,) = next(iter(flip))
    flipped = np.array([bool((img.numpy() != images[0].numpy()).any()) for img in images])
    assert 0 < flipped.sum() < k  # both outcomes among 64 copies
    crop = Loader(image_path, batch_size=k, indices=[3] * k, seed=0, pipelines={
        "image": [RandomResizedCropRGBImageDecoder((6, 6)), ToTensor()], "label": None})  # fmt: skip
    (crops,) = next(iter(crop))
    distinct = {c.numpy().tobytes() for c in crops}
    assert len(distinct) > k // 2


def test_seeds_are_keyed_by_position_not_by_index(image_path: Path) -> None:
    """Two loaders over different samples draw the same flips at the same positions."""
    pipeline = {"image": [SimpleRGBImageDecoder(), RandomHorizontalFlip(), ToTensor()], "label": None}
    a = Loader(image_path, batch_size=10, indices=list(range(10)), seed=5, pipelines=pipeline)
    b = Loader(image_path, batch_size=10, indices=list(range(10, 20)), seed=5, pipelines=pipeline)
    plain = Loader(image_path, batch_size=20, seed=5, pipelines={"image": [SimpleRGBImageDecoder(), ToTensor()], "label": None})
    (ia,), (ib,), (raw,) = next(iter(a)), next(iter(b)), next(iter(plain))
    flips_a = [bool((ia[i].numpy() != raw[i].numpy()).any()) for i in range(10)]
    flips_b = [bool((ib[i].numpy() != raw[10 + i].numpy()).any()) for i in range(10)]
    assert flips_a == flips_b


# ---- arguments ----------------------------------------------------------------------------------


def test_boolean_mask_selects_samples(table_path: Path) -> None:
    mask = np.zeros(N_TABLE, dtype=bool)
    mask[[5, 17, 900]] = True
    loader = Loader(table_path, batch_size=8, indices=mask)
    np.testing.assert_array_equal(np.concatenate([_labels(b) for b in loader]), [5, 17, 900])
    with pytest.raises(ValueError, match="one entry per sample"):
        Loader(table_path, batch_size=8, indices=mask[:10])


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"indices": np.array([0.0, 1.5])}, TypeError, "integers"),
        ({"indices": [1.0, 2.0]}, TypeError, "integers"),
        ({"indices": [[0, 1]]}, ValueError, "one-dimensional"),
        ({"indices": [0, N_TABLE]}, IndexError, "position 1"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"seed": True}, TypeError, "seed"),
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": 2**64}, ValueError, "seed"),
        ({"num_workers": 1.5}, ValueError, "num_workers"),
        ({"batches_ahead": 0}, ValueError, "batches_ahead"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
    ],
)
def test_bad_arguments_are_refused(table_path: Path, kwargs: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        Loader(table_path, batch_size=8, **kwargs)


def test_num_workers_follows_the_affinity_set(table_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "process_cpu_count", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert loader_module.available_cpus() == 1
    assert Loader(table_path, batch_size=8).num_workers == 1


# ---- state ----------------------------------------------------------------------------------------


def test_state_refuses_another_configuration(table_path: Path, tmp_path: Path) -> None:
    loader = Loader(table_path, batch_size=64, order=OrderOption.RANDOM, seed=1)
    for i, _ in enumerate(loader):
        if i == 2:
            state = loader.state_dict()  # inside the loop (after break, it is the next epoch's start)
            break
    for kwargs, words in [
        ({"batch_size": 32}, "batch_size: saved 64, this loader 32"),
        ({"order": OrderOption.SEQUENTIAL}, "order: saved 'RANDOM'"),
        ({"drop_last": True}, "drop_last"),
        ({"indices": np.arange(500)}, "indices.count"),
        ({"seed": 2}, "seed: saved 1, this loader 2"),
    ]:
        args = {"batch_size": 64, "order": OrderOption.RANDOM, "seed": 1} | kwargs
        with pytest.raises(StokerError, match=re.escape(words)):
            Loader(table_path, **args).load_state_dict(state)
    other = tmp_path / "other.stoker"
    DatasetWriter(other, {"x": NDArrayField(shape=(5,), dtype=np.dtype("float32")), "y": IntField()}, progress=False).from_arrays(
        {"x": np.zeros((N_TABLE, 5), np.float32), "y": np.arange(N_TABLE)}
    )
    with pytest.raises(StokerError, match=re.escape("dataset.checksum_table_crc")):
        Loader(other, batch_size=64, order=OrderOption.RANDOM, seed=1).load_state_dict(state)
    resumed = Loader(table_path, batch_size=64, order=OrderOption.RANDOM, seed=1)
    resumed.load_state_dict(state)
    assert len(list(resumed)) == len(loader) - 3


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"epoch": -1}, "epoch must be an int >= 0"),
        ({"batches_consumed": -2}, "batches_consumed must be an int >= 0"),
        ({"batches_consumed": 17}, "more than the 16 batches"),
        ({"epoch": True}, "epoch must be"),
        ({"seed": 0.5}, "seed"),
        ({"version": 1}, "version 1"),
        ({"version": 2}, "version 2"),  # saved before RANDOM orders came from the compiled shuffle
    ],
)
def test_invalid_states_are_refused(table_path: Path, change: dict, words: str) -> None:
    loader = Loader(table_path, batch_size=64, seed=0)
    state = loader.state_dict() | change
    with pytest.raises((StokerError, TypeError), match=words):
        loader.load_state_dict(state)


def test_resume_at_the_end_of_an_epoch_starts_the_next(table_path: Path) -> None:
    loader = Loader(table_path, batch_size=100, order=OrderOption.RANDOM, seed=9)
    it = iter(loader)
    for _ in range(len(loader)):
        next(it)  # every batch taken, StopIteration not reached
    state = loader.state_dict()
    assert (state["epoch"], state["batches_consumed"]) == (1, 0)
    resumed = Loader(table_path, batch_size=100, order=OrderOption.RANDOM, seed=9)
    resumed.load_state_dict(state)
    first = _labels(next(iter(resumed)))
    np.testing.assert_array_equal(first, loader.epoch_indices(1)[:100])


# ---- statistics ---------------------------------------------------------------------------------------


def test_stats_can_be_read_while_an_epoch_runs(table_path: Path) -> None:
    loader = Loader(table_path, batch_size=10, num_workers=2)
    keys = {field: set(stages) for field, stages in loader.stats().items()}
    for _ in loader:
        assert {field: set(stages) for field, stages in loader.stats().items()} == keys  # no key appears mid-epoch
    assert loader.stats()["x"][next(k for k in keys["x"] if k.startswith("compiled"))] > 0


# ---- the file ----------------------------------------------------------------------------------------


def test_a_file_changed_in_place_is_refused(table_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "copy.stoker"
    shutil.copy(table_path, path)
    loader = Loader(path, batch_size=100)
    assert len(list(loader)) == 10
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # as `cp new old` would leave it
    with pytest.raises(DatasetFormatError, match="rename"):
        iter(loader)


def test_a_file_replaced_by_rename_keeps_the_old_data(table_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "copy.stoker"
    shutil.copy(table_path, path)
    loader = Loader(path, batch_size=100)
    tmp = tmp_path / "new.stoker"
    shutil.copy(table_path, tmp)
    os.replace(tmp, path)
    np.testing.assert_array_equal(np.concatenate([_labels(b).copy() for b in loader]), np.arange(N_TABLE))


# ---- os_cache=False ------------------------------------------------------------------------------------


def _rss_file_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssFile:"):
                return int(line.split()[1])
    pytest.skip("no RssFile in /proc/self/status")
    return 0


@pytest.fixture(scope="module")
def wide_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 40 MB of 4 KiB rows."""
    n = 10_000
    path = tmp_path_factory.mktemp("wide") / "wide.stoker"
    x = np.broadcast_to(np.arange(n, dtype=np.float32)[:, None], (n, 1024))
    DatasetWriter(path, {"x": NDArrayField(shape=(1024,), dtype=np.dtype("float32")), "y": IntField()}, progress=False).from_arrays(
        {"x": x, "y": np.arange(n)}
    )
    return path


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
@pytest.mark.parametrize("order", [OrderOption.RANDOM, OrderOption.QUASI_RANDOM])
def test_os_cache_false_bounds_the_pages_mapped(wide_path: Path, order: OrderOption, monkeypatch: pytest.MonkeyPatch) -> None:
    size_kib = wide_path.stat().st_size // 1024
    monkeypatch.setenv("STOKER_IN_MEMORY_BYTES", "0")  # (os_cache=True reads the memory map, whose pages the measure sees)

    def mapped_after_epoch(os_cache: bool) -> int:
        loader = Loader(wide_path, batch_size=256, num_workers=2, order=order, seed=0, os_cache=os_cache,
                        pipelines={"x": [NDArrayDecoder(), ToTensor()], "y": None})  # fmt: skip
        assert loader._producers == 2
        before = _rss_file_kib()
        total = 0.0
        for (x,) in loader:
            total += float(x[:, 0].sum())
        assert total == sum(range(10_000))
        grown = _rss_file_kib() - before
        del loader
        return grown

    cached = mapped_after_epoch(True)
    released = mapped_after_epoch(False)
    assert cached > size_kib // 2  # the measure sees the file's pages when they are kept
    assert released < size_kib // 5, f"os_cache=False kept {released} KiB of a {size_kib} KiB file mapped"


def test_recompile_applies_changed_parameters(image_path: Path) -> None:
    decoder = RandomResizedCropRGBImageDecoder((8, 8))
    loader = Loader(image_path, batch_size=4, recompile=True, pipelines={"image": [decoder, ToTensor()], "label": None})
    assert next(iter(loader))[0].shape == (4, 8, 8, 3)
    decoder.output_size = (5, 6)
    assert next(iter(loader))[0].shape == (4, 5, 6, 3)
