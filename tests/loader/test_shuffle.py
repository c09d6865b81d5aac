"""The compiled shuffle behind ``OrderOption.RANDOM``: a permutation, a pure function of (seed, epoch), uniform."""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker import _splitmix
from stoker.loader.order import OrderOption, epoch_order
from stoker.pipeline.random import COPIES_PER_STEP, SHUFFLE_BLOCK, order_steps, permutation_key, shuffle, shuffle_steps


def _reference(values: np.ndarray, key: np.uint64) -> np.ndarray:
    """Fisher-Yates in plain numpy/Python: step i swaps i with j = floor(u_i * (i + 1)), u_i = mix(key ^ mix(i)) / 2**64."""
    out = values.copy()
    for i in range(len(out) - 1, 0, -1):
        u = float(_splitmix.mix64(np.uint64(key) ^ _splitmix.mix64(np.uint64(i))) >> np.uint64(11)) * 2.0**-53
        j = min(int(u * (i + 1)), i)
        out[i], out[j] = out[j], out[i]
    return out


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 2**64 - 1), salt=st.integers(0, 2**64 - 1))
def test_the_permutation_key_is_splitmix_of_seed_epoch_and_salt(seed: int, epoch: int, salt: int) -> None:
    """The key (computed in Python ints) equals the same mixes over numpy uint64 arrays."""
    mix = _splitmix.mix64
    k = mix(np.array([seed], dtype=np.uint64)) ^ np.uint64(epoch)
    expected = mix(mix(k) ^ np.uint64(salt))[0]
    got = permutation_key(seed, epoch, salt)
    assert isinstance(got, np.uint64) and got == expected
    assert _splitmix.mix64_int(seed) == int(mix(np.array([seed], dtype=np.uint64))[0])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 10**6))
def test_shuffle_matches_the_reference_and_is_a_permutation(n: int, seed: int, epoch: int) -> None:
    values = np.arange(n, dtype=np.int64) * 3 + 1
    key = permutation_key(seed, epoch)
    got = values.copy()
    shuffle(got, key)
    np.testing.assert_array_equal(got, _reference(values, key))
    np.testing.assert_array_equal(np.sort(got), values)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), seed=st.integers(0, 2**64 - 1), pieces=st.lists(st.integers(1, 120), min_size=1, max_size=20))
def test_a_shuffle_cut_into_pieces_is_the_same_shuffle(n: int, seed: int, pieces: list[int]) -> None:
    """shuffle_steps resumed where it stopped, piece after piece of any sizes, gives shuffle's permutation."""
    values = np.arange(n, dtype=np.int64) * 5 - 2
    key = permutation_key(seed, 1)
    got = values.copy()
    at, k = n - 1, 0
    while at > 0:
        step = pieces[k % len(pieces)]
        nxt = shuffle_steps(got, key, at, step)
        assert nxt == max(0, at - step)
        at, k = nxt, k + 1
    np.testing.assert_array_equal(got, _reference(values, key))


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 400), seed=st.integers(0, 2**64 - 1), pieces=st.lists(st.integers(1, 150), min_size=1, max_size=20))
def test_an_order_made_in_pieces_is_the_copy_then_the_shuffle(n: int, seed: int, pieces: list[int]) -> None:
    """order_steps (what a producer does a piece at a time between batches): the copy of the indices first, then the
    shuffle's steps, in pieces of any sizes, gives the reference shuffle of the indices; the indices are not written,
    each piece makes progress, and a call with no work changes nothing."""
    source = np.arange(n, dtype=np.int64) * 7 - 3
    before = source.copy()
    key = permutation_key(seed, 2)
    values = np.full(n, -99, dtype=np.int64)
    state = np.zeros(2 + SHUFFLE_BLOCK, dtype=np.int64)
    state[0] = max(0, n - 1)
    left = order_steps(values, source, state, key, 0)
    assert left == max(0, n - 1) + -(-n // COPIES_PER_STEP)
    assert (values == -99).all()  # (asked only: nothing done)
    k = 0
    while left > 0:
        work = pieces[k % len(pieces)]
        now = order_steps(values, source, state, key, work)
        assert 0 <= now < left and now >= left - work - 1, (left, work, now)
        assert order_steps(values, source, state, key, 0) == now
        left, k = now, k + 1
    np.testing.assert_array_equal(values, _reference(source, key))
    np.testing.assert_array_equal(source, before)
    assert state[0] == 0 and state[1] == n


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 2000), seed=st.integers(0, 2**63), epoch=st.integers(0, 1000))
def test_random_order_is_a_pure_function_of_seed_and_epoch(n: int, seed: int, epoch: int) -> None:
    indices = np.arange(n, dtype=np.int64)[::-1].copy()
    before = indices.copy()
    a = epoch_order(OrderOption.RANDOM, indices, seed, epoch, 10, 2)
    b = epoch_order(OrderOption.RANDOM, indices, seed, epoch, 10, 2)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(indices, before)  # the loader's indices are not shuffled in place
    assert sorted(a.tolist()) == list(range(n))
    if n >= 20:  # 20! orders: two epochs or two seeds giving the same one would be a bug, not chance
        assert not np.array_equal(a, epoch_order(OrderOption.RANDOM, indices, seed, epoch + 1, 10, 2))
        assert not np.array_equal(a, epoch_order(OrderOption.RANDOM, indices, seed + 1, epoch, 10, 2))


def test_every_order_of_four_is_equally_likely() -> None:
    draws = 24_000
    counts = dict.fromkeys(itertools.permutations(range(4)), 0)
    values = np.arange(4, dtype=np.int64)
    for epoch in range(draws):
        out = values.copy()
        shuffle(out, permutation_key(7, epoch))
        counts[tuple(out.tolist())] += 1
    expected = draws / 24
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 60, f"chi-square {chi2:.1f} over 23 degrees of freedom (p < 1e-4 above 53)"


def test_each_value_lands_anywhere_uniformly() -> None:
    n, draws = 50, 4000
    where = np.zeros((n, n), dtype=np.int64)  # where[value, position]
    for epoch in range(draws):
        out = np.arange(n, dtype=np.int64)
        shuffle(out, permutation_key(123, epoch))
        where[out, np.arange(n)] += 1
    expected = draws / n
    z = (where - expected) / math.sqrt(expected * (1 - 1 / n))
    assert np.abs(z).max() < 5.5, f"a value landed at a position {np.abs(z).max():.1f} standard deviations off uniform"
