"""A cached function registers every kernel its machine code calls by symbol, whichever process compiled it.

A loader's producer loop links the fused function it calls. When the fused
function came from the disk cache, Numba gave its library no ``reload_init``
(the relinks of the kernels it calls by symbol), so the loop was cached
without them; a later process that loaded that loop, and nothing else calling
those kernels, called unresolved symbols: a segmentation fault in
``run_loop``. Here two loaders share one fused function (field ``x``) and
differ in their loops (with or without the field ``y``), each run in its own
process over one private cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from stoker.image import _kernels
from stoker.pipeline import linking

SCRIPT = textwrap.dedent(
    """
    import sys
    from stoker.decoders import IntDecoder, NDArrayDecoder
    from stoker.loader import Loader
    from stoker.pipeline.allocation_query import AllocationQuery
    from stoker.pipeline.operation import Operation
    from stoker.transforms import ToTensor

    if sys.argv[3] == "forget":  # an older stoker: a library loaded from the cache keeps no reload_init
        from stoker.pipeline import prebuilt

        keeping = prebuilt.load_without_refresh

        def forgetting(cache, sig, target_context):
            cres = keeping(cache, sig, target_context)
            if cres is not None:
                cres.library._reload_init.clear()
            return cres

        prebuilt.load_without_refresh = forgetting


    class Double(Operation):
        def declare_state_and_memory(self, previous_state):
            return previous_state, AllocationQuery(previous_state.shape, previous_state.dtype)

        def generate_code(self):
            def double(batch, dst):
                for i in range(batch.shape[0]):
                    for j in range(batch.shape[1]):
                        dst[i, j] = batch[i, j] * 2
                return dst

            return double


    labels = [IntDecoder(), ToTensor()] if sys.argv[2] == "labels" else None
    loader = Loader(sys.argv[1], batch_size=100, num_workers=1, pipelines={"x": [NDArrayDecoder(), Double(), ToTensor()], "y": labels})
    total = sum(float(batch[0].double().sum()) for batch in loader)
    loop = loader._plan.loop
    print(total, sum(loop.stats.cache_hits.values()), sum(loop.stats.cache_misses.values()))
    loader.close()
    """
)


def test_a_loop_linking_a_cached_fused_function_is_cached_with_its_kernels(table_path: Path, tmp_path: Path) -> None:
    env = dict(os.environ, STOKER_CACHE_DIR=str(tmp_path / "cache"), STOKER_COMPILE_IN_BACKGROUND="0", STOKER_COMPILED_EPOCH="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2] / "src"), env.get("PYTHONPATH", "")])
    x = np.arange(1000, dtype=np.float32)[:, None] * 100 + np.arange(5, dtype=np.float32)  # the table_path fixture
    expected = float((x * 2).astype(np.float64).sum())

    def run(fields: str, mode: str = "") -> tuple[float, int, int]:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(table_path), fields, mode], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"exit status {done.returncode} (-11: a segmentation fault)\n{done.stderr[-3000:]}"
        total, hits, misses = done.stdout.split()
        return float(total), int(hits), int(misses)

    assert run("labels")[0] == expected  # compiles the fused function of x and a loop with y
    # the same fused function from the cache, a loop without y compiled linking it: cached as an older stoker did,
    # calling the fused function's kernel (the column decoder) without registering it
    assert run("x", "forget")[0] == expected
    total, hits, misses = run("x")
    assert total == expected, "the loop's entry calls a kernel it does not register: it must be compiled again, not run"
    assert (hits, misses) == (0, 1), f"the incomplete entry should be a miss (hits, misses: {hits, misses})"
    total, hits, _ = run("x")
    assert total == expected
    assert hits == 1, "the loop compiled again (linking the fused function from the cache) should be cached complete, and load"


def test_the_symbols_a_cached_entry_calls_are_found_by_the_names_they_are_registered_under() -> None:
    import numba

    argtypes = (numba.typeof(np.zeros(3, dtype=np.int64)),)
    name = linking._symbol(linking._prefix(_kernels.decode_begin, False), argtypes)
    code = b"\x00junk\x00" + name.encode() + b"\x00stoker_kernel_short\x00"
    assert linking.called_symbols(code) == {name}
    relink = linking._Relink("stoker.image._kernels", "decode_begin", False, argtypes)
    assert relink.symbol() == name
    assert linking.unregistered(code, [relink]) == set()
    assert linking.unregistered(code, []) == {name}
    gone = linking._Relink("stoker.image._kernels", "no_such_kernel", False, argtypes)
    assert linking.unregistered(code, [gone]) == {name}, "a relink of a kernel that is gone registers nothing"
