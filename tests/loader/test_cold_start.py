"""A new environment's first batch: the producer loop compiled in the background, prebuilt kernels, warm-up, the message.

* a loader whose producer loop is in no cache makes its first epoch with Python producers
  (the heads step by step, no fused code compiled), starts compiling the loop once the first
  batch is made, and runs it from a later epoch: the same batches throughout;
* ``Loader.compile()`` fills the caches and leaves the loader's position as it was; a new
  process then runs the compiled loop from its first batch;
* the library's prebuilt kernels (compiled for the generic CPU) load in a process whose own
  caches are empty, and are ignored once stoker's sources differ from those they were built from;
* a one-line message when compiling takes longer than :data:`stoker.pipeline.warm.ANNOUNCE_AFTER`;
* ``stoker warmup``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stoker.cli.main import main as cli
from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.fields import IntField, NDArrayField
from stoker.loader import Loader, OrderOption, _planner
from stoker.pipeline import cache as pipeline_cache
from stoker.pipeline import prebuilt, warm
from stoker.transforms import Squeeze, ToTensor
from stoker.writer import DatasetWriter

SRC = str(Path(__file__).parents[2] / "src")


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cold") / "table.stoker"
    rng = np.random.default_rng(0)
    rows = [(rng.random(7, dtype=np.float32), i % 5) for i in range(61)]
    DatasetWriter(
        path, {"x": NDArrayField(shape=(7,), dtype=np.dtype("float32")), "y": IntField()}, num_workers=1, progress=False
    ).from_indexed_dataset(rows)
    return path


@pytest.fixture
def background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Background compilation on, and a stoker cache of this test's own: the producer loop is in no cache.

    Nor in this process's memos of compiled loops and loaded cache files: a test run before this one in the same process (pytest-xdist
    places tests anywhere) may have compiled the same loop.
    """
    monkeypatch.setenv("STOKER_COMPILE_IN_BACKGROUND", "1")
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "stoker-cache"))
    monkeypatch.setattr(_planner, "_LOOPS", {})
    monkeypatch.setattr(pipeline_cache, "_LOADED", {})
    for name in [m for m in sys.modules if m.startswith("stoker_fused_")]:  # (their files, and Numba's index, are elsewhere)
        monkeypatch.delitem(sys.modules, name)
    yield


def _pipelines() -> dict[str, list[object]]:
    return {"x": [NDArrayDecoder(), ToTensor()], "y": [IntDecoder(), ToTensor(), Squeeze()]}


