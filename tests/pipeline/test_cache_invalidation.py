"""A fused pipeline loaded from the disk cache runs the code of today, not that of the run that cached it.

A user's module defines compiled functions that a custom operation's generated
code calls (``f`` calls ``g`` and reads the constant ``TABLE``); each process
below runs a loader over the same cache folder after one of them is edited.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from .._profile import long_run

USER_MODULE = """
import numba
import numpy as np

from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.operation import Operation

TABLE = np.array([{table}], dtype=np.float64)


@numba.njit
def g(x):
    return x * {factor}


@numba.njit
def f(x):
    return g(x) + {add} + TABLE[0]


class ApplyF(Operation):
    def declare_state_and_memory(self, previous_state):
        return previous_state, AllocationQuery(previous_state.shape, previous_state.dtype)

    def generate_code(self):
        def apply_f(batch, dst):
            for i in range(batch.shape[0]):
                for j in range(batch.shape[1]):
                    dst[i, j] = f(batch[i, j])
            return dst

        return apply_f
"""

SCRIPT = textwrap.dedent(
    """
    import sys
    from stoker.loader import Loader
    from stoker.decoders import NDArrayDecoder
    from stoker.transforms import ToTensor
    from userkernels import ApplyF

    loader = Loader(sys.argv[1], batch_size=100, pipelines={"x": [NDArrayDecoder(), ApplyF(), ToTensor()], "y": None})
    assert loader.pipelines[0].fused is not None
    total = sum(float(x.double().sum()) for (x,) in loader)
    plan = loader._plan  # the compiled producer loop, which calls the fused function, when it applies
    compiled = plan.loop if plan is not None and plan.loop is not None else loader.pipelines[0].fused
    print(total, sum(compiled.stats.cache_hits.values()))
    """
)


def _expected(add: float, factor: float, table: float) -> float:
    x = (np.arange(1000, dtype=np.float64)[:, None] * 100 + np.arange(5)).astype(np.float32)  # the table_path fixture
    return float((x.astype(np.float64) * factor + add + table).astype(np.float32).astype(np.float64).sum())


# five child processes importing torch and compiling (TEST_SPLIT.md): in make test, the key's change for each edit is
# test_cache.py::test_called_compiled_functions_are_hashed_by_their_code_recursively, a second process's cache hit
# test_cache.py::test_second_process_loads_the_fused_function
@pytest.mark.long
def test_an_edited_called_function_or_constant_is_compiled_again(table_path: Path, tmp_path: Path) -> None:
    user = tmp_path / "user"
    user.mkdir()
    env = dict(
        os.environ,
        STOKER_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=os.pathsep.join([str(user), str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
        PYTHONDONTWRITEBYTECODE="1",  # an edit of the same size in the same second must not reuse a .pyc
        # the subject is the fused function: under ``ci`` the children make their batches with Python producers calling
        # it (no producer loop compiled in each of the five); under ``long``, through the compiled loop that links it
        STOKER_COMPILED_EPOCH="1" if long_run() else "0",
    )

    def run(add: int, factor: int, table: float) -> tuple[float, int]:
        (user / "userkernels.py").write_text(USER_MODULE.format(add=add, factor=factor, table=table))
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(table_path)], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        total, hits = done.stdout.split()
        return float(total), int(hits)

    total, hits = run(1, 1, 0.0)
    assert total == _expected(1, 1, 0.0) and hits == 0
    total, hits = run(1, 1, 0.0)
    assert total == _expected(1, 1, 0.0) and hits >= 1, "an unchanged pipeline should load from the cache"
    total, _ = run(2, 1, 0.0)
    assert total == _expected(2, 1, 0.0), "f changed: the fused function must be compiled again"
    total, _ = run(2, 3, 0.0)
    assert total == _expected(2, 3, 0.0), "g (called by f) changed: the fused function must be compiled again"
    total, _ = run(2, 3, 5.0)
    assert total == _expected(2, 3, 5.0), "the constant array f reads changed: the fused function must be compiled again"
