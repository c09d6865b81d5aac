"""Weighted sources for flows (issue 33): ``mix_sequences`` gives one epoch of Python sequences mixed exactly by weight,
as a list, so a flow over it resumes at the item its state records."""

from __future__ import annotations

from collections import Counter

import pytest

from stoker.flow import Pipeline, PipelineBuilder
from stoker.loader.mixing import mix_sequences

WEB = [f"web-{i}" for i in range(70)]
CURATED = [f"cur-{i}" for i in range(6)]


def test_an_epoch_holds_each_sequence_s_share_and_rotates_the_small_one_s_passes() -> None:
    epochs = [mix_sequences([WEB, CURATED], [0.7, 0.3], seed=1, epoch=e, samples_per_epoch=40, batch_size=10) for e in range(3)]
    for items in epochs:
        assert Counter(s for s, _ in items) == {0: 28, 1: 12}
        for lo in range(0, 40, 10):
            assert Counter(s for s, _ in items[lo : lo + 10]) == {0: 7, 1: 3}  # every run of 10: 7 + 3
    web = [x for items in epochs for s, x in items if s == 0]
    assert len(set(web[:70])) == 70, "the web list: every item once before any twice"
    curated = [x for items in epochs for s, x in items if s == 1]
    assert all(Counter(curated[p * 6 : (p + 1) * 6]) == Counter(CURATED) for p in range(6)), "upsampled: whole passes"
    assert mix_sequences([WEB, CURATED], [0.7, 0.3], seed=1, epoch=2, samples_per_epoch=40) != mix_sequences(
        [WEB, CURATED], [0.7, 0.3], seed=2, epoch=2, samples_per_epoch=40
    )


@pytest.mark.parametrize("stop_after", [0, 13, 40])
def test_a_flow_over_a_mixed_epoch_resumes_where_it_stopped(stop_after: int) -> None:
    items = mix_sequences([WEB, CURATED], [0.7, 0.3], seed=5, samples_per_epoch=40)

    def build() -> Pipeline:
        return (
            PipelineBuilder().add_source(items).pipe(lambda item: item[1].upper(), concurrency=3, output_order="input").add_sink(4).build()
        )

    first = build()
    with first.auto_stop():
        got = [first.get_item(timeout=10) for _ in range(stop_after)]
        state = first.state_dict()
    second = build()
    second.load_state_dict(state)
    assert got + list(second) == [x.upper() for _, x in items]