def _epochs(loader: Loader, n: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    return [[(x.numpy().copy(), y.numpy().copy()) for x, y in loader] for _ in range(n)]


@pytest.mark.compiled_loop
def test_the_first_epoch_runs_while_the_loop_compiles(table: Path, background: None) -> None:
    loader = Loader(table, batch_size=8, num_workers=2, order=OrderOption.RANDOM, seed=3, pipelines=_pipelines())
    try:
        it = iter(loader)
        first = next(it)
        plan = loader._plan
        assert plan is not None and plan.loop is not None, plan
        assert not it._batches.compiled, "a loop in no cache should not be compiled before the first batch"  # type: ignore[attr-defined]
        assert plan.background is not None and plan.background.started, "the loop's compilation starts after the first batch"
        rest = [(x.numpy().copy(), y.numpy().copy()) for x, y in it]
        assert plan.background.wait(600) and plan.background.error is None, plan.background.error
        later = iter(loader)
        assert later._batches.compiled, "once compiled, the next epoch runs the compiled loop"  # type: ignore[attr-defined]
        second = [(x.numpy().copy(), y.numpy().copy()) for x, y in later]
    finally:
        loader.close()
    with pytest.MonkeyPatch.context() as m:
        m.setenv("STOKER_COMPILE_IN_BACKGROUND", "0")
        reference = Loader(table, batch_size=8, num_workers=2, order=OrderOption.RANDOM, seed=3, pipelines=_pipelines())
        expected = _epochs(reference, 2)
        reference.close()
    got = [[(first[0].numpy().copy(), first[1].numpy().copy()), *rest], second]
    for e in range(2):
        assert len(got[e]) == len(expected[e])
        for (xg, yg), (xe, ye) in zip(got[e], expected[e], strict=True):
            assert np.array_equal(xg, xe) and np.array_equal(yg, ye), f"epoch {e}: the batches differ"


CHILD = r"""
import json, sys
from stoker.decoders import NDArrayDecoder
from stoker.loader import Loader
from stoker.transforms import ToTensor
loader = Loader(sys.argv[1], batch_size=8, num_workers=2, seed=3, pipelines={"x": [NDArrayDecoder(), ToTensor()], "y": None})
it = iter(loader)
next(it)
print(json.dumps({"compiled": it._batches.compiled, "background": loader._plan.background is not None}))
loader.close()
"""


@pytest.mark.compiled_loop
def test_compile_fills_the_caches_and_keeps_the_position(table: Path, background: None, tmp_path: Path) -> None:
    # (a producer loop no other test of this process compiles: one field)
    loader = Loader(table, batch_size=8, num_workers=2, seed=3, pipelines={"x": [NDArrayDecoder(), ToTensor()], "y": None})
    before = loader.state_dict()
    seconds = loader.compile()
    assert seconds >= 0 and loader.state_dict() == before, "compile() must not move the loader's position"
    assert loader._plan is not None and loader._plan.background is not None and loader._plan.background.done()
    loader.close()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", CHILD, str(table)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"compiled": True, "background": False}, "after compile(), a new process should run the cached loop at once"


def test_warmup_command(table: Path, background: None, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli(["warmup", str(table), "--batch-size", "8"]) == 0
    assert "compiled and cached" in capsys.readouterr().out
    pipelines = tmp_path / "pipes.py"
    pipelines.write_text(
        "from stoker.decoders.arrays import IntDecoder, NDArrayDecoder\n"
        "from stoker.transforms import ToTensor\n"
        "def pipelines():\n    return {'x': [NDArrayDecoder(), ToTensor()], 'y': [IntDecoder()]}\n"
    )
    assert cli(["warmup", str(table), "--pipelines", f"{pipelines}:pipelines"]) == 0
    assert cli(["warmup", str(table), "--pipelines", f"{pipelines}:missing"]) == 1
    assert "has no 'missing'" in capsys.readouterr().err
    assert cli(["warmup"]) == 2


def test_a_slow_compilation_is_announced(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from numba.core import event

    monkeypatch.setattr(warm, "ANNOUNCE_AFTER", 0.2)
    caplog.set_level(logging.INFO, logger="stoker")
    compiling = {"dispatcher": None, "args": (), "return_type": None}
    with warm.announced("the test's function"), event.trigger_event("numba:compile", data=compiling):
        time.sleep(0.6)  # what Numba reports as a compilation, for longer than ANNOUNCE_AFTER
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("stoker: compiling the test's function") for m in messages), messages
    assert any(m.startswith("stoker: compiled the test's function in") for m in messages), messages
    caplog.clear()
    with warm.announced("nothing compiled"):
        time.sleep(0.6)  # as slow, but not compiling: no message
    with (
        warm.announced("a short compilation"),
        event.trigger_event("numba:compile", data={"dispatcher": None, "args": (), "return_type": None}),
    ):
        pass
    assert not caplog.records, [r.getMessage() for r in caplog.records]


BUILD = r"""
import json, sys
from pathlib import Path
from stoker.pipeline import prebuilt
prebuilt.PREBUILT_DIR = Path(sys.argv[1])
import numpy as np
from stoker.pipeline.random import shuffle
prebuilt.attach(shuffle)
v = np.arange(50, dtype=np.int64)
shuffle(v, np.uint64(7))
print(json.dumps(prebuilt.save_all()))
"""

LOAD = r"""
import json, sys
from pathlib import Path
from stoker.pipeline import prebuilt
prebuilt.PREBUILT_DIR = Path(sys.argv[1])
if sys.argv[2] == "stale":
    prebuilt._STAMPS["stoker.pipeline.random"] = ("stoker-sources", "another tree")
import numpy as np
from stoker.pipeline.random import shuffle
prebuilt.attach(shuffle)
v = np.arange(50, dtype=np.int64)
shuffle(v, np.uint64(7))
print(json.dumps({"hits": prebuilt.hits, "misses": sum(shuffle.stats.cache_misses.values()), "order": v[:5].tolist()}))
"""


def test_prebuilt_kernels_load_in_a_new_environment(tmp_path: Path) -> None:
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    base.pop("NUMBA_CPU_FEATURES", None)
    base.pop("STOKER_CACHE_KERNELS_DIR", None)  # (the suite's shared kernels would be hits)
    # (each child its own stoker cache root, where stoker's kernels are cached: a kernel the session's root holds,
    # compiled by another test, would be a hit there and hide whether the prebuilt one is loaded)
    build = dict(base, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path / "build-cache"), STOKER_PREBUILT="0",
                 STOKER_CACHE_DIR=str(tmp_path / "build-root"))  # fmt: skip
    out = tmp_path / "prebuilt"
    done = subprocess.run([sys.executable, "-c", BUILD, str(out)], env=build, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert any("shuffle" in s for s in json.loads(done.stdout.strip().splitlines()[-1]))

    def load(cache: str, stamp: str) -> dict[str, object]:
        env = dict(base, NUMBA_CACHE_DIR=str(tmp_path / cache), STOKER_CACHE_DIR=str(tmp_path / f"{cache}-root"))
        env.pop("NUMBA_CPU_NAME", None)
        run = subprocess.run([sys.executable, "-c", LOAD, str(out), stamp], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    fresh = load("empty-1", "same")
    assert fresh["hits"] == ["shuffle"] and fresh["misses"] == 0, fresh
    stale = load("empty-2", "stale")
    assert stale["hits"] == [] and stale["misses"] == 1, "a prebuilt kernel from other sources must not be used"
    assert fresh["order"] == stale["order"], "the prebuilt kernel computes what the kernel compiled here computes"
    assert prebuilt.source_stamp("stoker.pipeline.random")[0] == "stoker-sources"


@pytest.mark.compiled_loop
def test_the_python_producers_batch_time_reaches_the_loops_compilation(
    table: Path, background: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the loop compiles, the median time of the first ``TIMED_BATCHES`` batches the Python producers make is
    told to the compilation once (which sets its priority: tests/pipeline/test_compile_priority.py)."""
    told: list[float] = []
    monkeypatch.setattr(warm.Background, "batches_take", lambda self, seconds: told.append(seconds))
    loader = Loader(table, batch_size=4, num_workers=2, order=OrderOption.RANDOM, seed=3, pipelines=_pipelines())
    try:
        batches = sum(1 for _ in loader)
        plan = loader._plan
        assert plan is not None and plan.background is not None and plan.background.wait(600)
    finally:
        loader.close()
    assert batches == 16 and len(told) == 1 and 0 < told[0] < 60, told
