"""distributed=True: equal shares of one global order, augmentations keyed by global position, per-rank resume."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.decoders import SimpleRGBImageDecoder
from stoker.fields import IntField, RGBImageField
from stoker.loader import Loader, OrderOption
from stoker.transforms import RandomHorizontalFlip, ToTensor
from stoker.writer import DatasetWriter

# the subject is the ranks' shares of the order: under ``ci`` Python producers make the batches (tests/_profile.py)
pytestmark = pytest.mark.usefixtures("python_producers_unless_long")

N_TABLE = 1000  # table_path: y[i] = i
BATCH = 64


def _labels(loader: Loader) -> list[np.ndarray]:
    return [y.numpy().ravel().copy() for _, y in loader]


def _ranks(path: Path, world_size: int, **kwargs: Any) -> list[Loader]:
    return [Loader(path, distributed=True, rank=r, world_size=world_size, **kwargs) for r in range(world_size)]


@pytest.fixture(scope="module")
def image_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Raw 12x17 images, each different and left-right asymmetric; label = index."""
    n = 20
    path = tmp_path_factory.mktemp("distributed") / "images.stoker"
    images = np.random.default_rng(0).integers(0, 256, (n, 12, 17, 3), dtype=np.uint8)
    fields = {"image": RGBImageField(), "label": IntField()}
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset(list(zip(images, range(n))))
    return path


@pytest.mark.parametrize("order", list(OrderOption))
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_ranks_share_one_global_order(table_path: Path, order: OrderOption, drop_last: bool, world_size: int) -> None:
    """Ranks' blocks, in rank order, are the single-process order (padded or cut); equal batch counts; coverage."""
    kwargs: dict[str, Any] = {"batch_size": BATCH, "order": order, "drop_last": drop_last, "seed": 7, "num_workers": 1,
                              "chunk_size": 50, "window_chunks": 3}  # fmt: skip
    whole = Loader(table_path, **kwargs).epoch_indices(1)
    loaders = _ranks(table_path, world_size, **kwargs)
    loaders[0].set_epoch(1)
    for loader in loaders[1:]:
        loader.set_epoch(1)
    per_rank = [_labels(loader) for loader in loaders]
    counts = {len(batches) for batches in per_rank}
    assert counts == {len(loaders[0])}, "ranks have different batch counts"
    shares = [np.concatenate(batches) for batches in per_rank]
    for loader, share in zip(loaders, shares):
        np.testing.assert_array_equal(share, loader.epoch_indices(1))
    assert len({len(s) for s in shares}) == 1
    joined = np.concatenate(shares)
    if drop_last:
        assert all(len(b) == BATCH for batches in per_rank for b in batches)
        assert N_TABLE - world_size * BATCH < len(joined) <= N_TABLE
        np.testing.assert_array_equal(joined, whole[: len(joined)])  # the dropped samples are the global order's tail
        assert len(np.unique(joined)) == len(joined)
    else:
        pad = len(joined) - N_TABLE
        assert 0 <= pad <= world_size - 1
        np.testing.assert_array_equal(joined[:N_TABLE], whole)
        np.testing.assert_array_equal(joined[N_TABLE:], whole[:pad])  # padding repeats the first samples
        assert set(joined.tolist()) == set(range(N_TABLE))


def test_padding_when_fewer_samples_than_ranks(table_path: Path) -> None:
    loaders = _ranks(table_path, 5, batch_size=4, indices=[10, 11], seed=0)
    shares = [np.concatenate(_labels(loader)) for loader in loaders]
    assert [s.tolist() for s in shares] == [[10], [11], [10], [11], [10]]
    assert {len(loader) for loader in _ranks(table_path, 5, batch_size=4, indices=[10, 11], seed=0, drop_last=True)} == {0}


def _flips(path: Path, world_size: int, order: OrderOption) -> dict[int, tuple[int, bytes]]:
    """Global position -> (sample, flipped image bytes), over every rank."""
    pipeline = {"image": [SimpleRGBImageDecoder(), RandomHorizontalFlip(), ToTensor()]}
    out = {}
    for loader in _ranks(path, world_size, batch_size=3, order=order, seed=5, pipelines=pipeline):
        first = loader.rank * len(loader.epoch_indices(0))
        batches = [(x.numpy().copy(), y.numpy().ravel().copy()) for x, y in loader]
        images = np.concatenate([x for x, _ in batches])
        labels = np.concatenate([y for _, y in batches])
        for k, (image, label) in enumerate(zip(images, labels)):
            out[first + k] = (int(label), image.tobytes())
    return out


@pytest.mark.parametrize("order", [OrderOption.SEQUENTIAL, OrderOption.RANDOM])
def test_augmentation_depends_on_global_position_not_world_size(image_path: Path, order: OrderOption) -> None:
    """The same sample at the same global position gets the same flip for world sizes 1 and 3."""
    one, three = _flips(image_path, 1, order), _flips(image_path, 3, order)
    assert len(one) == 20 and len(three) == 21  # 20 samples; 3 ranks pad one
    raw = Loader(image_path, batch_size=20, seed=5, pipelines={"image": [SimpleRGBImageDecoder(), ToTensor()]})
    raw_images, raw_labels = (t.numpy() for t in next(iter(raw)))
    plain = {int(y): x.tobytes() for x, y in zip(raw_images, raw_labels.ravel())}
    flipped = [one[p][1] != plain[one[p][0]] for p in one]
    assert 0 < sum(flipped) < len(flipped), "the test needs both outcomes"
    for position, (sample, image) in one.items():
        assert three[position][0] == sample
        assert three[position][1] == image, f"sample {sample} at global position {position} drew another flip"


