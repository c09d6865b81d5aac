"""A first batch's kernels compiled in parallel child processes (issue 44, :mod:`stoker.pipeline._ahead`), and each
kernel of a long compile said (:mod:`stoker.pipeline.warm`).

The kernels are three small nested functions of a module of this test, named as one of stoker's modules and cached in
a private folder of the test (:class:`~stoker._numba_cache.PrivateFunctionCache`, as the library's kernels are):
they are in no cache when a test starts. Nothing waits on time: the children are waited for by their exit, a child
is stopped where a marker file says it is, and ``ANNOUNCE_AFTER`` is 0. The loader's own kernels compiled by children
from empty caches, with batches equal to a warm cache's, are covered by the ``long`` test at the end.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numba
import numpy as np
import pytest
from numba.core import event

from stoker import _numba_cache
from stoker.pipeline import _ahead, warm

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the compile children are forked")

SOURCE = textwrap.dedent(
    """
    import numba

    @numba.njit
    def leaf(x):
        return x * 3 + 1

    @numba.njit
    def middle(x):
        return leaf(x) + leaf(x + 1)

    @numba.njit
    def outer(x):
        return middle(x) * 2 - leaf(x)
    """
)
_modules = itertools.count()
I64 = (numba.types.int64,)


def _reference(x: int) -> int:
    def leaf(v: int) -> int:
        return v * 3 + 1

    return (leaf(x) + leaf(x + 1)) * 2 - leaf(x)


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The three kernels, in a module named as stoker's, each cached in the test's private folder; children on."""
    folder = tmp_path / "kernels"
    folder.mkdir(mode=0o700)
    path = tmp_path / "probe.py"
    path.write_text(SOURCE)
    name = f"stoker._parallel_probe_{os.getpid()}_{next(_modules)}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    for fn in (module.leaf, module.middle, module.outer):
        fn._cache = _numba_cache.PrivateFunctionCache(fn.py_func, folder)
    monkeypatch.setenv("STOKER_COMPILE_IN_BACKGROUND", "1")
    monkeypatch.delenv("STOKER_COMPILE_IN_CHILD", raising=False)
    monkeypatch.setenv(_ahead.CHILDREN_ENV, "2")
    return module


class _Compiles(event.Listener):  # type: ignore[misc]
    """The functions this process compiles (Numba's compile events; a load from the disk cache is none)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def on_start(self, ev: Any) -> None:
        if os.getpid() == self.pid:
            self.names.append(ev.data["dispatcher"].py_func.__name__)

    def on_end(self, ev: Any) -> None:
        pass


@pytest.fixture
def compiles() -> Iterator[_Compiles]:
    listener = _Compiles()
    listener.pid = os.getpid()
    event.register("numba:compile", listener)
    yield listener
    event.unregister("numba:compile", listener)


def test_the_kernels_children_compile_are_loaded_by_the_parent(kernels: ModuleType, compiles: _Compiles) -> None:
    """Only the outer call is given: the finder lists its callees, the children compile all three into the cache,
    and the parent's first call compiles nothing."""
    started = _ahead.start([_ahead.Call(kernels.outer, I64)])
    assert started is not None and len(started.compilers) == 2
    assert started.wait(300), "the compile children did not end"
    assert set(started.status.values()) == {0}, started.status
    for fn in (kernels.leaf, kernels.middle, kernels.outer):
        assert warm.state(fn, I64) == "cached", fn.py_func.__name__
    assert [kernels.outer(x) for x in range(-3, 4)] == [_reference(x) for x in range(-3, 4)]
    assert compiles.names == [], f"compiled in the parent although the children cached them: {compiles.names}"


def test_nothing_starts_when_the_calls_are_cached_or_children_are_off(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_ahead.CHILDREN_ENV, "0")
    assert _ahead.start([_ahead.Call(kernels.outer, I64)]) is None
    monkeypatch.setenv(_ahead.CHILDREN_ENV, "1")
    monkeypatch.setenv("STOKER_COMPILE_IN_BACKGROUND", "0")
    assert _ahead.start([_ahead.Call(kernels.outer, I64)]) is None
    monkeypatch.setenv("STOKER_COMPILE_IN_BACKGROUND", "1")
    kernels.outer.compile(I64)
    assert _ahead.start([_ahead.Call(kernels.outer, I64)]) is None
    monkeypatch.setenv(_ahead.CHILDREN_ENV, "two")
    with pytest.raises(ValueError, match="STOKER_COMPILE_CHILDREN='two': expected a whole number"):
        _ahead.children()


