"""Small datasets for loader tests, written once per session."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import numpy as np
import pytest

from stoker.fields import BytesField, FloatField, IntField, JSONField, NDArrayField, RaggedArrayField, RGBImageField
from stoker.loader import _engine
from stoker.writer import DatasetWriter

from .._profile import python_producers_unless_long as _python_producers_unless_long

N_SAMPLES = 237  # not a multiple of the batch sizes used
#: the CPUs compiled epochs see in these tests: more than any worker count drawn, so that every producer runs
#: (on a small machine one would give way to the loop); tests of fewer CPUs pin their own count
MANY_CPUS = 64


@pytest.fixture(autouse=True)
def _many_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_engine, "_cpus", lambda: MANY_CPUS)


class MixedDataset:
    """One value of every type per sample; values are a function of the index."""

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> tuple:
        rng = np.random.default_rng(i)
        return (
            rng.standard_normal((3, 4)).astype(np.float32),
            i,
            i / 7.0,
            bytes(rng.integers(0, 256, i % 11, dtype=np.uint8)),
            {"i": i, "name": f"échantillon-{i}"},
            np.arange(i % 6, dtype=np.int16) * (i + 1),
            rng.integers(0, 256, (8, 6, 3), dtype=np.uint8),
        )


MIXED_FIELDS = {
    "x": NDArrayField(shape=(3, 4), dtype=np.dtype("float32")),
    "y": IntField(),
    "f": FloatField(),
    "b": BytesField(),
    "j": JSONField(),
    "r": RaggedArrayField(np.int16),
    "img": RGBImageField(),
}


@pytest.fixture
def python_producers_unless_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python producers under ``make test`` (``tests/_profile.py``), for files whose subject is not the producer loop.

    A file asks for it with ``pytestmark = pytest.mark.usefixtures("python_producers_unless_long")``.
    """
    _python_producers_unless_long(monkeypatch)


@pytest.fixture(scope="session")
def mixed_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("loader") / "mixed.stoker"
    DatasetWriter(path, MIXED_FIELDS, num_workers=1, progress=False).from_indexed_dataset(MixedDataset())
    return path


@pytest.fixture(scope="session")
def table_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An Otto-like table: x[i] = i + column, y[i] = i."""
    n = 1000
    path = tmp_path_factory.mktemp("loader") / "table.stoker"
    x = (np.arange(n, dtype=np.float32)[:, None] * 100 + np.arange(5, dtype=np.float32)).astype(np.float32)
    y = np.arange(n)
    DatasetWriter(path, {"x": NDArrayField(shape=(5,), dtype=np.dtype("float32")), "y": IntField()}, progress=False).from_arrays(
        {"x": x, "y": y}
    )
    return path


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("stoker-")]


def other_loaders_threads() -> frozenset[threading.Thread]:
    """The producer threads alive before a test makes its loader, garbage collected first.

    An earlier test's loader held by a reference cycle (the first epoch to compile a loop stays on that
    compile's stack, which Numba's typing keeps in one) keeps its threads until the collector runs; one
    held otherwise keeps them longer. A test that counts threads counts only those not in this set.
    """
    gc.collect()
    return frozenset(loader_threads())
