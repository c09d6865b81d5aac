"""Elastic resume: a state saved on N ranks resumes on M ranks (then on P), every sample of the epoch loaded once.

A plain-list reference model (``_Reference``) says which global positions each rank loads in each run; real
``Loader(distributed=True, rank=r, world_size=W)`` objects, many in one process, must yield exactly those samples, and
the samples' augmentation keys (their global positions) must not change. One test runs real processes in gloo groups.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.decoders import SimpleRGBImageDecoder
from stoker.errors import StokerError
from stoker.fields import IntField, RGBImageField
from stoker.loader import Loader, OrderOption
from stoker.loader.distributed import check_intervals, combine_states, elastic_share, positions_of, rank_share, seen_after, share_batches
from stoker.transforms import RandomHorizontalFlip, ToTensor
from stoker.writer import DatasetWriter

from .._profile import examples

# the subject is which samples each rank loads: under ``ci`` Python producers make the batches (tests/_profile.py)
pytestmark = pytest.mark.usefixtures("python_producers_unless_long")

N_FILE = 50  # elastic_path: y[i] = i


@pytest.fixture(scope="module")
def elastic_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("elastic") / "table.stoker"
    DatasetWriter(path, {"y": IntField()}, num_workers=1, progress=False).from_arrays({"y": np.arange(N_FILE)})
    return path


# ---- the reference model ---------------------------------------------------------------------------------------------


class _Reference:
    """An epoch of ``n`` positions run by successive jobs, in plain lists.

    A job over the positions left splits them as ``rank_share`` splits an epoch: ``W`` equal blocks of the
    left positions in global order, padded with the first left positions again (keys ``n + j``) or cut to full
    batches (``drop_last``). A job on as many ranks as the previous lockstep one continues its blocks.
    """

    def __init__(self, n: int, batch_size: int, drop_last: bool) -> None:
        self.n, self.batch_size, self.drop_last = n, batch_size, drop_last
        self.seen: set[int] = set()  # positions handed out by finished jobs
        self.blocks: list[list[tuple[int, int]]] = []  # the current job: rank -> [(position, key)]
        self.start = 0  # batches of the current job's blocks already handed out (same-size lockstep resume)

    def split(self, world_size: int) -> None:
        left = [p for p in range(self.n) if p not in self.seen]
        c, bs = len(left), self.batch_size
        share = c // (world_size * bs) * bs if self.drop_last else -(-c // world_size)
        ext = [(p, p) for p in left] + [(left[j % c], self.n + j) for j in range(share * world_size - c)]
        self.blocks = [ext[r * share : (r + 1) * share] for r in range(world_size)]
        self.start = 0

    def batches(self, rank: int) -> list[list[tuple[int, int]]]:
        block, bs = self.blocks[rank], self.batch_size
        return [block[b : b + bs] for b in range(self.start * bs, len(block), bs)]

    def hand_out(self, consumed: list[int]) -> None:
        """Rank ``r`` of the current job handed out ``consumed[r]`` batches (of what it had left): they are seen."""
        for rank, k in enumerate(consumed):
            for batch in self.batches(rank)[:k]:
                self.seen.update(p for p, key in batch if key < self.n)

    def __len__(self) -> int:
        return len(self.batches(0))


def _drain(loader: Loader, batches: int | None = None, states: list[dict[str, Any]] | None = None) -> list[np.ndarray]:
    """The indices of the next ``batches`` batches (all the epoch's with ``None``); the loader's state after them appended
    to ``states``, saved inside the loop (once the loop is left, ``state_dict()`` is the next epoch's start)."""
    out = []
    it = iter(loader)
    for _ in range(len(loader) if batches is None else batches):
        out.append(next(it)[-1].numpy().copy())
    if states is not None:
        states.append(loader.state_dict())
    del it
    return out


def _keys(loader: Loader, epoch: int, skip: int) -> np.ndarray:
    """The augmentation keys (global positions) of the rank's samples from batch ``skip`` on."""
    order, runs = loader._epoch_share(epoch)
    return positions_of(runs, skip * loader.batch_size, len(order))


def _job(path: Path, world_size: int, state: dict[str, Any] | None, **kwargs: Any) -> list[Loader]:
    loaders = [Loader(path, distributed=True, rank=r, world_size=world_size, return_indices=True, **kwargs) for r in range(world_size)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    return loaders


def _run_job(
    loaders: list[Loader], ref: _Reference, order: np.ndarray, consumed: list[int], epoch: int = 0
) -> tuple[list[dict[str, Any]], list[int]]:
    """Each rank hands out ``consumed[r]`` batches; checks them against the reference; returns the ranks' states and real samples."""
    assert [len(loader) for loader in loaders] == [len(ref)] * len(loaders)  # the batches left (a resumed rank skips `start`)
    n = ref.n
    samples = []
    states: list[dict[str, Any]] = []
    for rank, (loader, k) in enumerate(zip(loaders, consumed)):
        expected = ref.batches(rank)[:k]
        keys = _keys(loader, epoch, ref.start)
        want_keys = [key for batch in ref.batches(rank) for _, key in batch]
        np.testing.assert_array_equal(keys, want_keys, err_msg=f"rank {rank}: augmentation keys")
        got = _drain(loader, k, states)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(g, order[[p for p, _ in e]], err_msg=f"rank {rank}")
        samples += [p for batch in expected for p, key in batch if key < n]
    return states, samples


@settings(max_examples=examples(ci=6, long=40), deadline=None, database=None)
@given(
    data=st.data(),
    batch_size=st.integers(1, 6),
    sizes=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
    drop_last=st.booleans(),
    order=st.sampled_from(list(OrderOption)),
    lockstep=st.booleans(),
)
def test_every_sample_once_across_jobs_of_any_size(
    elastic_path: Path, data: Any, batch_size: int, sizes: tuple[int, int, int], drop_last: bool, order: OrderOption, lockstep: bool
) -> None:
    """N ranks hand out k batches, M ranks resume and hand out some, P ranks finish the epoch: each position once.

    Not in lockstep, each rank hands out its own number of batches and the next job loads ``combine_states``.
    """
    indices = np.array(data.draw(st.lists(st.integers(0, N_FILE - 1), min_size=1, max_size=60), label="indices"))  # repeats
    kwargs: dict[str, Any] = {"batch_size": batch_size, "order": order, "seed": 7, "num_workers": 1, "chunk_size": 5,
                              "window_chunks": 2, "indices": indices, "drop_last": drop_last}  # fmt: skip
    global_order = Loader(elastic_path, **{**kwargs, "drop_last": False}).epoch_indices(0)
    n = len(global_order)
    ref = _Reference(n, batch_size, drop_last)
    seen: list[int] = []
    state: dict[str, Any] | None = None
    for job, world_size in enumerate(sizes):
        loaders = _job(elastic_path, world_size, state, **kwargs)
        if state is None or state["rank"] is None or state["world_size"] != world_size:
            ref.split(world_size)
        else:  # as many ranks as the lockstep job before: each continues its own block
            ref.start = state["batches_consumed"]
        if loaders[0].state_dict()["epoch"] == 1:  # nothing left for this job (drop_last): the epoch is over
            assert len(ref) == 0
            break
        last = job == len(sizes) - 1
        if last:
            consumed = [len(ref)] * world_size
        elif lockstep or world_size == 1:
            consumed = [data.draw(st.integers(0, len(ref) - 1), label="k")] * world_size
        else:
            consumed = data.draw(st.lists(st.integers(0, len(ref)), min_size=world_size, max_size=world_size), label="ks")
        states, samples = _run_job(loaders, ref, global_order, consumed)
        seen += samples
        ref.hand_out(consumed)
        if last:
            assert all(s["epoch"] == 1 and s["batches_consumed"] == 0 and s["seen"] == [] for s in states)
            normal = Loader(elastic_path, distributed=True, rank=0, world_size=world_size, **kwargs)
            assert all(len(loader) == len(normal) for loader in loaders), "the next epoch is a whole one"
            break
        if len(set(consumed)) == 1:  # lockstep: every rank's state is the same but for its rank; take any
            assert all({**s, "rank": 0} == {**states[0], "rank": 0} for s in states)
            state = states[-1]
        else:
            state = combine_states(states[::-1])
        if state["epoch"] == 1:
            break
    counts = Counter(seen)
    assert all(c == 1 for c in counts.values()), f"positions loaded twice: {[p for p, c in counts.items() if c > 1]}"
    assert set(counts) <= set(range(n))
    if not drop_last:
        assert set(counts) == set(range(n)), f"positions never loaded: {sorted(set(range(n)) - set(counts))}"


# ---- the pure functions ------------------------------------------------------------------------------------------------

_NONE = np.zeros((0, 2), dtype=np.int64)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n", [0, 1, 5, 23])
def test_a_whole_epoch_is_rank_share(n: int, world_size: int, drop_last: bool) -> None:
    """Nothing seen: the share and its keys are rank_share's block and ``first + offset``."""
    order = np.random.default_rng(n).permutation(n)
    for rank in range(world_size):
        block, first = rank_share(order, rank, world_size, 3, drop_last)
        share = elastic_share(n, _NONE, rank, world_size, 3, drop_last)
        np.testing.assert_array_equal(share.samples(order), block)
        np.testing.assert_array_equal(positions_of(share.runs(), 0, len(block)), np.arange(first, first + len(block)))
        assert share_batches(n, _NONE, world_size, 3, drop_last) == -(-len(block) // 3)


def test_seen_intervals_are_merged_and_the_rest_split() -> None:
    seen = seen_after(20, np.array([[4, 6]]), 2, 2, False, [1, 2])  # left: 0-3, 6-19 (18); blocks of 9
    np.testing.assert_array_equal(seen, [[0, 2], [4, 6], [11, 15]])  # rank 0: 0, 1; rank 1: 11, 12, 13, 14
    share = elastic_share(20, seen, 1, 3, 2, False)  # left: 2, 3, 6..10, 15..19 (12): blocks of 4
    np.testing.assert_array_equal(share.samples(np.arange(100, 120)), [108, 109, 110, 115])
    share = elastic_share(20, seen, 2, 5, 2, False)  # blocks of 3 (15 = 12 + 3 padding): rank 2: 10, 15, 16
    np.testing.assert_array_equal(positions_of(share.runs(), 0, 3), [10, 15, 16])
    last = elastic_share(20, seen, 4, 5, 2, False)  # only padding: the first positions left (2, 3, 6) again
    np.testing.assert_array_equal(last.samples(np.arange(100, 120)), [102, 103, 106])
    np.testing.assert_array_equal(positions_of(last.runs(), 0, 3), [20, 21, 22])  # padding keys: n + j


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ([[3, 2]], r"got \[3, 2\)"),
        ([[0, 2], [1, 4]], r"got \[1, 4\) after position 2"),
        ([[0, 21]], r"within \[0, 20\)"),
        ([[-1, 2]], r"got \[-1, 2\)"),
        ([[0, 1.5]], "pairs of ints"),
        ([3], "pairs of ints"),
    ],
)
def test_invalid_seen_is_refused(value: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        check_intervals(value, 20)


def _states(path: Path, world_size: int, consumed: list[int], **kwargs: Any) -> list[dict[str, Any]]:
    out = []
    for loader, k in zip(_job(path, world_size, None, **kwargs), consumed):
        _drain(loader, k, out)
    return out


def test_combine_states_takes_ranks_that_finished_the_epoch(elastic_path: Path) -> None:
    kwargs = {"batch_size": 4, "seed": 1, "num_workers": 1}
    states = _states(elastic_path, 2, [7, 2], **kwargs)  # 25 samples each: rank 0 finished (7 batches)
    assert states[0]["epoch"] == 1 and states[1]["epoch"] == 0
    combined = combine_states(states)
    assert combined["epoch"] == 0 and combined["batches_consumed"] == 0 and combined["rank"] is None
    assert combined["seen"] == [[0, 33]]  # rank 0: 0..24, rank 1: 25..32
    whole = combine_states(_states(elastic_path, 2, [7, 7], **kwargs))
    assert whole["epoch"] == 1 and whole["seen"] == []


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda s: s[:1], r"one state from each of the 2 ranks 0..1; got ranks \[0\]"),
        (lambda s: [s[0], s[0]], r"got ranks \[0, 0\]"),
        (lambda s: [s[0], {**s[1], "seed": 5}], r"differ in \['seed'\]"),
        (lambda s: [s[0], {**s[1], "world_size": 3}], r"differ in \['world_size'\]"),
        (lambda s: [s[0], {**s[1], "epoch": 3}], r"epochs \[0, 3\]"),
        (lambda s: [s[0], {**s[1], "epoch": 1, "batches_consumed": 1}], "cannot be that far apart"),
        (lambda s: [s[0], {**s[1], "seen": [[0, 1]]}], "different earlier runs"),
        (lambda s: [s[0], {**s[1], "batches_consumed": 99}], r"must lie in \[0, 7\]"),
        (lambda s: [s[0], {"version": 3}], "keys"),
        (lambda s: [], "got none"),
    ],
)
def test_combine_states_refuses_states_of_several_jobs(elastic_path: Path, change: Any, words: str) -> None:
    states = _states(elastic_path, 2, [1, 2], batch_size=4, seed=1, num_workers=1)
    with pytest.raises(ValueError, match=words):
        combine_states(change(states))


