"""Identical pipelines share their compiled code: one dispatcher per process per fingerprint, whatever the number of fields."""

from __future__ import annotations

import collections
import ctypes
import sys
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest

from stoker.decoders import FloatDecoder, IntDecoder
from stoker.decoders.arrays import _decode_rows
from stoker.fields import FloatField, IntField
from stoker.format import Reader
from stoker.loader._graph import FieldPipeline, build_pipeline
from stoker.pipeline import cache
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State
from stoker.writer import DatasetWriter

INTS, FLOATS, ROWS = 20, 2, 64


class AddConstant(Operation):
    """x + constant into new memory: its code is a new closure for every instance, as most operations' is."""

    def __init__(self, constant: int) -> None:
        self.constant = constant

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        return previous_state, AllocationQuery(previous_state.shape, previous_state.dtype)

    def generate_code(self):  # type: ignore[no-untyped-def]
        constant = self.constant

        def add_constant(batch, dst):  # type: ignore[no-untyped-def]
            for i in range(batch.shape[0]):
                dst[i] = batch[i] + constant
            return dst

        return add_constant


class AddAbs(Operation):
    """x + labs(-2), labs called through ctypes: code that cannot be fingerprinted."""

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        return previous_state, AllocationQuery(previous_state.shape, previous_state.dtype)

    def generate_code(self):  # type: ignore[no-untyped-def]
        labs = ctypes.CDLL(None).labs
        labs.argtypes, labs.restype = [ctypes.c_long], ctypes.c_long

        def add_abs(batch, dst):  # type: ignore[no-untyped-def]
            for i in range(batch.shape[0]):
                dst[i] = batch[i] + labs(-2)
            return dst

        return add_abs


@pytest.fixture(scope="module")
def scalars_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A table of INTS int fields i0.. and FLOATS float fields f0..; i_k[r] = r + k."""
    path = tmp_path_factory.mktemp("shared") / "scalars.stoker"
    fields: dict[str, Any] = {f"i{k}": IntField() for k in range(INTS)}
    fields.update({f"f{k}": FloatField() for k in range(FLOATS)})
    arrays: dict[str, Any] = {f"i{k}": np.arange(ROWS) + k for k in range(INTS)}
    arrays.update({f"f{k}": np.arange(ROWS, dtype=np.float64) / (k + 1) for k in range(FLOATS)})
    DatasetWriter(path, fields, num_workers=0, progress=False).from_arrays(arrays)
    return path


def _build(path: Path, names: list[str], constant: int = 1) -> list[FieldPipeline]:
    reader = Reader(path)
    pipelines = []
    for position, name in enumerate(names):
        decoder = IntDecoder() if name.startswith("i") else FloatDecoder()
        pipelines.append(build_pipeline(name, reader.fields[name], [decoder, AddConstant(constant)], reader, position))
    return pipelines


def _dispatchers(pipelines: list[FieldPipeline]) -> set[int]:
    """The distinct compiled functions of ``pipelines``: every step's and the functions that run them (fused, serial)."""
    found: dict[int, Any] = {}
    for p in pipelines:
        for fn in [*(s.code for s in p.steps), p.compiled_code(), p.compiled_code(serial=True)]:
            assert isinstance(fn, numba.core.dispatcher.Dispatcher)
            found[id(fn)] = fn
    return set(found)


def _run(p: FieldPipeline) -> np.ndarray:
    p.allocate(1, 8, pinned=False)
    indices = np.arange(8, dtype=np.int64)
    seconds: dict[str, float] = collections.defaultdict(float)
    return np.asarray(p.run(indices, indices, 0, lambda salt, positions: np.zeros(len(positions), np.uint64), seconds))


def test_two_builds_over_one_file_share_their_compiled_code(scalars_path: Path) -> None:
    (first,), (second,) = _build(scalars_path, ["i3"]), _build(scalars_path, ["i3"])
    assert first.fused is not None
    assert first.compiled_code() is second.compiled_code()
    assert first.compiled_code(serial=True) is second.compiled_code(serial=True)
    assert [s.code for s in first.steps] == [s.code for s in second.steps]
    np.testing.assert_array_equal(_run(second)[:, 0], np.arange(8) + 3 + 1)


