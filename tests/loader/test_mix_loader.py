"""``Loader([Stream(...), ...])``: the batches of a mix are the mixed order's, whatever the threads, and resume anywhere.

Three small datasets whose ``y`` names each sample: stream A (a file, 60 samples, ``y = i``), stream B (a folder of
3 shards of 10, ``y = 1000 + i``), stream C (a file of 7, ``y = 2000 + i``). The expected batches come from the pure
functions (:func:`stoker.loader.mixing.mixed_order` with each stream's passes from
:func:`stoker.loader.order.epoch_order`, as documented); tests/loader/test_mixing.py checks those against the
plain-Python model.
"""

from __future__ import annotations

import gc
import json
import re
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

from stoker import Loader, OrderOption, Stream
from stoker.dataset.shards import write_shards
from stoker.errors import DatasetFormatError, StokerError
from stoker.fields import FloatField, IntField
from stoker.loader.distributed import combine_states
from stoker.loader.mixing import epoch_counts, mixed_order, stream_seed
from stoker.loader.order import epoch_order
from stoker.writer import DatasetWriter

from .._profile import examples
from .test_elastic import _free_port, _keys, _Reference

SIZES = {"A": 60, "B": 30, "C": 7}
BASE = {"A": 0, "B": 1000, "C": 2000}


# under ``make test`` Python producers make the batches: the mixed order, not the loop, is the subject (tests/_profile.py)
pytestmark = pytest.mark.usefixtures("python_producers_unless_long")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mix")
    DatasetWriter(root / "a.stoker", {"y": IntField()}, num_workers=1, progress=False).from_arrays({"y": np.arange(60)})
    write_shards(root / "b", {"y": IntField()}, {"y": 1000 + np.arange(30)}, samples_per_shard=10, num_workers=1, progress=False)
    DatasetWriter(root / "c.stoker", {"y": IntField()}, num_workers=1, progress=False).from_arrays({"y": 2000 + np.arange(7)})
    DatasetWriter(root / "float.stoker", {"y": FloatField()}, num_workers=1, progress=False).from_arrays({"y": np.arange(5.0)})
    DatasetWriter(root / "two.stoker", {"y": IntField(), "z": IntField()}, num_workers=1, progress=False).from_arrays(
        {"y": np.arange(5), "z": np.arange(5)}
    )
    return {"A": root / "a.stoker", "B": root / "b", "C": root / "c.stoker", "root": root}


def _streams(data: dict[str, Any], rules: dict[str, dict[str, Any]]) -> list[Stream]:
    return [Stream(str(data[name]), name=name, **kw) for name, kw in rules.items()]


def expected_order(rules: dict[str, dict[str, Any]], seed: int, epoch: int, batch_size: int, order: OrderOption, whole: bool,
                   samples_per_epoch: int | None, chunk_size: int, window_chunks: int) -> np.ndarray:  # fmt: skip
    """The epoch's ``y`` values, as documented: each stream's passes, its counts, the layout."""
    names = list(rules)
    local = [np.asarray(rules[n].get("indices", np.arange(SIZES[n])), dtype=np.int64) for n in names]
    sizes = [len(i) for i in local]
    streams = [Stream("x", **{k: v for k, v in rules[n].items() if k != "indices"}) for n in names]
    counts = epoch_counts(sizes, [s.rule() for s in streams], samples_per_epoch, batch_size, whole)
    bounds = {"A": [0, 60], "B": [0, 10, 20, 30], "C": [0, 7]}

    def pass_order(s: int, p: int) -> np.ndarray:
        return epoch_order(order, local[s], stream_seed(seed, s), p, chunk_size, window_chunks, np.array(bounds[names[s]]))

    starts = [epoch * int(c) for c in counts]
    ids = mixed_order(counts, starts, sizes, [0] * len(names), lambda s, p: BASE[names[s]] + pass_order(s, p), batch_size, whole)
    return ids


