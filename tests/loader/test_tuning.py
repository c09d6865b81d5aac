"""Run-time tuning of producers and batches ahead (``stoker.loader._tuning``): the rule against a reference model, and
the batches, which no choice may change."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoker.loader import Loader, OrderOption, _tuning
from stoker.loader._engine import CompiledEpoch
from stoker.loader._tuning import Choice, Limits, Tuner, choose, ladder, waited_share
from stoker.observe._recorder import T_ENTER, T_EXIT, T_READY, Recorder

from .._profile import examples

# ---- the rule, against a reference model ---------------------------------------------------------------------------


def _model_levels(producers: int, total: int, loop_makes: bool) -> list[tuple[int, int]]:
    """The ladder as the docs say it: fewer producers (the same batches ahead in all), then one producer with a
    quarter of them (at least 2, if fewer), then none (where the loop can make batches)."""
    out = [(p, total // p) for p in range(producers, 0, -1)]
    if max(2, total // 4) < total:
        out.append((1, max(2, total // 4)))
    if loop_makes:
        out.append((0, 1))
    return out


class _Model:
    """The rule in a few lines: up to the top at once when the loop waited 5% or more (and never below the level above
    the one it left), one level down under 1%, else stay; nothing measured (or too few batches): stay."""

    def __init__(self, levels: int) -> None:
        self.level, self.floor, self.deepest = 0, levels - 1, levels - 1

    def step(self, waited: float | None, steps: int) -> int:
        if waited is None or steps < _tuning.MIN_STEPS:
            return self.level
        if waited >= 0.05:
            if self.level > 0:
                self.floor = min(self.floor, self.level - 1)
            self.level = 0
        elif waited < 0.01 and self.level < self.floor:
            self.level += 1
        return self.level


limits_st = st.builds(lambda p, extra, makes: Limits(p, p + extra, makes), st.integers(1, 4), st.integers(0, 30), st.booleans())
epochs_st = st.lists(
    st.tuples(st.one_of(st.none(), st.floats(0, 1), st.sampled_from([0.0, 0.005, 0.0099, 0.01, 0.049, 0.05, 0.3])),
              st.integers(-1, 200)),
    min_size=1, max_size=25,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(limits=limits_st, epochs=epochs_st)
def test_the_choice_is_the_models_and_always_within_the_users_limits(limits: Limits, epochs: list[tuple[float | None, int]]) -> None:
    levels = ladder(limits)
    assert levels == _model_levels(limits.producers, limits.total, limits.loop_makes)
    model = _Model(len(levels))
    choice = choose(limits, None, None, 0)
    assert (choice.producers, choice.ahead) == (limits.producers, limits.total // limits.producers)  # the first: as set
    bounces = 0
    for waited, steps in epochs:
        before = choice
        choice = choose(limits, choice, waited, steps)
        assert choice.level == model.step(waited, steps), (waited, steps, choice.reason)
        assert (choice.producers, choice.ahead) == levels[choice.level]
        assert 0 <= choice.producers <= limits.producers and choice.ahead >= 1
        assert choice.producers * choice.ahead <= limits.total  # (the slots are sized for the user's total)
        assert choice.producers > 0 or limits.loop_makes
        assert choice.level <= choice.floor
        assert choice.level <= before.level + 1  # down one level an epoch at most
        bounces += choice.level == 0 and before.level > 0
        assert choice.reason
    assert bounces <= len(levels) - 1  # each bounce back up raises the floor: no flapping


def test_hysteresis_a_level_that_made_the_loop_wait_is_not_chosen_again() -> None:
    limits = Limits(2, 16, True)  # levels: (2, 8), (1, 16), (1, 4), (0, 1)
    c = choose(limits, None, None, 0)
    seen = []
    for waited in [0.0, 0.0, 0.0, 0.08, 0.0, 0.0, 0.0, 0.0, 0.03, 0.002]:
        c = choose(limits, c, waited, 100)
        seen.append((c.producers, c.ahead))
    assert seen == [(1, 16), (1, 4), (0, 1), (2, 8), (1, 16), (1, 4), (1, 4), (1, 4), (1, 4), (1, 4)]
    assert "fewer made the loop wait before" in c.reason


def test_off_settings_changed_and_unmeasured_epochs() -> None:
    limits = Limits(2, 8, True)
    low = choose(limits, choose(limits, None, None, 0), 0.0, 100)
    assert low.producers == 1
    assert (choose(limits, low, 0.0, 100, enabled=False).producers, low.level) == (2, 1)
    assert choose(limits, low, None, -1).level == low.level  # accounting off: kept
    assert "STOKER_ACCOUNTING=0" in choose(limits, low, None, -1).reason
    assert "16 needed" in choose(limits, low, 0.0, 3).reason  # too few batches: kept
    assert choose(limits, low, 0.0, 3).level == low.level
    assert choose(Limits(1, 8, True), low, 0.0, 100).level == 0  # other limits (the loader was rebuilt): as set


def _recorded_steps(seed: int, steps: int = 40) -> tuple[Recorder, np.ndarray]:
    """A recorder with ``steps`` random steps (enter, ready, exit), and those rows."""
    rng = np.random.default_rng(seed)
    rec = Recorder("test", "loader")
    t, rows = 1_000, []
    for _ in range(steps):
        enter = t + int(rng.integers(1, 1000))
        ready = enter + int(rng.integers(0, 500))
        exit_ = ready + int(rng.integers(0, 100))
        rows.append((enter, ready, exit_))
        rec.step(rec.count * rec.width, enter, ready, exit_, 0, 0)
        t = exit_
    return rec, np.array(rows)


def test_waited_share_is_the_loops_wait_over_the_epochs_time() -> None:
    """``t_ready - t_enter`` of every step but the epoch's first, over the time from the first step's end to the last's."""
    rec, r = _recorded_steps(0)
    share, steps = waited_share(rec, 0, rec.count)
    assert steps == 39
    assert share == pytest.approx((r[1:, 1] - r[1:, 0]).sum() / (r[-1, 2] - r[0, 2]))
    assert rec.steps[1, T_READY] - rec.steps[1, T_ENTER] == r[1, 1] - r[1, 0] and rec.steps[0, T_EXIT] == r[0, 2]
    assert waited_share(rec, 39, 40) == (None, 0)


