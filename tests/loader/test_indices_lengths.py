"""``return_indices`` and ``return_lengths``: each batch's dataset indices and its variable-size fields' lengths.

Checked against the reader's own values (``Reader.read``) after shuffling,
with one and several producer threads, in tuples and dicts, across a resume,
and for batches kept while the loader reuses its memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stoker.decoders import BytesDecoder, IntDecoder, RaggedArrayDecoder
from stoker.fields import JSONField
from stoker.format.reader import Reader
from stoker.loader import Loader, OrderOption
from stoker.transforms import ToTensor

from .conftest import N_SAMPLES

# the mixed file's fields: x, y (= the index), f, b (bytes), j (JSON), r (ragged int16), img
NO_IMAGE: dict[str, Any] = {"img": None}  # without the image decoder every operation is reentrant: two producers
VARIABLE = ["b", "j", "r"]


# under ``make test`` Python producers make the batches: indices and lengths, not the loop, is the subject (tests/_profile.py)
pytestmark = pytest.mark.usefixtures("python_producers_unless_long")


@pytest.fixture(scope="module")
def truth(mixed_path: Path) -> list[tuple[Any, ...]]:
    with Reader(mixed_path) as reader:
        return [reader.read(i) for i in range(len(reader))]


def check_batch(batch: dict[str, Any], truth: list[tuple[Any, ...]]) -> None:
    index = batch["index"]
    assert index.dtype == torch.int64 and index.shape == (len(batch["y"]),)
    np.testing.assert_array_equal(batch["y"].numpy()[:, 0], index.numpy())  # y[i] = i: the indices are the batch's
    for k, i in enumerate(index.tolist()):
        _, _, _, b, j, r, _ = truth[i]
        assert batch["b_lengths"][k] == len(b)
        assert bytes(batch["b"][k, : len(b)].numpy()) == bytes(b)
        assert batch["r_lengths"][k] == len(r)
        np.testing.assert_array_equal(batch["r"][k, : len(r)].numpy(), r)
        assert not batch["r"][k, len(r) :].numpy().any()
        assert batch["j_lengths"][k] == len(JSONField().encode(j, i)[1] or b"")
    for name in VARIABLE:
        lengths = batch[f"{name}_lengths"]
        assert lengths.dtype == torch.int64 and lengths.shape == index.shape
    values = JSONField.unpack(batch["j"], batch["j_lengths"])
    assert values == [truth[i][4] for i in index.tolist()]


@pytest.mark.parametrize("num_workers", [1, 3])
def test_indices_and_lengths_match_the_file_after_shuffling(mixed_path: Path, truth: list, num_workers: int) -> None:
    loader = Loader(mixed_path, batch_size=16, num_workers=num_workers, order=OrderOption.RANDOM, seed=3, named=True,
                    pipelines=NO_IMAGE, return_indices=True, return_lengths=True)  # fmt: skip
    assert loader._producers == min(num_workers, 2)
    for epoch in range(2):
        seen = []
        for batch in loader:
            assert list(batch) == ["x", "y", "f", "b", "b_lengths", "j", "j_lengths", "r", "r_lengths", "index"]
            check_batch(batch, truth)
            seen.append(batch["index"].numpy().copy())
        order = np.concatenate(seen)
        np.testing.assert_array_equal(order, loader.epoch_indices(epoch))
        assert sorted(order.tolist()) == list(range(N_SAMPLES)) and order.tolist() != list(range(N_SAMPLES))


def test_tuples_put_lengths_after_their_field_and_indices_last(mixed_path: Path, truth: list) -> None:
    loader = Loader(mixed_path, batch_size=10, num_workers=2, order=OrderOption.QUASI_RANDOM, seed=1, pipelines=NO_IMAGE,
                    return_indices=True, return_lengths=True)  # fmt: skip
    names = ["x", "y", "f", "b", "b_lengths", "j", "j_lengths", "r", "r_lengths", "index"]
    assert loader.output_names == names
    for batch in loader:
        assert isinstance(batch, tuple) and len(batch) == len(names)
        check_batch(dict(zip(names, batch)), truth)


@pytest.mark.filterwarnings("ignore::stoker.loader.HeldBatchesWarning")
def test_kept_batches_keep_their_indices_and_lengths(mixed_path: Path, truth: list) -> None:
    """list(loader): the loader reuses slot memory, never the indices or lengths of a batch you hold."""
    loader = Loader(mixed_path, batch_size=8, num_workers=2, order=OrderOption.RANDOM, seed=5, named=True, batches_ahead=1,
                    pipelines=NO_IMAGE, return_indices=True, return_lengths=True)  # fmt: skip
    kept = list(loader)
    assert len(kept) == len(loader) > loader._num_slots
    for batch in kept:
        check_batch(batch, truth)
    pointers = {b["index"].data_ptr() for b in kept} | {b["r_lengths"].data_ptr() for b in kept}
    assert len(pointers) == 2 * len(kept), "two batches share index or length memory"


def test_only_the_named_fields_get_lengths_and_a_max_length_cuts_them(mixed_path: Path, truth: list) -> None:
    loader = Loader(mixed_path, batch_size=32, order=OrderOption.RANDOM, seed=2, named=True, return_indices=True,
                    return_lengths=["r"], pipelines={"r": [RaggedArrayDecoder(max_length=3), ToTensor()], "y": None, "x": None,
                                                     "f": None, "b": None, "j": None, "img": None})  # fmt: skip
    assert loader.output_names == ["r", "r_lengths", "index"]
    for batch in loader:
        for k, i in enumerate(batch["index"].tolist()):
            r = truth[i][5]
            assert batch["r_lengths"][k] == min(len(r), 3)
            np.testing.assert_array_equal(batch["r"][k, : min(len(r), 3)].numpy(), r[:3])


def test_a_resumed_epoch_yields_the_same_indices(mixed_path: Path) -> None:
    def make() -> Loader:
        return Loader(mixed_path, batch_size=20, num_workers=2, order=OrderOption.RANDOM, seed=9, pipelines=NO_IMAGE,
                      return_indices=True)  # fmt: skip

    whole = [batch[-1].numpy().copy() for batch in make()]
    first = make()
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    first.close()
    resumed = make()
    resumed.load_state_dict(state)
    rest = [batch[-1].numpy().copy() for batch in resumed]
    assert len(rest) == len(whole) - 4
    for a, b in zip(rest, whole[4:]):
        np.testing.assert_array_equal(a, b)


def test_indices_of_a_subset_and_a_partial_last_batch(mixed_path: Path) -> None:
    subset = np.array([5, 5, 200, 3, 17, 100, 99])
    loader = Loader(mixed_path, batch_size=3, indices=subset, order=OrderOption.RANDOM, seed=0,
                    pipelines={"y": [IntDecoder(), ToTensor()], "b": [BytesDecoder(), ToTensor()], "x": None, "f": None,
                               "j": None, "r": None, "img": None}, return_indices=True, return_lengths=True)  # fmt: skip
    batches = list(loader)
    assert [len(b[-1]) for b in batches] == [3, 3, 1]
    got = np.concatenate([b[-1].numpy() for b in batches])
    assert sorted(got.tolist()) == sorted(subset.tolist())
    for y, _, b_lengths, index in batches:
        np.testing.assert_array_equal(y.numpy()[:, 0], index.numpy())
        np.testing.assert_array_equal(b_lengths.numpy(), index.numpy() % 11)  # the mixed file's bytes have i % 11 bytes


def test_unpack_refuses_lengths_that_do_not_fit() -> None:
    batch = np.array([[123, 125, 0], [91, 49, 93]], np.uint8)
    assert JSONField.unpack(batch) == JSONField.unpack(batch, np.array([2, 3])) == [{}, [1]]
    assert JSONField.unpack(np.array([[49, 50, 51]], np.uint8), torch.tensor([1])) == [1]  # exactly the first bytes
    for bad in ([2], [2, 4], [-1, 3], [2.0, 3.0]):
        with pytest.raises(ValueError, match="lengths must hold one integer"):
            JSONField.unpack(batch, np.array(bad))


def test_json_values_in_the_pipeline(mixed_path: Path, truth: list) -> None:
    """``JSONField.unpack`` as the last operation: the field yields a list of values."""
    loader = Loader(mixed_path, batch_size=50, order=OrderOption.RANDOM, seed=4, named=True, return_indices=True,
                    pipelines={"j": [BytesDecoder(), ToTensor(), JSONField.unpack], "x": None, "y": None, "f": None, "b": None,
                               "r": None, "img": None})  # fmt: skip
    for batch in loader:
        assert batch["j"] == [truth[i][4] for i in batch["index"].tolist()]