@st.composite
def mix_rules(draw: st.DrawFn) -> dict[str, dict[str, Any]]:
    names = draw(st.lists(st.sampled_from(["A", "B", "C"]), min_size=1, max_size=3, unique=True))
    rules: dict[str, dict[str, Any]] = {}
    for name in names:
        kind = draw(st.sampled_from(["weight", "weight", "repeat", "choose", "none"]))
        kw: dict[str, Any] = {}
        if kind == "weight":
            kw["weight"] = draw(st.sampled_from([0.2, 0.3, 0.7, 1.0, 3.0]))
        elif kind == "repeat":
            kw["repeat"] = draw(st.sampled_from([0.5, 1.0, 2.0]))
        elif kind == "choose":
            kw["choose"] = draw(st.integers(1, 40))
        if draw(st.integers(0, 3)) == 0:
            kw["indices"] = draw(st.lists(st.integers(0, SIZES[name] - 1), min_size=1, max_size=15))
        rules[name] = kw
    return rules


def _ys(loader: Loader, epochs: int = 1) -> list[list[np.ndarray]]:
    out = []
    for _ in range(epochs):
        out.append([b[0].numpy().ravel().copy() for b in loader])
    return out


@settings(max_examples=examples(ci=5, long=30), deadline=None, database=None)
@given(
    rules=mix_rules(),
    batch_size=st.integers(1, 9),
    order=st.sampled_from(list(OrderOption)),
    whole=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**64 - 1),
    spe=st.none() | st.integers(20, 120),
)
def test_batches_are_the_mixed_order_for_any_thread_count(
    data: dict[str, Any], rules: dict[str, dict[str, Any]], batch_size: int, order: OrderOption, whole: bool, drop_last: bool,
    seed: int, spe: int | None,
) -> None:  # fmt: skip
    """Two epochs of the Loader, with 1 and 2 workers: each batch's y, index and source are the model's."""
    try:
        expected_order(rules, seed, 0, batch_size, order, whole, spe, 5, 2)
    except ValueError:  # counts the rules cannot meet: the Loader refuses them too
        with pytest.raises(ValueError):
            Loader(_streams(data, rules), batch_size=batch_size, samples_per_epoch=spe, mix="batches" if whole else "samples")
        return
    got = {}
    for workers in (1, 2):
        loader = Loader(_streams(data, rules), batch_size=batch_size, order=order, seed=seed, num_workers=workers,
                        mix="batches" if whole else "samples", drop_last=drop_last, samples_per_epoch=spe, chunk_size=5,
                        window_chunks=2, return_indices=True, return_source=True, batches_ahead=2)  # fmt: skip
        epochs = []
        for epoch in range(2):
            want = expected_order(rules, seed, epoch, batch_size, order, whole, spe, 5, 2)
            if drop_last:
                want = want[: len(want) // batch_size * batch_size]
            batches = [(y.numpy().ravel().copy(), i.numpy().copy(), s.numpy().copy()) for y, i, s in loader]
            assert len(batches) == -(-len(want) // batch_size)
            ys = np.concatenate([b[0] for b in batches]) if batches else np.zeros(0, np.int64)
            np.testing.assert_array_equal(ys, want)
            names = list(rules)
            for y, index, source in batches:
                np.testing.assert_array_equal(y, [BASE[names[s]] + i for s, i in zip(source, index)])
            epochs.append(ys)
        got[workers] = epochs
        assert loader.stats()["mix"][names[0]]["samples"] == sum(
            int((np.asarray(e) // 1000 == BASE[names[0]] // 1000).sum()) for e in epochs
        )
    for a, b in zip(got[1], got[2]):
        np.testing.assert_array_equal(a, b)


def test_a_seventy_thirty_mix(data: dict[str, Any]) -> None:
    """0.7 / 0.3 over A (60) and B (30), batches of 10: the epoch is 90 samples, 63 + 27, each batch 7 + 3 (or 6 + 4 ...
    within rounding); B, upsampled (27 of 30), rotates: after two epochs every B sample was seen."""
    loader = Loader(_streams(data, {"A": {"weight": 0.7}, "B": {"weight": 0.3}}), batch_size=10, order=OrderOption.RANDOM,
                    seed=1, return_source=True)  # fmt: skip
    seen_b: Counter[int] = Counter()
    for _ in range(2):
        counts = np.zeros(2, np.int64)
        for y, source in loader:
            got = np.bincount(source.numpy(), minlength=2)
            assert got.tolist() == [7, 3]
            counts += got
            seen_b.update(int(v) for v in y.numpy().ravel() if v >= 1000)
        assert counts.tolist() == [63, 27]
    assert set(seen_b) == set(range(1000, 1030)) and max(seen_b.values()) <= 2


def _drain(loader: Loader, k: int | None = None, states: list[dict[str, Any]] | None = None) -> list[np.ndarray]:
    """The ``y`` of the next ``k`` batches (the rest of the epoch with ``None``); the loader's state after them appended to
    ``states``, saved inside the loop (once the loop is left, ``state_dict()`` is the next epoch's start)."""
    it = iter(loader)
    out = [b[0].numpy().ravel().copy() for b in (it if k is None else (next(it) for _ in range(k)))]
    if states is not None:
        states.append(loader.state_dict())
    del it
    return out


@pytest.mark.parametrize("order", list(OrderOption))
@pytest.mark.parametrize("whole", [False, True])
def test_resuming_after_any_batch_gives_the_same_batches(data: dict[str, Any], order: OrderOption, whole: bool) -> None:
    """Restore at a dozen steps of three epochs (the script changes the weights after the first): the rest equals an
    uninterrupted run."""
    rules = {"A": {"weight": 0.5}, "B": {"repeat": 2}, "C": {"choose": 4}}
    kwargs: dict[str, Any] = {"batch_size": 4, "order": order, "seed": 3, "num_workers": 1, "chunk_size": 4, "window_chunks": 2,
                              "mix": "batches" if whole else "samples"}  # fmt: skip

    def train(loader: Loader, first: list[np.ndarray] | None = None) -> list[list[np.ndarray]]:
        """The training script: three epochs, new weights from epoch 1 (``first``: what a resumed epoch yields)."""
        epochs = []
        while loader._next_epoch < 3 or first is not None:
            epochs.append(first if first is not None else _drain(loader))
            first = None
            if loader._next_epoch == 1:
                loader.set_weights([1, 1, 2], samples_per_epoch=40)
        return epochs

    whole_run = train(Loader(_streams(data, rules), **kwargs))
    assert [len(e) for e in whole_run][1:] == [10, 10]
    flat = [(e, b) for e in range(3) for b in range(len(whole_run[e]))]
    for e, b in flat[:: max(1, len(flat) // 12)]:
        loader = Loader(_streams(data, rules), **kwargs)
        for _ in range(e):
            _drain(loader)
            if loader._next_epoch == 1:
                loader.set_weights([1, 1, 2], samples_per_epoch=40)
        saved: list[dict[str, Any]] = []
        _drain(loader, b + 1, saved)
        if e == 0 and b + 1 == len(whole_run[0]):  # the end of epoch 0: the script sets the weights, then saves
            loader.set_weights([1, 1, 2], samples_per_epoch=40)
            saved.append(loader.state_dict())
        fresh = Loader(_streams(data, rules), **kwargs)  # built with the first weights: the state brings the history
        fresh.load_state_dict(saved[-1])
        rest = train(fresh, _drain(fresh))
        want = ([whole_run[e][b + 1 :]] if b + 1 < len(whole_run[e]) else []) + whole_run[e + 1 :]
        assert [len(r) for r in rest] == [len(w) for w in want]
        for r, w in zip(rest, want):
            for x, y in zip(r, w):
                np.testing.assert_array_equal(x, y)


def test_weights_change_between_epochs_only(data: dict[str, Any]) -> None:
    streams = _streams(data, {"A": {"weight": 0.5}, "B": {"weight": 0.5}})
    loader = Loader(streams, batch_size=10, seed=0, return_source=True)
    assert len(loader) == 9  # 90 samples
    it = iter(loader)
    next(it)
    with pytest.raises(StokerError, match=r"within epoch 0 .* never change while it runs"):
        loader.set_weights([0.9, 0.1])
    for _ in it:
        pass
    loader.set_weights([0.9, 0.1])  # from epoch 1 on; the epoch keeps its length (90)
    sources = np.concatenate([s.numpy() for _, s in loader])
    assert np.bincount(sources).tolist() == [81, 9]
    assert loader.state_dict()["mix"]["phases"] == [[0, [45, 45]], [1, [81, 9]]]
    loader.set_weights([1, 3], samples_per_epoch=20)
    assert len(loader) == 2
    gc.disable()
    try:  # an epoch left by break that only garbage holds (see test_lifecycle) is not running: new weights are taken
        it = iter(loader)
        next(it)
        garbage: list[object] = [it]
        garbage.append(garbage)
        del it, garbage
        assert loader._iterating()
        loader.set_weights([1, 1], samples_per_epoch=20)
    finally:
        gc.enable()
    with pytest.raises(ValueError, match="one weight per stream"):
        loader.set_weights([1])
    with pytest.raises(ValueError, match=re.escape("weights[1] must be a finite number >= 0; got -1")):
        loader.set_weights([1, -1])  # (the check mix_sequences makes: mixing.check_weights)
    with pytest.raises(StokerError, match="for a mix"):
        Loader(data["A"], batch_size=4).set_weights([1])


def test_a_state_keeps_its_weights_and_set_weights_changes_them_after(data: dict[str, Any]) -> None:
    """A loader built with other weights takes the saved run's counts (its history, and those in force); weights set
    after loading apply from the next epoch: the rest of the saved epoch keeps its counts."""
    kwargs: dict[str, Any] = {"batch_size": 10, "seed": 0, "return_source": True, "order": OrderOption.RANDOM}
    old = Loader(_streams(data, {"A": {"weight": 0.5}, "B": {"weight": 0.5}}), **kwargs)
    saved: list[dict[str, Any]] = []
    _drain(old, 4, saved)
    state = saved[0]
    new = Loader(_streams(data, {"A": {"weight": 0.8}, "B": {"weight": 0.2}}), **kwargs)
    new.load_state_dict(state)
    assert new.state_dict()["mix"]["phases"] == [[0, [45, 45]]]
    new.set_weights([0.8, 0.2])  # within the resumed epoch 0 (not being iterated): from epoch 1 on
    rest = np.concatenate([s.numpy() for _, s in new])  # the 5 batches left of epoch 0, still 5 + 5
    assert np.bincount(rest).tolist() == [25, 25]
    nxt = np.concatenate([s.numpy() for _, s in new])
    assert np.bincount(nxt).tolist() == [72, 18]
    assert new.state_dict()["mix"]["phases"] == [[0, [45, 45]], [1, [72, 18]]]


@settings(max_examples=examples(ci=3, long=12), deadline=None, database=None)
@given(
    batch_size=st.integers(1, 5),
    sizes=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
    drop_last=st.booleans(),
    order=st.sampled_from(list(OrderOption)),
    whole=st.booleans(),
    data_=st.data(),
)
def test_elastic_resume_of_a_mix_on_n_then_m_then_p_ranks(
    data: dict[str, Any], batch_size: int, sizes: tuple[int, int, int], drop_last: bool, order: OrderOption, whole: bool,
    data_: Any,
) -> None:  # fmt: skip
    """N ranks hand out some batches (lockstep), M ranks some each (not in lockstep: combine_states), P ranks the rest:
    every global position of the mixed epoch once, with the sample the mixed order puts there and its augmentation key."""
    if whole and not drop_last:
        drop_last = True  # (whole batches on several ranks need it)
    rules = {"A": {"weight": 0.6}, "B": {"weight": 0.3}, "C": {"repeat": 3}}
    kwargs: dict[str, Any] = {"batch_size": batch_size, "order": order, "seed": 11, "num_workers": 1, "drop_last": drop_last,
                              "mix": "batches" if whole else "samples", "chunk_size": 4, "window_chunks": 2}  # fmt: skip
    ys = np.concatenate(_drain(Loader(_streams(data, rules), **{**kwargs, "drop_last": False})))  # position -> y
    n = len(ys)
    ref = _Reference(n, batch_size, drop_last)
    seen: list[int] = []
    state: dict[str, Any] | None = None
    for job, world_size in enumerate(sizes):
        loaders = [Loader(_streams(data, rules), distributed=True, rank=r, world_size=world_size, **kwargs) for r in range(world_size)]
        if state is not None:
            for loader in loaders:
                loader.load_state_dict(state)
        if state is None or state["rank"] is None or state["world_size"] != world_size:
            ref.split(world_size)
        else:  # as many ranks as the lockstep job before: each continues its own block
            ref.start = state["batches_consumed"]
        if len(ref) == 0:
            break
        last = job == len(sizes) - 1
        if last:
            ks = [len(ref)] * world_size
        elif data_.draw(st.booleans(), label="lockstep"):
            ks = [data_.draw(st.integers(0, len(ref) - 1), label="k")] * world_size
        else:
            ks = data_.draw(st.lists(st.integers(0, len(ref)), min_size=world_size, max_size=world_size), label="ks")
        states = []
        for rank, (loader, k) in enumerate(zip(loaders, ks)):
            assert len(loader) == len(ref)  # the batches left (a resumed rank skips ref.start)
            keys = _keys(loader, 0, ref.start)
            assert keys.tolist() == [key for batch in ref.batches(rank) for _, key in batch], f"rank {rank}: augmentation keys"
            for got, want in zip(_drain(loader, k, states), ref.batches(rank)[:k]):  # (its state saved inside the loop)
                np.testing.assert_array_equal(got, ys[[p for p, _ in want]])
            seen += [p for batch in ref.batches(rank)[:k] for p, key in batch if key < n]
        ref.hand_out(ks)
        state = states[-1] if len(set(ks)) == 1 else combine_states(states)  # lockstep: any rank's state
        if state["epoch"] == 1:
            break
    counts = Counter(seen)
    assert all(c == 1 for c in counts.values()), "a position of the mixed epoch loaded twice"
    if not drop_last:
        assert set(counts) == set(range(n)), "every position of the mixed epoch"


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda d: [Stream(str(d["A"])), Stream(str(d["root"] / "float.stoker"))], r"stream 1 \('float.stoker'\).*field 'y' is FloatField"),
        (lambda d: [Stream(str(d["A"])), Stream(str(d["root"] / "two.stoker"))], r"its field 'z' \(IntField\(\)\) is not in stream 0"),
        (lambda d: [Stream(str(d["root"] / "two.stoker")), Stream(str(d["A"]))], r"stream 1 \('a.stoker'\).*no field 'z'"),
    ],
)
def test_streams_of_other_fields_are_refused_naming_the_stream_and_field(data: dict[str, Any], make: Any, words: str) -> None:
    with pytest.raises(DatasetFormatError, match=words):
        Loader(make(data), batch_size=4)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"indices": [0, 1]}, ValueError, "give each stream its own"),
        ({"samples_per_epoch": 0}, ValueError, "samples_per_epoch must be an int >= 1"),
        ({"mix": "rows"}, ValueError, "mix must be 'samples'"),
        ({"mix": "batches", "distributed": True, "rank": 0, "world_size": 2, "seed": 0}, ValueError, "needs drop_last=True"),
    ],
)
def test_misuse_of_a_mix_is_refused(data: dict[str, Any], kwargs: dict[str, Any], error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        Loader(_streams(data, {"A": {"weight": 1}, "B": {"weight": 1}}), batch_size=4, **kwargs)


def test_mix_options_without_streams_and_mixed_lists_are_refused(data: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="are for a mix of datasets"):
        Loader(data["A"], batch_size=4, return_source=True)
    with pytest.raises(TypeError, match="holds Streams and other things"):
        Loader([Stream(str(data["A"])), str(data["C"])], batch_size=4)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="its own name"):
        Loader([Stream(str(data["A"])), Stream(str(data["A"]))], batch_size=4)
    state = Loader(data["A"], batch_size=4).state_dict()
    with pytest.raises(StokerError, match="one dataset, not of a mix"):
        Loader(_streams(data, {"A": {}, "B": {}}), batch_size=4).load_state_dict(state)