@pytest.mark.parametrize("order", list(OrderOption))
def test_state_dict_resumes_each_rank(table_path: Path, order: OrderOption) -> None:
    kwargs: dict[str, Any] = {"batch_size": 32, "order": order, "seed": 11, "num_workers": 1, "chunk_size": 40}
    for rank in range(3):
        reference = Loader(table_path, distributed=True, rank=rank, world_size=3, **kwargs)
        expected = _labels(reference) + _labels(reference)  # epochs 0 and 1
        interrupted = Loader(table_path, distributed=True, rank=rank, world_size=3, **kwargs)
        it = iter(interrupted)
        seen = [next(it)[1].numpy().ravel().copy() for _ in range(4)]
        state = interrupted.state_dict()
        del it
        assert state["rank"] == rank and state["world_size"] == 3 and state["seen"] == []
        restarted = Loader(table_path, distributed=True, rank=rank, world_size=3, **kwargs)
        restarted.load_state_dict(state)
        seen += _labels(restarted) + _labels(restarted)
        assert len(seen) == len(expected)
        for a, b in zip(seen, expected):
            np.testing.assert_array_equal(a, b)


def test_state_of_another_rank_or_world_size_is_taken(table_path: Path) -> None:
    """Ranks step in lockstep: any rank's state resumes every rank, on any number of ranks (tests/loader/test_elastic.py)."""
    state = Loader(table_path, batch_size=32, distributed=True, rank=1, world_size=3, seed=0).state_dict()
    other = Loader(table_path, batch_size=32, distributed=True, rank=2, world_size=3, seed=0)
    other.load_state_dict(state)
    assert other.state_dict()["batches_consumed"] == 0 and len(other) == 11
    more = Loader(table_path, batch_size=32, distributed=True, rank=1, world_size=4, seed=0)
    more.load_state_dict(state)
    assert len(more) == 8


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"distributed": True, "rank": -1, "world_size": 3}, ValueError, r"rank must lie in \[0, world_size\) = \[0, 3\); got -1"),
        ({"distributed": True, "rank": 3, "world_size": 3}, ValueError, r"rank must lie in .*got 3"),
        ({"distributed": True, "rank": 0, "world_size": 0}, ValueError, "world_size must be >= 1; got 0"),
        ({"distributed": True, "rank": 1.0, "world_size": 3}, TypeError, "rank must be an int; got float 1.0"),
        ({"distributed": True, "rank": True, "world_size": 3}, TypeError, "rank must be an int; got bool"),
        ({"distributed": True, "rank": 0, "world_size": "2"}, TypeError, "world_size must be an int; got str"),
        ({"distributed": True, "rank": 1}, ValueError, "rank and world_size go together"),
        ({"distributed": True, "world_size": 2}, ValueError, "rank and world_size go together"),
        ({"rank": 0, "world_size": 2}, ValueError, "rank and world_size are for distributed=True"),
        ({"distributed": True}, RuntimeError, "init_process_group"),
    ],
)
def test_invalid_ranks_are_refused(table_path: Path, kwargs: dict[str, Any], error: type[Exception], words: str) -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(error, match=words):
        Loader(table_path, batch_size=8, seed=0, **kwargs)


def test_ranks_need_a_shared_seed(table_path: Path) -> None:
    with pytest.raises(ValueError, match="seed must be given with distributed=True"):
        Loader(table_path, batch_size=8, distributed=True, rank=0, world_size=2)
    assert Loader(table_path, batch_size=8, distributed=True, rank=0, world_size=1).world_size == 1


_GLOO_RANK = """
import json, sys
import numpy as np
import torch.distributed as dist
from stoker.loader import Loader, OrderOption

path, port, rank, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
try:
    loader = Loader(path, batch_size=64, order=OrderOption.RANDOM, seed=3, num_workers=1, distributed=True)
    labels = [y.numpy().ravel().tolist() for _, y in loader]
    count = [len(labels)]
    counts = [None, None]
    dist.all_gather_object(counts, count)
    with open(out, "w") as f:
        json.dump({"rank": loader.rank, "world_size": loader.world_size, "labels": labels, "counts": counts}, f)
finally:
    dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(300)
def test_gloo_process_group_gives_rank_and_world_size(table_path: Path, tmp_path: Path) -> None:
    """Two processes in a gloo group: each loads its block; together they cover the dataset."""
    port = _free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    script = textwrap.dedent(_GLOO_RANK)
    args = [[sys.executable, "-c", script, str(table_path), str(port), str(r), str(outs[r])] for r in range(2)]
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for a in args]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    results = [json.loads(out.read_text()) for out in outs]
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)]
    assert results[0]["counts"] == [[8], [8]]  # 500 samples each: 8 batches on both ranks
    expected = Loader(table_path, batch_size=64, order=OrderOption.RANDOM, seed=3).epoch_indices(0)
    joined = np.concatenate([np.concatenate(r["labels"]) for r in results])
    np.testing.assert_array_equal(joined, expected)
    for r in results:
        assert sum(len(b) for b in r["labels"]) == 500
