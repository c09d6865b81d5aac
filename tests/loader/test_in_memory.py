"""A small dataset file read with ``os_cache=True`` is served from a copy in the loader's memory (``STOKER_IN_MEMORY_BYTES``).

The copy (huge pages where the kernel gives them: a quarter less time per random batch of a table) must be invisible
but for speed: the same batches as through the memory map, read-only, on a page boundary (the file's offsets keep
their alignment); a file over the limit is mapped as before; a limit that is not a number is refused by name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.fields import IntField, NDArrayField
from stoker.loader import Loader, OrderOption
from stoker.transforms import ToTensor
from stoker.writer import DatasetWriter

from .._profile import examples

N = 300


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("in_memory") / "table.stoker"
    x = np.random.default_rng(5).standard_normal((N, 7)).astype(np.float32)
    fields = {"x": NDArrayField(np.dtype(np.float32), (7,)), "y": IntField()}
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset([(x[i], i) for i in range(N)])
    return path


def _epochs(loader: Loader, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.array(x.numpy()), np.array(y.numpy())) for _ in range(n) for x, y in loader]


def _loader(path: Path, limit: str | None, **kw: object) -> Loader:
    env = {} if limit is None else {"STOKER_IN_MEMORY_BYTES": limit}
    with mock.patch.dict(os.environ, env):
        if limit is None:
            os.environ.pop("STOKER_IN_MEMORY_BYTES", None)
        return Loader(path, pipelines={"x": [NDArrayDecoder(), ToTensor()], "y": [IntDecoder(), ToTensor()]}, **kw)  # type: ignore[arg-type]


@settings(max_examples=examples(5, 25), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    batch_size=st.integers(1, 64),
    workers=st.integers(1, 2),
    order=st.sampled_from([OrderOption.RANDOM, OrderOption.SEQUENTIAL]),
)
def test_the_copy_gives_the_memory_maps_batches(table: Path, seed: int, batch_size: int, workers: int, order: OrderOption) -> None:
    kw = {"batch_size": batch_size, "num_workers": workers, "order": order, "seed": seed}
    with _loader(table, "0", **kw) as mapped, _loader(table, None, **kw) as copied:
        assert isinstance(mapped.reader.storage, np.memmap)
        storage = copied.reader.storage
        assert not isinstance(storage, np.memmap) and not storage.flags.writeable
        assert storage.ctypes.data % 4096 == 0 and len(storage) == table.stat().st_size
        np.testing.assert_array_equal(storage, np.fromfile(table, dtype=np.uint8))
        want, got = _epochs(mapped, 2), _epochs(copied, 2)
        assert len(want) == len(got)
        for b, ((wx, wy), (gx, gy)) in enumerate(zip(want, got, strict=True)):
            np.testing.assert_array_equal(gx, wx, err_msg=f"batch {b}")
            np.testing.assert_array_equal(gy, wy, err_msg=f"batch {b}")


def test_a_file_over_the_limit_is_mapped(table: Path) -> None:
    size = table.stat().st_size
    with _loader(table, str(size - 1), batch_size=10) as over, _loader(table, str(size), batch_size=10) as within:
        assert isinstance(over.reader.storage, np.memmap)
        assert not isinstance(within.reader.storage, np.memmap)
    with _loader(table, None, batch_size=10, os_cache=False) as bounded:  # (os_cache=False: the bounded cache, as before)
        assert bounded.reader.cache is not None  # type: ignore[union-attr]


@pytest.mark.parametrize("value", ["64M", "-1", "1.5"])
def test_a_limit_that_is_not_a_number_of_bytes_is_refused(table: Path, value: str) -> None:
    with pytest.raises(
        ValueError, match=re.escape(f"$STOKER_IN_MEMORY_BYTES='{value}': expected a whole number of bytes >= 0 (0: never copy)")
    ):
        _loader(table, value, batch_size=10)


def test_a_file_changed_after_it_was_opened_is_not_copied(table: Path, tmp_path: Path) -> None:
    """The copy must be the bytes that were validated at open: a file whose identity moved since (rewritten in place,
    here only its time) is refused by name, not served."""
    import shutil

    from stoker.errors import DatasetFormatError
    from stoker.format import Reader

    path = tmp_path / "moved.stoker"
    shutil.copyfile(table, path)
    reader = Reader(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(DatasetFormatError, match=r"moved\.stoker.*changed while it was opened"):
        reader.load_into_memory()
    assert isinstance(reader.storage, np.memmap)  # (left as it was)