def test_named_batches_and_stats_per_stream(data: dict[str, Any]) -> None:
    loader = Loader(_streams(data, {"A": {"weight": 2}, "C": {"weight": 1}}), batch_size=6, named=True, return_source=True,
                    return_indices=True, os_cache=False, samples_per_epoch=30)  # fmt: skip
    assert loader.output_names == ["y", "index", "source"]
    for batch in loader:
        ids = batch["y"].numpy().ravel()
        np.testing.assert_array_equal(ids, np.where(batch["source"].numpy() == 0, 0, 2000) + batch["index"].numpy())
    stats = loader.stats()["mix"]
    assert (stats["A"]["samples"], stats["C"]["samples"]) == (20, 10)
    assert stats["A"]["read_s"] > 0 and stats["C"]["read_s"] > 0  # os_cache=False: the bounded cache's reads, timed per stream
    report = loader.report()
    assert "streams:" in report and "A: 20 samples (66.7%)" in report and "C: 10 samples (33.3%)" in report


# ---- real processes in gloo groups -------------------------------------------------------------------------------------

_GLOO_MIX_JOB = """
import json, sys
import torch.distributed as dist
from stoker import Loader, OrderOption, Stream
from stoker.loader.distributed import combine_states

a, b, port, rank, world_size, plan, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7]
plan = json.loads(plan)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
try:
    streams = [Stream(a, weight=0.7, name="a"), Stream(b, weight=0.3, name="b")]  # b (60) upsampled: 120 of 400
    loader = Loader(streams, batch_size=8, seed=3, num_workers=1, distributed=True, order=OrderOption.QUASI_RANDOM,
                    samples_per_epoch=400, chunk_size=16, return_indices=True, return_source=True)
    if plan["resume"] is not None:
        with open(plan["resume"]) as f:
            loader.load_state_dict(json.load(f))
    length = len(loader)
    batches = plan["batches"][rank] if plan["batches"] is not None else length
    it = iter(loader)
    seen = [[int(y) for y in next(it)[0].flatten()] for _ in range(batches)]
    state = loader.state_dict()  # inside the loop (once it is left, the state is the next epoch's start)
    del it
    states = [None] * world_size if rank == 0 else None
    dist.gather_object(state, states, dst=0)
    if rank == 0:
        with open(plan["save"], "w") as f:
            json.dump(combine_states(states) if plan["combine"] else states[0], f)
    with open(out, "w") as f:
        json.dump({"len": length, "seen": seen}, f)
finally:
    dist.destroy_process_group()
"""