# ---- the loader's state ------------------------------------------------------------------------------------------------


def test_states_of_other_loaders_are_still_refused(elastic_path: Path) -> None:
    """Only the world size and rank became compatible: another batch size, order, seed ... is refused as before."""
    loader = _job(elastic_path, 2, None, batch_size=4, seed=1, num_workers=1)[1]
    saved: list[dict[str, Any]] = []
    _drain(loader, 2, saved)
    state = saved[0]
    with pytest.raises(StokerError, match="batch_size: saved 4, this loader 5"):
        Loader(elastic_path, batch_size=5, seed=1, distributed=True, rank=0, world_size=3).load_state_dict(state)
    with pytest.raises(StokerError, match="order: saved 'SEQUENTIAL', this loader 'RANDOM'"):
        Loader(elastic_path, batch_size=4, seed=1, order=OrderOption.RANDOM).load_state_dict(state)
    with pytest.raises(StokerError, match="seed: saved 1, this loader 2"):
        Loader(elastic_path, batch_size=4, seed=2).load_state_dict(state)
    with pytest.raises(StokerError, match=r"world_size must be >= 1; got 0"):
        Loader(elastic_path, batch_size=4, seed=1).load_state_dict({**state, "world_size": 0})
    with pytest.raises(StokerError, match=r"within \[0, 50\)"):
        Loader(elastic_path, batch_size=4, seed=1).load_state_dict({**state, "seen": [[40, 60]]})
    with pytest.raises(StokerError, match="more than the 5 batches of an epoch on 2 ranks"):
        Loader(elastic_path, batch_size=4, seed=1).load_state_dict({**state, "seen": [[0, 10]], "batches_consumed": 6})


