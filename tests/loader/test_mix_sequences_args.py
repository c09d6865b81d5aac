"""``mix_sequences`` checks its arguments as a Loader and a ``Stream`` do, and mixes valid ones as before.

Before the checks, a short ``weights`` silently dropped the streams it left out, a long one
raised an ``IndexError``, ``batch_size=0`` a ``ZeroDivisionError``, a negative or NaN weight
or a negative epoch numpy's or ``fractions``' own errors, and a negative seed, a seed of
``2**70`` or ``epoch=1.5`` were accepted. Valid arguments are accepted and mixed exactly
(``epoch_counts``'s counts per stream; tests/flow/test_mixed_source.py checks the orders).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from stoker.loader.mixing import Stream, epoch_counts, mix_sequences

ABC, XY = list("abc"), list("XY")


def outcome(fn: Callable[..., list[tuple[int, Any]]], *args: Any, **kwargs: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args, **kwargs)
    except ValueError as exc:  # the counts' own checks (epoch_counts): a stream with no sample given a share, ...
        return "ValueError", str(exc)


# ---- valid arguments: accepted, mixed exactly ----------------------------------------------------------------------

weight_values = st.one_of(
    st.integers(0, 5),
    st.floats(0, 10, allow_nan=False, allow_infinity=False),
    st.sampled_from([np.float64(0.3), np.float32(0.7), np.int64(2)]),
)


@st.composite
def valid_calls(draw: st.DrawFn) -> tuple[list[list[str]], dict[str, Any]]:
    sizes = draw(st.lists(st.integers(0, 7), min_size=1, max_size=4))
    sequences = [[f"{s}.{i}" for i in range(n)] for s, n in enumerate(sizes)]
    kwargs: dict[str, Any] = {
        "weights": draw(st.none() | st.lists(weight_values, min_size=len(sizes), max_size=len(sizes))),
        "seed": draw(st.integers(0, 2**64 - 1) | st.sampled_from([np.uint64(2**64 - 1), np.int64(7)])),
        "epoch": draw(st.integers(0, 4) | st.just(np.int64(3))),
        "samples_per_epoch": draw(st.none() | st.integers(1, 30)),
        "batch_size": draw(st.integers(1, 9) | st.just(np.int32(4))),
        "shuffle": draw(st.booleans() | st.just(np.bool_(False))),
    }
    return sequences, kwargs


@given(valid_calls())
def test_valid_arguments_are_accepted_and_mixed_exactly(call: tuple[list[list[str]], dict[str, Any]]) -> None:
    """Every valid call is accepted (or refused only by the counts' own rule: a stream with no sample given a share),
    gives each stream the samples ``epoch_counts`` says, each item its own stream's, and the same list again."""
    sequences, kwargs = call
    kind, got = outcome(mix_sequences, sequences, **kwargs)
    sizes = [len(x) for x in sequences]
    weights = kwargs["weights"]
    rules = [("weight", float(w)) for w in weights] if weights is not None else [("repeat", 1.0)] * len(sizes)
    want_kind, counts = outcome(epoch_counts, sizes, rules, kwargs["samples_per_epoch"])  # type: ignore[arg-type]
    assert kind == want_kind, (got, counts)
    if kind != "ok":
        return
    assert [sum(1 for s, _ in got if s == k) for k in range(len(sizes))] == [int(c) for c in counts]
    assert all(item in sequences[s] for s, item in got)
    assert mix_sequences(sequences, **kwargs) == got


def test_the_documented_examples_are_unchanged() -> None:
    assert mix_sequences([["a0", "a1", "a2"], ["b0"]], [2, 1], seed=0, samples_per_epoch=3, shuffle=False) == [
        (0, "a0"),
        (1, "b0"),
        (0, "a1"),
    ]
    top = mix_sequences([ABC, XY], seed=2**64 - 1, epoch=0)  # (the largest seed accepted)
    assert sorted(item for _, item in top) == sorted(ABC + XY)


# ---- invalid arguments: refused, naming the argument, the rule and the value ----------------------------------------

INVALID: list[tuple[str, list[list[str]], dict[str, Any], type[Exception], str]] = [
    ("weights too short", [ABC, XY], {"weights": [1]}, ValueError, "mix_sequences needs one weight per stream (2: "),
    ("weights too long", [ABC, XY], {"weights": [1, 1, 1]}, ValueError, "mix_sequences needs one weight per stream (2: "),
    ("weights a string", [ABC, XY], {"weights": "ab"}, ValueError, "needs one weight per stream (2: "),
    ("weights a number", [ABC, XY], {"weights": 1.0}, ValueError, "needs one weight per stream (2: "),
    ("negative weight", [ABC, list("XYZ")], {"weights": [-1, 2]}, ValueError, "weights[0] must be a finite number >= 0; got -1"),
    ("NaN weight", [ABC, list("XYZ")], {"weights": [1, float("nan")]}, ValueError, "weights[1] must be a finite number >= 0; got nan"),
    ("infinite weight", [ABC, XY], {"weights": [math.inf, 1]}, ValueError, "weights[0] must be a finite number >= 0; got inf"),
    ("bool weight", [ABC, XY], {"weights": [True, 1]}, ValueError, "weights[0] must be a finite number >= 0; got True"),
    ("str weight", [ABC, XY], {"weights": ["1", 1]}, ValueError, "weights[0] must be a finite number >= 0; got '1'"),
    ("batch_size 0", [ABC, XY], {"batch_size": 0}, ValueError, "batch_size must be an int >= 1; got int 0"),
    ("batch_size -2", [ABC, XY], {"batch_size": -2}, ValueError, "batch_size must be an int >= 1; got int -2"),
    ("batch_size 1.5", [ABC, XY], {"batch_size": 1.5}, ValueError, "batch_size must be an int >= 1; got float 1.5"),
    ("epoch -1", [ABC, XY], {"weights": [0.5, 0.5], "epoch": -1}, ValueError, "epoch must be an int >= 0; got int -1"),
    ("epoch 1.5", [ABC, XY], {"epoch": 1.5}, ValueError, "epoch must be an int >= 0; got float 1.5"),
    ("epoch True", [ABC, XY], {"epoch": True}, ValueError, "epoch must be an int >= 0; got bool True"),
    ("seed -1", [ABC, XY], {"seed": -1}, ValueError, "seed must be an integer in [0, 2**64)"),
    ("seed 2**70", [ABC, XY], {"seed": 2**70}, ValueError, "seed must be an integer in [0, 2**64)"),
    ("seed 2**64", [ABC, XY], {"seed": 2**64}, ValueError, "seed must be an integer in [0, 2**64)"),
    ("seed 1.5", [ABC, XY], {"seed": 1.5}, TypeError, "seed must be an integer in [0, 2**64)"),
    ("seed None", [ABC, XY], {"seed": None}, TypeError, "mix_sequences needs seed= an integer in [0, 2**64)"),
    ("samples_per_epoch 0", [ABC, XY], {"weights": [1, 1], "samples_per_epoch": 0}, ValueError,
     "samples_per_epoch must be an int >= 1 or None; got int 0"),
    ("samples_per_epoch 2.5", [ABC, XY], {"weights": [1, 1], "samples_per_epoch": 2.5}, ValueError,
     "samples_per_epoch must be an int >= 1 or None; got float 2.5"),
    ("shuffle a string", [ABC, XY], {"shuffle": "no"}, ValueError, "shuffle must be True or False; got str 'no'"),
]  # fmt: skip


@pytest.mark.parametrize(("sequences", "kwargs", "error", "message"), [case[1:] for case in INVALID], ids=[case[0] for case in INVALID])
def test_invalid_arguments_are_refused(sequences: list[list[str]], kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    kwargs = {"seed": 0, **kwargs}
    with pytest.raises(error, match=re.escape(message)):
        mix_sequences(sequences, **kwargs)


@given(st.lists(st.integers(0, 5), min_size=1, max_size=5), st.integers(0, 7))
def test_every_stream_needs_its_weight(sizes: list[int], given_weights: int) -> None:
    assume(given_weights != len(sizes))
    sequences = [list(range(n)) for n in sizes]
    weights = [1.0] * given_weights
    with pytest.raises(ValueError, match=re.escape(f"mix_sequences needs one weight per stream ({len(sizes)}: ")):
        mix_sequences(sequences, weights, seed=0)


bad_weights = st.one_of(
    st.floats(max_value=-1e-300, allow_nan=False),
    st.integers(max_value=-1),
    st.sampled_from([math.nan, math.inf, -math.inf, True, False, None, "1", 1j, np.bool_(True), np.float64(np.nan)]),
)


@given(st.lists(st.integers(0, 1), min_size=1, max_size=4), st.data())
def test_a_weight_out_of_range_is_named_by_its_index(good: list[int], data: st.DataObject) -> None:
    where = data.draw(st.integers(0, len(good)))
    bad = data.draw(bad_weights)
    weights: list[Any] = list(good)
    weights.insert(where, bad)
    with pytest.raises(ValueError, match=re.escape(f"weights[{where}] must be a finite number >= 0; got {bad!r}")):
        mix_sequences([["x"]] * len(weights), weights, seed=0)


@given(st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64)))
def test_a_seed_out_of_range_is_refused(seed: int) -> None:
    with pytest.raises(ValueError, match=re.escape(f"seed must be an integer in [0, 2**64); got {seed}")):
        mix_sequences([ABC, XY], seed=seed)  # (None is refused too: not offered)


@given(st.integers(max_value=-1) | st.floats() | st.sampled_from([None, "0", np.float64(1.0), np.bool_(False)]))
def test_an_epoch_that_is_not_an_int_at_least_0_is_refused(epoch: float) -> None:
    with pytest.raises(ValueError, match=r"^epoch must be an int >= 0; got "):
        mix_sequences([ABC, XY], seed=0, epoch=epoch)  # type: ignore[arg-type]


@given(st.integers(max_value=0))
def test_a_batch_size_below_1_is_refused(batch_size: int) -> None:
    with pytest.raises(ValueError, match=re.escape(f"batch_size must be an int >= 1; got int {batch_size}")):
        mix_sequences([ABC, XY], seed=0, batch_size=batch_size)


def test_stream_keeps_its_own_message_for_a_weight() -> None:
    """The weight check is one function, used by ``Stream`` too: its message is unchanged."""
    with pytest.raises(ValueError, match=re.escape("Stream weight must be a finite number >= 0; got -0.5")):
        Stream(".", weight=-0.5)
    with pytest.raises(ValueError, match=re.escape("Stream weight must be a finite number >= 0; got nan")):
        Stream(".", weight=math.nan)
    assert Stream(".", weight=0).rule() == ("weight", 0.0)