def _gloo_mix_job(a: Path, b: Path, tmp: Path, name: str, world_size: int, plan: dict[str, Any]) -> list[dict[str, Any]]:
    port = _free_port()
    outs = [tmp / f"{name}-rank{r}.json" for r in range(world_size)]
    args = [str(a), str(b), str(port)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_GLOO_MIX_JOB), *args, str(r), str(world_size), json.dumps(plan), str(outs[r])],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world_size)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world_size, logs
    return [json.loads(out.read_text()) for out in outs]


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gloo_jobs_of_2_then_3_then_1_ranks_load_every_sample_of_a_mixed_epoch_once(tmp_path: Path) -> None:
    """A 70/30 mix of 300 + 60 samples, 400 per epoch: 2 ranks (lockstep) -> 3 ranks (combined) -> 1 rank; the
    samples loaded are those of the mixed epoch, each position once (b's samples twice each: upsampled)."""
    a, b = tmp_path / "a.stoker", tmp_path / "b.stoker"
    DatasetWriter(a, {"y": IntField()}, num_workers=1, progress=False).from_arrays({"y": np.arange(300)})
    DatasetWriter(b, {"y": IntField()}, num_workers=1, progress=False).from_arrays({"y": 1000 + np.arange(60)})
    streams = [Stream(str(a), weight=0.7, name="a"), Stream(str(b), weight=0.3, name="b")]
    whole = Loader(streams, batch_size=8, seed=3, num_workers=1, order=OrderOption.QUASI_RANDOM, samples_per_epoch=400, chunk_size=16)
    want = sorted(int(y) for batch in whole for y in batch[0].numpy().ravel())
    assert len(want) == 400 and sum(y >= 1000 for y in want) == 120
    first = _gloo_mix_job(a, b, tmp_path, "a", 2, {"resume": None, "batches": [5, 5], "combine": False, "save": str(tmp_path / "a.json")})
    assert [r["len"] for r in first] == [25, 25]
    plan = {"resume": str(tmp_path / "a.json"), "batches": [3, 6, 1], "combine": True, "save": str(tmp_path / "b.json")}
    second = _gloo_mix_job(a, b, tmp_path, "b", 3, plan)
    assert [r["len"] for r in second] == [14, 14, 14]  # 320 left: 107 each (1 padding), 14 batches
    plan = {"resume": str(tmp_path / "b.json"), "batches": None, "combine": False, "save": str(tmp_path / "c.json")}
    third = _gloo_mix_job(a, b, tmp_path, "c", 1, plan)
    assert third[0]["len"] == -(-(400 - 80 - 80) // 8)
    seen = sorted(y for job in (first, second, third) for r in job for batch in r["seen"] for y in batch)
    assert seen == want, "every sample of the mixed epoch once"
    assert json.loads((tmp_path / "c.json").read_text())["epoch"] == 1
