"""Two operations' closures of the same name with other values never share machine code, whichever process compiled them.

Numba names a compiled function by its module, qualified name, argument types and a
counter of the process that compiled it. ``NormalizeImage``'s per-sample closure has
its mean and std as constants; compiled in one process and cached inside a fused
function, it could carry the symbol of another ``NormalizeImage`` closure compiled in
the process that loads it (same name, same counter when both processes compiled the
same things in the same order), and the cached code then called that one: a loader
normalising with other constants than its own (seen in ``make test``: a transforms test
got the mean and std of ``test_reference_model.py``'s pipelines). Here process 1
caches loader B's fused function; process 2 compiles loader A's (other constants) in
the same order, then loads B's from the cache: each must give its own values. The same
for an operation that returns its closure compiled already (a Numba dispatcher).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.fields import IntField, RGBImageField
from stoker.writer import DatasetWriter

N, H, W = 24, 9, 7
A = ([125.3, 122.9, 113.8], [63.0, 62.1, 66.7])
B = ([123.675, 116.28, 103.53], [58.395, 57.12, 57.375])

#: prepended to each process's script: ``number_first(name, uid)`` gives the first function named ``name`` that this
#: process compiles the number ``uid`` (Numba's per-process counter in its symbol), as another process numbered one
NUMBERING = textwrap.dedent(
    """
    from numba.core.bytecode import FunctionIdentity

    def number_first(name, uid):
        made, left = FunctionIdentity.from_function.__func__, [1]

        def numbered(cls, pyfunc):
            ident = made(cls, pyfunc)
            if pyfunc.__name__ == name and left[0]:
                left[0] = 0
                ident.unique_id = uid
                ident.unique_name = f"{ident.func_qualname}${uid}"
            return ident

        FunctionIdentity.from_function = classmethod(numbered)
    """
)

SCRIPT = NUMBERING + textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from stoker.decoders import IntDecoder, SimpleRGBImageDecoder
    from stoker.loader import Loader, OrderOption
    from stoker.transforms import NormalizeImage, ToTensor

    path, constants, uid = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    if uid:  # the coincidence, made sure of: this process's first normalising closure gets the number B's got in process 1
        number_first("normalize_image_one", uid)
    out, first_uid = [], 0
    for mean, std in constants:
        ops = [SimpleRGBImageDecoder(), NormalizeImage(np.array(mean), np.array(std), np.float32), ToTensor()]
        loader = Loader(path, batch_size=8, order=OrderOption.RANDOM, seed=0, num_workers=1,
                        pipelines={"img": ops, "label": [IntDecoder(), ToTensor()]})
        batches = [(x.numpy().copy(), y.numpy()[:, 0].copy()) for x, y in loader]
        one = loader.pipelines[0].fused.py_func.__globals__["one1"]  # (the fused function's normalising closure)
        first_uid = first_uid or max([o.fndesc.uid for o in one.overloads.values()] or [0])
        loader.close()
        out.append([np.concatenate([b[0] for b in batches]).tolist(), np.concatenate([b[1] for b in batches]).tolist()])
    print(json.dumps([first_uid, out]))
    """
)


def _run(script: str, path: Path, tmp_path: Path, compiled_loop: str, constants: list[Any], uid: int) -> tuple[int, Any]:
    """``script`` in a fresh process over ``path`` with ``constants`` (numbering as ``uid``; 0: not), stoker's cache in
    ``tmp_path`` (shared by the test's processes); its printed ``[first uid, out]``."""
    env = dict(os.environ, STOKER_CACHE_DIR=str(tmp_path / "cache"), STOKER_COMPILE_IN_BACKGROUND="0", STOKER_COMPILED_EPOCH=compiled_loop)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2] / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", script, str(path), json.dumps(constants), str(uid)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    uid_, out = json.loads(done.stdout.strip().splitlines()[-1])
    return int(uid_), out