def test_a_version_3_state_resumes_on_other_ranks(elastic_path: Path) -> None:
    """A state saved before elastic resume (world size in its config) is read as one with nothing seen before."""
    loader = _job(elastic_path, 2, None, batch_size=4, seed=1, num_workers=1)[0]
    saved: list[dict[str, Any]] = []
    _drain(loader, 3, saved)
    state = saved[0]
    old = {k: v for k, v in state.items() if k not in ("world_size", "rank", "seen")}
    old["version"], old["config"] = 3, {**state["config"], "rank": 0, "world_size": 2}
    a, b = Loader(elastic_path, batch_size=4, seed=1), Loader(elastic_path, batch_size=4, seed=1)
    a.load_state_dict(state)
    b.load_state_dict(old)
    assert a.epoch_indices(0).tolist() == b.epoch_indices(0).tolist() == list(range(12, 25)) + list(range(37, 50))


@pytest.fixture(scope="module")
def image_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Raw 12x17 images, each different and left-right asymmetric; label = index."""
    n = 23
    path = tmp_path_factory.mktemp("elastic") / "images.stoker"
    images = np.random.default_rng(0).integers(0, 256, (n, 12, 17, 3), dtype=np.uint8)
    fields = {"image": RGBImageField(), "label": IntField()}
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset(list(zip(images, range(n))))
    return path


@pytest.mark.parametrize("compile", [pytest.param(True, marks=pytest.mark.slow), False])  # compiling the flip: a minute
def test_a_resumed_sample_draws_the_augmentation_it_would_have_drawn(image_path: Path, compile: bool) -> None:
    """2 ranks hand out 2 batches, 3 ranks load the rest: every flip is the flip of an uninterrupted run."""
    pipeline = {"image": [SimpleRGBImageDecoder(), RandomHorizontalFlip(), ToTensor()]}
    kwargs: dict[str, Any] = {"batch_size": 3, "order": OrderOption.RANDOM, "seed": 5, "pipelines": pipeline, "compile": compile}
    whole = [(x.numpy().copy(), y.numpy().ravel().copy()) for x, y, _ in Loader(image_path, return_indices=True, **kwargs)]
    by_position = dict(enumerate(zip(np.concatenate([y for _, y in whole]), np.concatenate([x for x, _ in whole]))))
    first = _job(image_path, 2, None, **kwargs)  # 12 samples each, 4 batches
    got: dict[int, tuple[int, np.ndarray]] = {}
    for loader in first:
        keys = _keys(loader, 0, 0)
        for b, (x, y, _) in enumerate(loader):
            for s in range(len(y)):
                got[int(keys[b * 3 + s])] = (int(y[s]), x[s].numpy().copy())
            if b == 1:
                state = loader.state_dict()  # inside the loop (after it, the state is the next epoch's start)
                break
    for loader in _job(image_path, 3, state, **kwargs):  # 11 left (24 - 12 with a padding), 4 each (one padding)
        keys = _keys(loader, 0, 0)
        for b, (x, y, _) in enumerate(loader):
            for s in range(len(y)):
                got.setdefault(int(keys[b * 3 + s]), (int(y[s]), x[s].numpy().copy()))
    flips = 0
    for position, (label, image) in by_position.items():
        assert got[position][0] == label
        np.testing.assert_array_equal(got[position][1], image, err_msg=f"sample {label} at global position {position}")
        flips += not np.array_equal(image, by_position[position][1][:, ::-1])
    assert set(got) >= set(by_position)


# ---- real processes in gloo groups -------------------------------------------------------------------------------------

_GLOO_JOB = """
import json, sys
import torch.distributed as dist
from stoker.loader import Loader
from stoker.loader.distributed import combine_states