class _Hang(event.Listener):  # type: ignore[misc]
    """In a child process only: at the start of ``leaf``'s compile, write ``marker`` and wait to be killed."""

    def __init__(self, parent: int, marker: Path) -> None:
        self.parent, self.marker = parent, marker

    def on_start(self, ev: Any) -> None:
        if os.getpid() != self.parent and ev.data["dispatcher"].py_func.__name__ == "leaf":
            self.marker.write_text(str(os.getpid()))
            time.sleep(3600)

    def on_end(self, ev: Any) -> None:
        pass


def test_a_child_killed_mid_compile_leaves_nothing_and_the_parent_compiles_it(
    kernels: ModuleType, compiles: _Compiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_ahead.CHILDREN_ENV, "1")
    marker = tmp_path / "in-leaf"
    hang = _Hang(os.getpid(), marker)
    event.register("numba:compile", hang)  # (the children are forked with it)
    try:
        started = _ahead.start([_ahead.Call(kernels.outer, I64)])
    finally:
        event.unregister("numba:compile", hang)
    assert started is not None
    for _ in range(30000):  # (a bound against a broken run only: the child writes the marker inside leaf's compile)
        if marker.exists() and marker.read_text():
            break
        time.sleep(0.01)
    pid = int(marker.read_text())
    assert pid in started.compilers
    os.kill(pid, signal.SIGKILL)  # mid-compile, holding leaf's cache entry lock
    assert started.wait(300)
    assert started.status[pid] == -signal.SIGKILL
    assert warm.state(kernels.leaf, I64) == "missing", "a killed compile left an entry in the cache"
    assert [kernels.outer(x) for x in range(-3, 4)] == [_reference(x) for x in range(-3, 4)]
    assert set(compiles.names) == {"leaf", "middle", "outer"}, compiles.names  # the parent compiled what was left
    assert warm.state(kernels.leaf, I64) == "ready"