def _images() -> np.ndarray:
    return np.random.default_rng(77).integers(0, 256, (N, H, W, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    "compiled_loop", ["0", pytest.param("1", marks=pytest.mark.long)], ids=["python producers", "compiled loop"]
)  # (the loop calls the same fused function: `make test-long`)
def test_two_normalisations_one_from_the_cache_each_with_its_own_constants(tmp_path: Path, compiled_loop: str) -> None:
    path = tmp_path / "images.stoker"
    images = _images()
    DatasetWriter(path, {"img": RGBImageField(), "label": IntField()}, num_workers=1, progress=False).from_indexed_dataset(
        [(images[i], i) for i in range(N)]
    )

    def run(constants: list[tuple[list[float], list[float]]], uid: int = 0) -> tuple[int, list[tuple[np.ndarray, np.ndarray]]]:
        uid_, out = _run(SCRIPT, path, tmp_path, compiled_loop, constants, uid)
        return uid_, [(np.asarray(x, dtype=np.float32), np.asarray(y)) for x, y in out]

    def check(got: tuple[np.ndarray, np.ndarray], mean: list[float], std: list[float], what: str) -> None:
        x, labels = got
        want = ((images[labels].astype(np.float32) - np.float32(mean)) / np.float32(std)).transpose(0, 3, 1, 2)
        np.testing.assert_allclose(x, want, rtol=0, atol=1e-5, err_msg=what)

    uid, (b_first,) = run([B])  # process 1: B compiled, cached
    check(b_first, *B, "B, compiled")
    assert uid > 0
    _, (a, b) = run([A, B], uid)  # process 2: A compiled here, its closure numbered as B's was; B from the cache
    check(a, *A, "A, compiled beside B's cached code")
    check(b, *B, "B from the cache, after A was compiled in the same process")


#: an operation that returns its closure compiled already (a dispatcher), with its constant inside: two of them of
#: other constants, one from the cache (as above, the coincidence of numbers made sure of)
SCRIPT_DISPATCHER = NUMBERING + textwrap.dedent(
    """
    import json, sys
    import numba
    import numpy as np
    from stoker.decoders import IntDecoder
    from stoker.loader import Loader, OrderOption
    from stoker.pipeline.allocation_query import AllocationQuery
    from stoker.pipeline.operation import Operation
    from stoker.transforms import ToTensor

    class AddConstant(Operation):
        def __init__(self, k):
            self.k = k

        def declare_state_and_memory(self, previous_state):
            return previous_state, AllocationQuery(previous_state.shape, previous_state.dtype)

        def generate_code(self):
            k = self.k

            def add_constant(batch, dst):
                for i in range(batch.shape[0]):
                    dst[i, 0] = batch[i, 0] + k
                return dst

            return numba.njit(nogil=True)(add_constant)

    path, constants, uid = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    if uid:
        number_first("add_constant", uid)
    out, first_uid = [], 0
    for k in constants:
        loader = Loader(path, batch_size=8, order=OrderOption.RANDOM, seed=0, num_workers=1,
                        pipelines={"label": [IntDecoder(), AddConstant(k), ToTensor()], "other": None})
        got = np.concatenate([y.numpy()[:, 0].copy() for (y,) in loader])
        order = np.concatenate([loader.epoch_indices(0)])
        added = loader.pipelines[0].fused.py_func.__globals__["op1"]  # (the fused function's call of the operation)
        first_uid = first_uid or max([o.fndesc.uid for o in added.overloads.values()] or [0])
        loader.close()
        out.append([got.tolist(), order.tolist()])
    print(json.dumps([first_uid, out]))
    """
)


@pytest.mark.parametrize("compiled_loop", ["0", pytest.param("1", marks=pytest.mark.long)], ids=["python producers", "compiled loop"])
def test_an_operations_own_compiled_closure_from_the_cache_keeps_its_constant(tmp_path: Path, compiled_loop: str) -> None:
    """Process 1 caches loader B's fused function, which calls the operation's own compiled closure (constant 1000);
    process 2 compiles loader A's (constant 7), its closure numbered as B's was, then loads B's from the cache: each
    adds its own constant (without the closure named by its fingerprint, B added A's)."""
    path = tmp_path / "ints.stoker"
    DatasetWriter(path, {"label": IntField(), "other": IntField()}, num_workers=1, progress=False).from_indexed_dataset(
        [(i, 0) for i in range(N)]
    )

    def run(constants: list[int], uid: int = 0) -> tuple[int, list[tuple[np.ndarray, np.ndarray]]]:
        uid_, out = _run(SCRIPT_DISPATCHER, path, tmp_path, compiled_loop, constants, uid)
        return uid_, [(np.asarray(got), np.asarray(order)) for got, order in out]

    uid, ((b_first, order),) = run([1000])
    np.testing.assert_array_equal(b_first, order + 1000, err_msg="B, compiled")
    assert uid > 0
    _, ((a, order_a), (b, order_b)) = run([7, 1000], uid)
    np.testing.assert_array_equal(a, order_a + 7, err_msg="A, compiled beside B's cached code")
    np.testing.assert_array_equal(b, order_b + 1000, err_msg="B from the cache, after A was compiled in the same process")
