"""Fused pipelines are cached on disk: a second process loads instead of compiling."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

from stoker.pipeline.cache import fingerprint
from stoker.pipeline.compiler import Compiler
from stoker.transforms import RandomHorizontalFlip

from .._profile import long_run


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
    from stoker.decoders import NDArrayDecoder
    from stoker.transforms import ToTensor
    from tests.pipeline.test_pipelines import AddIndex, RandomNegate

    loader = Loader(sys.argv[1], batch_size=100, seed=3, order=OrderOption.RANDOM,
                    pipelines={"x": [NDArrayDecoder(), AddIndex(), RandomNegate(), ToTensor()], "y": None})
    total = sum(float(x.double().sum()) for (x,) in loader)
    plan = loader._plan  # the compiled producer loop, which calls the fused function, when it applies
    compiled = plan.loop if plan is not None and plan.loop is not None else loader.pipelines[0].fused
    hits = sum(compiled.stats.cache_hits.values())
    print(f"{total!r} {hits}")
    """
)


def test_second_process_loads_the_fused_function(table_path: Path, tmp_path: Path) -> None:
    env = dict(os.environ, STOKER_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(Path(__file__).parents[2]))
    # the subject is the fused function: under ``ci`` the children make their batches with Python producers calling it
    # (a cached producer loop in a new process: test_cache_reload_init.py); under ``long``, through the compiled loop
    env["STOKER_COMPILED_EPOCH"] = "1" if long_run() else "0"
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


# ---- what the fingerprint covers -----------------------------------------------------------


def _module(name: str, source: str, **names: object) -> types.ModuleType:
    """A module named ``name`` made from ``source``: two versions of one module differ only by their code."""
    module = types.ModuleType(name)
    module.__dict__.update(names)
    exec(compile(textwrap.dedent(source), f"<{name}>", "exec"), module.__dict__)
    return module


CALLS = """
import numba
import numpy as np

TABLE = np.array([{table}])


@numba.njit
def g(x):
    return x * {factor}


@numba.njit
def f(x):
    return g(x) + {add} + TABLE[0]


def op(batch, dst):
    for i in range(batch.shape[0]):
        dst[i] = f(batch[i])
    return dst
"""


def _key_of_op(add: int = 1, factor: int = 2, table: float = 0.0) -> str | None:
    user = _module("user_ops", CALLS.format(add=add, factor=factor, table=table))
    return fingerprint("src", [Compiler.compile(user.op)])


def test_called_compiled_functions_are_hashed_by_their_code_recursively() -> None:
    key = _key_of_op()
    assert key is not None and key == _key_of_op(), "the same code in new objects gives the same key"
    assert key != _key_of_op(add=3), "f, a compiled function the operation calls, changed"
    assert key != _key_of_op(factor=3), "g, called by f, changed"
    assert key != _key_of_op(table=1.0), "the constant array f reads changed"


def test_closures_defaults_and_module_attributes_are_followed() -> None:
    def key(body: str, source: str) -> str | None:
        lib = _module("lib", f"import numba\n@numba.njit\ndef f(x):\n    return {body}\n")
        user = _module("user_closures", source, lib=lib)
        return fingerprint("src", [user.make()])

    through_cell = "def make():\n    h = lib.f\n    def op(x):\n        return h(x)\n    return op\n"
    through_module = "def make():\n    def op(x):\n        return lib.f(x)\n    return op\n"
    through_default = "def make():\n    def op(x, h=lib.f):\n        return h(x)\n    return op\n"
    for source in (through_cell, through_module, through_default):
        assert key("x + 1", source) == key("x + 1", source) is not None
        assert key("x + 1", source) != key("x - 1", source), source

    def constant(scale: float) -> str | None:
        return key("x", f"def make():\n    def op(x, scale={scale}):\n        return x * scale\n    return op\n")

    assert constant(2.0) != constant(3.0), "a default value is compiled in as a constant"


INTRINSIC = """
from numba import types
from numba.extending import intrinsic


def make(offset):
    @intrinsic
    def combine(typingctx, a, b):
        sig = a(a, b)

        def codegen(context, builder, signature, args):
            return builder.{instruction}(builder.add(args[0], context.get_constant(a, offset)), args[1])

        return sig, codegen

    return combine
"""


def test_intrinsics_are_hashed_with_their_code_generation_and_closure() -> None:
    def key(instruction: str, offset: int) -> str | None:
        combine = _module("user_intrinsics", INTRINSIC.format(instruction=instruction)).make(offset)

        def op(batch, dst):  # type: ignore[no-untyped-def]
            dst[0] = combine(batch[0], batch[1])
            return dst

        return fingerprint("src", [op])

    assert key("add", 1) == key("add", 1) is not None
    assert key("add", 1) != key("sub", 1), "the code generation changed"
    assert key("add", 1) != key("add", 2), "a value the intrinsic's closure holds changed"


def test_overloaded_functions_are_hashed_by_their_implementation() -> None:
    def key(body: str) -> str | None:
        source = f"""
        from numba.extending import overload

        def stub(x):
            raise NotImplementedError

        @overload(stub)
        def _stub(x):
            def impl(x):
                return {body}
            return impl

        def op(x):
            return stub(x)
        """
        return fingerprint("src", [_module("user_overloads", source).op])

    assert key("x + 1") == key("x + 1") is not None
    assert key("x + 1") != key("x + 2")


def test_options_versions_and_numba_settings_are_in_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    import numba

    import stoker

    code = _code(RandomHorizontalFlip(0.5))
    key = fingerprint("src", [code])
    assert key is not None and key != fingerprint("src", [code], {"boundscheck": True})
    monkeypatch.setattr(numba.config, "BOUNDSCHECK", 1)
    assert fingerprint("src", [code]) != key, "NUMBA_BOUNDSCHECK changes machine code"
    monkeypatch.setattr(numba.config, "BOUNDSCHECK", None)
    monkeypatch.setattr(stoker, "__version__", "0.0.0+other")
    assert fingerprint("src", [code]) != key, "another stoker version may compile its kernels otherwise"


def test_what_cannot_be_fingerprinted_is_not_cached() -> None:
    import ctypes

    libc = ctypes.CDLL(None)
    for value in (np.array([object()]), libc.abs, {"a": 1}):
        user = _module("user_opaque", "def op(x):\n    return x + len(THING)\n", THING=value)
        assert fingerprint("src", [user.op]) is None, type(value)


def test_vectorized_functions_are_hashed_by_their_code() -> None:
    def key(body: str) -> str | None:
        source = f"import numba\n@numba.vectorize\ndef v(x):\n    return {body}\ndef op(x):\n    return v(x)\n"
        return fingerprint("src", [_module("user_ufuncs", source).op])

    assert key("x + 1") == key("x + 1") is not None
    assert key("x + 1") != key("x + 2")