def test_each_kernel_of_a_long_compile_is_said_from_the_compiling_thread(
    kernels: ModuleType, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(warm, "ANNOUNCE_AFTER", 0.0)
    monkeypatch.setattr(warm, "_burst", dict(warm._burst, running={}, done=[], last=-1e9, expected=[], said=False, started=0))
    caplog.set_level(logging.INFO, logger="stoker")
    warm.watch()
    thread = threading.Thread(target=lambda: kernels.outer.compile(I64), name="stoker-test-compiler")
    thread.start()
    thread.join(300)
    said = [(r.threadName, r.getMessage()) for r in caplog.records]
    assert {t for t, _ in said} == {"stoker-test-compiler"}, said
    messages = [m for _, m in said]
    assert "waiting for the compiler" in messages[0] and ".outer" in messages[0], messages
    short = kernels.__name__.rsplit(".", 1)[-1]
    for k, fn in ((2, "middle"), (3, "leaf")):
        assert any(m.startswith(f"stoker: compiling kernel {k} of {k}: {short}.{fn} (cached afterwards)") for m in messages), messages
        assert any(m.startswith(f"stoker: compiled kernel {k}: {short}.{fn} in ") for m in messages), messages
    assert any(m.startswith(f"stoker: compiled kernel 1: {short}.outer in ") for m in messages), messages
    assert not any(m.startswith("stoker: compiling kernel 1 ") for m in messages), "the first kernel is named by the burst's message"


# ---- the loader's own kernels ------------------------------------------------------------------------------------


def _photos(tmp_path: Path) -> Path:
    from stoker.fields import IntField, RGBImageField
    from stoker.writer import DatasetWriter

    rng = np.random.default_rng(1)
    images = [(rng.integers(0, 255, (40 + i % 7, 50 - i % 5, 3), dtype=np.uint8), i % 3) for i in range(24)]
    path = tmp_path / "photos.stoker"
    fields = {"image": RGBImageField(write_mode="jpg", jpeg_quality=90), "label": IntField()}
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset(images)
    return path


@pytest.mark.parametrize("kind", ["table", pytest.param("photos", marks=pytest.mark.long)])
def test_the_planned_calls_are_those_the_first_batch_makes(kind: str, tmp_path: Path, table_path: Path) -> None:
    """The calls the planner hands to the children (function and argument types) are the ones the first batch's
    Python producers make: after one batch's heads, each needed call's types are among its function's overloads.
    (``photos``: the JPEG decoder's kernels, and a flip given as its compiled form; long where the session's caches
    do not hold the decoder yet.)"""
    from collections import defaultdict

    from stoker.decoders import IntDecoder, NDArrayDecoder, RandomResizedCropRGBImageDecoder
    from stoker.loader import Loader, OrderOption, _planner
    from stoker.pipeline.random import sample_seeds
    from stoker.transforms import RandomHorizontalFlip, ToTensor

    if kind == "photos":
        path = _photos(tmp_path)
        pipelines = {
            "image": [RandomResizedCropRGBImageDecoder((32, 32)), RandomHorizontalFlip(), ToTensor()],
            "label": [IntDecoder(), ToTensor()],
        }
        want = {"decode_images", "_decode_scalar"}
    else:
        path = table_path
        pipelines = {"x": [NDArrayDecoder(), ToTensor()], "y": [IntDecoder(), ToTensor()]}
        want = {"_decode_rows", "_decode_scalar"}
    loader = Loader(path, batch_size=8, num_workers=1, order=OrderOption.RANDOM, seed=5, pipelines=pipelines)
    try:
        loader._allocate()
        calls = _planner._first_calls(loader.pipelines, unfused=True)
        needed = {c.function.py_func.__name__ for c in calls if c.needed}
        assert needed == want, needed
        if kind == "photos":
            assert any(not c.needed for c in calls), "the flip (Python calling a kernel) is given as its compiled form"
        indices = np.arange(8, dtype=np.int64)
        positions = np.arange(8, dtype=np.int64)
        for p in loader.pipelines:
            p.run_head(indices, positions, 0, lambda salt, pos: sample_seeds(5, 0, pos, salt), defaultdict(float), unfused=True)
        for c in calls:
            if c.needed:
                assert c.argtypes in c.function.overloads, (c.function.py_func.__name__, c.argtypes, list(c.function.overloads))
    finally:
        loader.close()


# ---- the loader's own kernels, from empty caches ---------------------------------------------------------------

SRC = str(Path(__file__).parents[2] / "src")

LOADER = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    from numba.core import event
    from stoker.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from stoker.loader import Loader, OrderOption
    from stoker.pipeline import _ahead
    from stoker.transforms import RandomHorizontalFlip, ToTensor

    compiled = []

    class Count(event.Listener):
        def on_start(self, ev):
            compiled.append(ev.data["dispatcher"].py_func.__qualname__)

        def on_end(self, ev):
            pass

    event.register("numba:compile", Count())
    pipelines = {"image": [RandomResizedCropRGBImageDecoder((32, 32)), RandomHorizontalFlip(), ToTensor()], "label": [IntDecoder(), ToTensor()]}
    loader = Loader(sys.argv[1], batch_size=8, num_workers=2, order=OrderOption.RANDOM, seed=5, pipelines=pipelines)
    batches = [[x.numpy().tolist(), y.numpy().tolist()] for x, y in loader]
    started = _ahead.last[0] if _ahead.last else None
    if started is not None:
        started.wait(600)
    print(json.dumps({"batches": batches, "compiled": compiled, "children": None if started is None else sorted(started.status.values())}))
    """
)


@pytest.mark.long
def test_a_loaders_first_batch_with_compile_children_equals_a_warm_caches(tmp_path: Path) -> None:
    """Empty caches (stoker's and the kernels', no prebuilt kernels): the children compile beside the first batch;
    the epoch's batches are bit-identical to those of a process whose caches are warm (the second run)."""
    path = _photos(tmp_path)
    env = dict(os.environ, STOKER_CACHE_DIR=str(tmp_path / "cache"), STOKER_PREBUILT="0", STOKER_COMPILE_IN_BACKGROUND="1")
    env.pop("STOKER_CACHE_KERNELS_DIR", None)  # (the suite's shared kernels folder: these processes start from empty caches)
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", LOADER, str(path)], env=env, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm_ = runs
    assert cold["children"] and set(cold["children"]) == {0}, cold["children"]  # started, and each ended well
    assert warm_["children"] is None, "nothing to compile with warm caches: no child"
    assert cold["batches"] == warm_["batches"]
    assert "decode_images" not in warm_["compiled"]