path, port, rank, world_size, plan, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
plan = json.loads(plan)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
try:
    loader = Loader(path, batch_size=10, seed=3, num_workers=1, distributed=True, return_indices=True, indices=list(range(600)))
    if plan["resume"] is not None:
        with open(plan["resume"]) as f:
            loader.load_state_dict(json.load(f))
    length = len(loader)  # this job's batches per rank (after the epoch, len is the next epoch's)
    batches = plan["batches"][rank] if plan["batches"] is not None else length
    it = iter(loader)
    seen = [next(it)[-1].tolist() for _ in range(batches)]
    state = loader.state_dict()  # inside the loop (once it is left, the state is the next epoch's start)
    del it
    states = [None] * world_size if rank == 0 else None
    dist.gather_object(state, states, dst=0)  # the ranks' states, on rank 0
    if rank == 0:
        with open(plan["save"], "w") as f:
            json.dump(combine_states(states) if plan["combine"] else states[0], f)
        with open(plan["save"] + ".all", "w") as f:
            json.dump(states, f)
    with open(out, "w") as f:
        json.dump({"len": length, "seen": seen}, f)
finally:
    dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gloo_job(path: Path, tmp: Path, name: str, world_size: int, plan: dict[str, Any]) -> list[dict[str, Any]]:
    port = _free_port()
    outs = [tmp / f"{name}-rank{r}.json" for r in range(world_size)]
    script = textwrap.dedent(_GLOO_JOB)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(path), str(port), str(r), str(world_size), json.dumps(plan), str(outs[r])],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world_size)
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world_size, logs
    return [json.loads(out.read_text()) for out in outs]


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gloo_jobs_of_2_then_3_then_1_ranks_load_every_sample_once(elastic_path: Path, tmp_path: Path) -> None:
    """2 ranks (lockstep, rank 0's state) -> 3 ranks (not in lockstep: combine_states on rank 0) -> 1 rank."""
    table = elastic_path.parent / "table600.stoker"
    DatasetWriter(table, {"y": IntField()}, num_workers=1, progress=False).from_arrays({"y": np.arange(600)})
    first = _gloo_job(table, tmp_path, "a", 2, {"resume": None, "batches": [3, 3], "combine": False, "save": str(tmp_path / "a.json")})
    assert [r["len"] for r in first] == [30, 30]  # 300 samples each
    states = json.loads((tmp_path / "a.json.all").read_text())
    assert {**states[0], "rank": 1} == states[1], "in lockstep every rank's state is the same but for its rank"
    plan = {"resume": str(tmp_path / "a.json"), "batches": [2, 4, 5], "combine": True, "save": str(tmp_path / "b.json")}
    second = _gloo_job(table, tmp_path, "b", 3, plan)
    assert [r["len"] for r in second] == [18, 18, 18]  # 540 left: 180 each
    combined = json.loads((tmp_path / "b.json").read_text())
    assert combined["rank"] is None and combined["batches_consumed"] == 0 and combined["epoch"] == 0
    plan = {"resume": str(tmp_path / "b.json"), "batches": None, "combine": False, "save": str(tmp_path / "c.json")}
    third = _gloo_job(table, tmp_path, "c", 1, plan)
    assert third[0]["len"] == 43  # 600 - 60 - 110
    seen = [i for job in (first, second, third) for r in job for batch in r["seen"] for i in batch]
    assert sorted(seen) == list(range(600)), "every sample of the epoch once"
    assert json.loads((tmp_path / "c.json").read_text())["epoch"] == 1