def test_fifty_builds_load_no_new_code(scalars_path: Path) -> None:
    kept = _build(scalars_path, ["i0"], constant=7)  # (kept alive: the ids below stay unique)
    _run(kept[0])
    first = _dispatchers(kept)
    loaded = len(cache._LOADED)
    fused = kept[0].compiled_code()
    modules = len(sys.modules)
    for _ in range(50):
        kept += _build(scalars_path, ["i0"], constant=7)
    assert _dispatchers(kept) == first and len(first) == 4  # decoder, operation, fused, fused serial
    assert len(cache._LOADED) == loaded, "the same fingerprint loaded again"
    assert len(sys.modules) == modules
    _run(kept[-1])
    assert len(fused.signatures) == 1, "compiled once"


def test_compile_work_does_not_grow_with_fields(scalars_path: Path) -> None:
    few = _build(scalars_path, ["i0", "i1"], constant=5)
    many = _build(scalars_path, [f"i{k}" for k in range(INTS)], constant=5)
    assert len(_dispatchers(few)) == len(_dispatchers(many)) == 4
    for p in few:
        _run(p)
    compiled = {id(p.compiled_code()): p.compiled_code() for p in few}
    before = sum(len(fn.signatures) for fn in compiled.values())
    for k, p in enumerate(many):
        np.testing.assert_array_equal(_run(p)[:, 0], np.arange(8) + k + 5)
    assert {id(p.compiled_code()) for p in many} == set(compiled)
    assert sum(len(fn.signatures) for fn in compiled.values()) == before == 1


def test_fields_of_other_types_share_the_code_with_its_own_signature(scalars_path: Path) -> None:
    pipelines = _build(scalars_path, ["i0", "f0", "i1", "f1"], constant=2)
    assert len({id(p.compiled_code()) for p in pipelines}) == 1
    np.testing.assert_array_equal(_run(pipelines[0])[:, 0], np.arange(8) + 2)
    np.testing.assert_allclose(_run(pipelines[1])[:, 0], np.arange(8) / 1 + 2)
    np.testing.assert_allclose(_run(pipelines[3])[:, 0], np.arange(8) / 2 + 2)
    assert len(pipelines[0].compiled_code().signatures) == 2  # (int64 and float64 arrays)


def test_compile_returns_one_dispatcher_per_fingerprint() -> None:
    one, same, other = (AddConstant(c).generate_code() for c in (1, 1, 2))
    assert Compiler.compile(one) is Compiler.compile(same)
    assert Compiler.compile(one) is not Compiler.compile(other), "another constant is other code"
    assert Compiler.compile(one, parallel=True) is not Compiler.compile(one), "other options are other code"
    with Compiler.debug():
        checked = Compiler.compile(one)
        assert checked is Compiler.compile(same)
    assert checked is not Compiler.compile(one), "debug mode compiles bounds-checked code"
    a, b = numba.njit(AddConstant(3).generate_code()), numba.njit(AddConstant(3).generate_code())
    shared = Compiler.compile(a)
    assert shared is Compiler.compile(b), "an operation's compiled closure stands for the identical ones compiled after it"
    assert shared is not a and shared.py_func.__code__ is a.py_func.__code__, "compiled again from its Python function"
    assert shared.py_func.__qualname__.startswith(a.py_func.__qualname__ + "__"), "named by its fingerprint (_named_by)"
    assert Compiler.compile(_decode_rows) is _decode_rows, "a module's kernel is itself (prebuilt code calls it by name)"
    with Compiler.disabled():
        assert not isinstance(Compiler.compile(one), numba.core.dispatcher.Dispatcher)


def test_load_cached_loads_each_fingerprint_once() -> None:
    source = "def twice(x):\n    return 2 * x\n"
    first = cache.load_cached(source, {}, "twice")
    assert first is not None and cache.load_cached(source, {}, "twice") is first
    assert cache.load_cached(source, {}, "twice", {"nogil": True, "boundscheck": True}) is not first
    assert first(21) == 42


def test_code_that_cannot_be_fingerprinted_is_compiled_as_before(scalars_path: Path) -> None:
    reader = Reader(scalars_path)
    pipelines = [build_pipeline(f"i{k}", reader.fields[f"i{k}"], [IntDecoder(), AddAbs()], reader, k) for k in range(2)]
    assert pipelines[0].compiled_code() is not pipelines[1].compiled_code()
    np.testing.assert_array_equal(_run(pipelines[1])[:, 0], np.arange(8) + 1 + 2)
