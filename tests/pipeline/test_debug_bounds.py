"""Debug mode: compiled operations are bounds-checked, and the fused-pipeline cache keeps the two modes apart."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numba
import pytest

from stoker.decoders import NDArrayDecoder
from stoker.errors import LoaderError
from stoker.loader import Loader
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State
from stoker.transforms import ToTensor


@numba.njit
def _poke(dst):  # type: ignore[no-untyped-def]
    # one past the end of row 0: in the batch's memory, that is row 1's first value
    dst[0, dst.shape[1]] = -1.0


class WritePastRow(Operation):
    """Copies the batch, then writes one value past the end of the first row (a bug to find)."""

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        return previous_state, AllocationQuery(previous_state.shape, previous_state.dtype)

    def generate_code(self):  # type: ignore[no-untyped-def]
        def write_past_row(batch, dst):  # type: ignore[no-untyped-def]
            for i in range(batch.shape[0]):
                for j in range(batch.shape[1]):
                    dst[i, j] = batch[i, j]
            _poke(dst)
            return dst

        return write_past_row


def _pipelines() -> dict:
    return {"x": [NDArrayDecoder(), WritePastRow(), ToTensor()], "y": None}


def test_debug_mode_raises_index_error_for_an_out_of_bounds_write(table_path: Path) -> None:
    with Compiler.debug():
        assert Compiler.is_debug()
        loader = Loader(table_path, batch_size=10, pipelines=_pipelines())
    assert loader.pipelines[0].fused is not None, "the decoder and the operation should be fused"
    with pytest.raises(LoaderError, match="IndexError") as info:
        for _ in loader:
            pass
    assert info.value.index == 0 and "WritePastRow" in str(info.value)


def test_loader_debug_argument_turns_bounds_checks_on(table_path: Path) -> None:
    loader = Loader(table_path, batch_size=10, pipelines=_pipelines(), debug=True)
    assert not Compiler.is_debug()  # only this loader's build
    with pytest.raises(LoaderError, match="IndexError"):
        for _ in loader:
            pass


def test_debug_switches() -> None:
    assert not Compiler.is_debug() or numba.config.BOUNDSCHECK
    with Compiler.debug():
        assert Compiler.is_debug() and Compiler.fused_options()["boundscheck"] is True
        with Compiler.debug(None):
            assert Compiler.is_debug(), "debug(None) leaves the mode as it is"
        with Compiler.debug(False):
            assert Compiler.is_debug() == bool(numba.config.BOUNDSCHECK)
    Compiler.set_debug(True)
    try:
        assert Compiler.is_debug()
    finally:
        Compiler.set_debug(False)


SCRIPT = textwrap.dedent(
    """
    import sys
    from stoker.errors import LoaderError
    from stoker.loader import Loader
    from stoker.pipeline.compiler import Compiler
    from tests.pipeline.test_debug_bounds import _pipelines

    with Compiler.debug(sys.argv[2] == "debug"):
        loader = Loader(sys.argv[1], batch_size=10, pipelines=_pipelines())
    try:
        first = next(iter(loader))[0]
    except LoaderError as err:
        print("LoaderError", err)
    else:
        plan = loader._plan  # the compiled producer loop, which calls the fused function, when it applies
        compiled = plan.loop if plan is not None and plan.loop is not None else loader.pipelines[0].fused
        print("value", float(first[1, 0]), sum(compiled.stats.cache_hits.values()))
    """
)


@pytest.mark.long  # child processes compiling from an empty cache (TEST_SPLIT.md)
def test_the_cache_keeps_debug_and_normal_builds_apart(table_path: Path, tmp_path: Path) -> None:
    env = dict(
        os.environ,
        STOKER_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("NUMBA_BOUNDSCHECK", None)

    def run(mode: str, **extra: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(table_path), mode], capture_output=True, text=True, env={**env, **extra}, timeout=300
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    # normal builds are not bounds-checked: the write lands, silently, in row 1 of the batch
    first, second = run("normal").split(), run("normal").split()
    assert first[0] == second[0] == "value" and float(first[1]) == -1.0, "without checks the write lands in the next row"
    assert int(first[2]) == 0 and int(second[2]) >= 1, "the second normal run should load the fused function from the cache"
    assert run("debug").startswith("LoaderError"), "a debug build must not load the unchecked fused function"
    assert run("normal", NUMBA_BOUNDSCHECK="1").startswith("LoaderError"), "NUMBA_BOUNDSCHECK=1 means debug mode"
    last = run("normal").split()
    assert last[1] == "-1.0" and int(last[2]) >= 1, "the normal build is still cached beside the debug one"