def test_stepped_share_is_the_time_between_next_calls_over_the_epochs_time() -> None:
    """``t_enter`` of a step less ``t_exit`` of the one before (never below 0), over the first step's end to the last's."""
    rec, r = _recorded_steps(1)
    assert _tuning.stepped_share(rec, 0, rec.count) == pytest.approx((r[1:, 0] - r[:-1, 2]).sum() / (r[-1, 2] - r[0, 2]))
    assert _tuning.stepped_share(rec, 10, 20) == pytest.approx((r[11:20, 0] - r[10:19, 2]).sum() / (r[19, 2] - r[10, 2]))
    assert _tuning.stepped_share(rec, 39, 40) is None


# ---- the batches: the same whatever is chosen ----------------------------------------------------------------------


def _epochs(loader: Loader, epochs: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    out = []
    for _ in range(epochs):
        out.append([(x.numpy().copy(), y.numpy().copy()) for x, y in loader])
    return out


_EXPECTED: dict[tuple[str, int], list] = {}


def _expected(path: Path, num_workers: int, epochs: int, monkeypatch: pytest.MonkeyPatch) -> list:
    """The batches of a loader with the user's settings every epoch (tuning off), made once per worker count."""
    key = (str(path), num_workers)
    if key not in _EXPECTED:
        monkeypatch.setenv(_tuning.TUNING_ENV, "0")
        with Loader(path, batch_size=24, num_workers=num_workers, order=OrderOption.RANDOM, seed=5) as loader:
            _EXPECTED[key] = _epochs(loader, epochs)
            assert loader._tuner.last is not None and loader._tuner.last.producers == loader._producers
        monkeypatch.delenv(_tuning.TUNING_ENV)
    return _EXPECTED[key]


@pytest.mark.compiled_loop
@settings(max_examples=examples(ci=4, long=20), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_workers=st.sampled_from([1, 2]), picks=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), min_size=3, max_size=3))
def test_the_batches_are_the_same_whatever_producers_and_batches_ahead_are_chosen(
    table_path: Path, monkeypatch: pytest.MonkeyPatch, num_workers: int, picks: list[tuple[int, int]]
) -> None:
    """Acceptance (issue 45): each epoch forced to other producers / batches ahead (none: the loop makes every batch)
    through the real engine gives exactly the batches of a loader with fixed settings (same seed). Compiled producers."""
    expected = _expected(table_path, num_workers, len(picks), monkeypatch)
    chosen: list[tuple[int, int]] = []

    def force(epoch: int, limits: Limits) -> tuple[int, int]:
        a, b = picks[epoch]
        p = a % (limits.producers + 1) if limits.loop_makes else 1 + a % limits.producers
        ahead = 1 + b % (limits.total // max(1, p))
        chosen.append((p, ahead))
        return p, ahead

    with Loader(table_path, batch_size=24, num_workers=num_workers, order=OrderOption.RANDOM, seed=5) as loader:
        loader._tuner.force = force
        got = []
        for e in range(len(picks)):
            made = loader.stats()["loader"]["batches_made_by_loop"]
            it = iter(loader)
            assert isinstance(it, CompiledEpoch) and it._batches.compiled
            ring = it._ring
            assert (ring.producers, ring.ahead) == (max(1, chosen[e][0]), chosen[e][1])  # the choice reached the ring
            got.append([(x.numpy().copy(), y.numpy().copy()) for x, y in it])
            if chosen[e][0] == 0:  # no producer ran: the loop made every batch (but a first one made ahead by the epoch before's)
                assert loader.stats()["loader"]["batches_made_by_loop"] - made == len(loader) - getattr(it, "_first_ready_at_start", 0)
        assert loader.stats()["loader"]["producers_last_epoch"] == chosen[-1][0]
    assert len(got) == len(expected)
    for e, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert len(mine) == len(theirs), e
        for (x, y), (x0, y0) in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(x, x0, err_msg=f"epoch {e}, chosen {chosen[e]}")
            np.testing.assert_array_equal(y, y0, err_msg=f"epoch {e}, chosen {chosen[e]}")


def test_a_loop_that_never_waits_gets_fewer_producers_each_epoch_and_report_says_why(
    table_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine follows the rule: the accounting's figure (here pinned: the loop waited 0.2%) takes the loader one level
    down each epoch to the loop making every batch; ``report()`` and ``stats()`` say so. The batches stay the same."""
    expected = _expected(table_path, 2, 3, monkeypatch)
    monkeypatch.setattr(_tuning, "waited_share", lambda rec, lo, hi: (0.002, 100))
    monkeypatch.setattr(_tuning, "stepped_share", lambda rec, lo, hi: 0.9)  # (a training step: most of the epoch)
    seen, got = [], []
    with Loader(table_path, batch_size=24, num_workers=2, order=OrderOption.RANDOM, seed=5) as loader:
        for _ in range(5):
            it = iter(loader)
            seen.append((it._tuned.producers, it._ring.producers, it._ring.ahead))  # type: ignore[union-attr]
            got.append([(x.numpy().copy(), y.numpy().copy()) for x, y in it])
        levels = ladder(loader._tuner.last.limits)  # type: ignore[union-attr]
        text = loader.report()
        stats = loader.stats()["loader"]
    assert levels[0] == (2, loader._tokens_per_producer) and levels[-1] == (0, 1)
    assert seen == [(p, max(1, p), a) for p, a in (levels[min(e, len(levels) - 1)] for e in range(5))]  # (the ring's)
    assert "producers (epoch 4): no producer (the loop makes each batch); kept: the loop waited 0.2%" in text
    assert stats["producers_last_epoch"] == 0 and stats["batches_ahead_last_epoch"] == 0
    for mine, theirs in zip(got, expected):  # (the epochs the reference has)
        for (x, y), (x0, y0) in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(x, x0)
            np.testing.assert_array_equal(y, y0)


def _epochs_as_set(loader: Loader, epochs: int) -> None:
    """Iterate ``epochs`` epochs of a 2-worker loader, each started with the producers and batches ahead as set."""
    for _ in range(epochs):
        it = iter(loader)
        assert (it._ring.producers, it._ring.ahead) == (2, loader._tokens_per_producer)  # type: ignore[attr-defined]
        for _ in it:
            pass


def test_a_loop_that_does_little_between_batches_keeps_the_users_settings(table_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop with no step (a benchmark, seed 003's loop) never waits when producers keep up, and yet it is data-bound:
    fewer producers would slow it. The loop's waits pinned at 0 (as if producers always kept up) and its steps at a
    tenth of the epoch (measured, they depend on how a busy machine schedules the loop's thread; the accounting itself
    is :func:`test_stepped_share_is_the_time_between_next_calls_over_the_epochs_time`'s): every epoch as set."""
    monkeypatch.setattr(_tuning, "waited_share", lambda rec, lo, hi: (0.0, 100))
    monkeypatch.setattr(_tuning, "stepped_share", lambda rec, lo, hi: 0.1)
    with Loader(table_path, batch_size=8, num_workers=2, order=OrderOption.RANDOM, seed=5) as loader:
        _epochs_as_set(loader, 4)
        last = loader._tuner.last
        assert last is not None and last.level == 0 and not last.first_ahead
        text = loader.report()
    assert "a loop that does little between batches goes as fast as they come" in text, text
    assert "the next epoch's first batch is not made ahead" in text, text


def test_the_step_share_gates_fewer_producers() -> None:
    limits = Limits(2, 8, True)
    first = choose(limits, None, None, 0)
    assert choose(limits, first, 0.0, 100, stepped=0.9).level == 1  # a long step: fewer
    kept = choose(limits, first, 0.0, 100, stepped=0.1)  # little between batches: as set
    assert kept.level == 0 and "does little between batches" in kept.reason
    assert choose(limits, first, 0.0, 100, stepped=None).level == 1  # (not measured: the rule on waits alone)


@settings(max_examples=200, deadline=None)
@given(
    enabled=st.booleans(),
    stepped=st.one_of(st.none(), st.floats(0, 1), st.sampled_from([0.0, _tuning.STEPPED_LOW - 1e-9, _tuning.STEPPED_LOW, 1.0])),
    steps=st.integers(-1, 3 * _tuning.MIN_STEPS),
    waited=st.one_of(st.none(), st.floats(0, 1)),
    first=st.booleans(),
)
def test_the_next_epochs_first_batch_is_made_ahead_unless_the_loop_did_little_between_batches(
    enabled: bool, stepped: float | None, steps: int, waited: float | None, first: bool
) -> None:  # fmt: skip
    """Made ahead unless tuning is on, the last epoch timed at least ``MIN_STEPS`` batches and its steps took less
    than ``STEPPED_LOW`` of it: whatever the level chosen, on the first epoch too (nothing measured then)."""
    limits = Limits(2, 8, True)
    previous = None if first else choose(limits, None, None, 0)
    got = choose(limits, previous, waited, steps, enabled, stepped)
    little = enabled and stepped is not None and steps >= _tuning.MIN_STEPS and stepped < _tuning.STEPPED_LOW
    assert got.first_ahead is (not little)


def test_stoker_tuning_0_keeps_the_users_settings(table_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_tuning.TUNING_ENV, "0")
    monkeypatch.setattr(_tuning, "waited_share", lambda rec, lo, hi: (0.0, 100))
    with Loader(table_path, batch_size=24, num_workers=2, order=OrderOption.RANDOM, seed=5) as loader:
        _epochs_as_set(loader, 3)
        assert "as set (tuning is off: STOKER_TUNING=0)" in loader.report()


def test_a_forced_choice_outside_the_limits_is_refused() -> None:
    tuner = Tuner()
    tuner.force = lambda epoch, limits: (0, 1)
    with pytest.raises(ValueError, match="outside"):
        tuner.epoch_start(0, Limits(1, 4, False), None)
    tuner.force = lambda epoch, limits: (2, 4)
    with pytest.raises(ValueError, match="outside"):
        tuner.epoch_start(0, Limits(2, 4, True), None)
    assert isinstance(choose(Limits(1, 1, False), None, None, 0), Choice)
