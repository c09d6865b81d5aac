"""Fused pipelines are cached on disk: a second process loads instead of compiling."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from stoker.pipeline.cache import fingerprint
from stoker.pipeline.compiler import Compiler
from stoker.transforms import RandomHorizontalFlip


def _code(op: object) -> object:
    return Compiler.compile(op.generate_code())  # type: ignore[attr-defined]


def test_fingerprint_follows_code_and_constants() -> None:
    a, b, c = _code(RandomHorizontalFlip(0.5)), _code(RandomHorizontalFlip(0.5)), _code(RandomHorizontalFlip(0.7))
    assert fingerprint("src", [a]) == fingerprint("src", [b]) is not None
    assert fingerprint("src", [a]) != fingerprint("src", [c]), "a different constant must change the key"
    assert fingerprint("src", [a]) != fingerprint("other source", [a])


def test_closures_over_arbitrary_objects_are_not_cached() -> None:
    class Opaque:
        pass

    thing = Opaque()

    def op(batch, dst):  # type: ignore[no-untyped-def]
        return thing

    assert fingerprint("src", [op]) is None


SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from stoker.loader import Loader, OrderOption
    from stoker.fields.decoders import NDArrayDecoder
    from stoker.transforms import ToTensor
    from tests.pipeline.test_pipelines import AddIndex, RandomNegate

    loader = Loader(sys.argv[1], batch_size=100, seed=3, order=OrderOption.RANDOM,
                    pipelines={"x": [NDArrayDecoder(), AddIndex(), RandomNegate(), ToTensor()], "y": None})
    total = sum(float(x.double().sum()) for (x,) in loader)
    hits = sum(loader.pipelines[0].fused.stats.cache_hits.values())
    print(f"{total!r} {hits}")
    """
)


def test_second_process_loads_the_fused_function(table_path: Path, tmp_path: Path) -> None:
    env = dict(os.environ, STOKER_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(Path(__file__).parents[2]))
    runs = [
        subprocess.run([sys.executable, "-c", SCRIPT, str(table_path)], capture_output=True, text=True, env=env, timeout=300)
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr
    (total1, hits1), (total2, hits2) = (run.stdout.split() for run in runs)
    assert int(hits1) == 0 and int(hits2) >= 1, "the second process should load the fused function from the cache"
    assert np.isclose(float(total1), float(total2))
    assert list((tmp_path / "cache" / "fused").glob("fused_*.py"))
