"""The prebuilt kernels the repository ships (``src/stoker/_prebuilt``, package data): current, and stamped soundly.

The README's install (``pip install -e .``, or a wheel) brings them, so a new environment's first batch loads the
library's kernels instead of compiling them. An entry is used only if its stamp matches the sources its kernels can
depend on (:func:`stoker.pipeline.prebuilt.dependencies`); these tests check that the files in the tree are current
(else: ``make prebuilt``) and that the dependencies miss nothing a kernel refers to.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest

from stoker.pipeline import prebuilt

KERNEL_MODULES = sorted(p.name for p in prebuilt.PREBUILT_DIR.iterdir() if p.is_dir()) if prebuilt.PREBUILT_DIR.is_dir() else []


def _stamps(folder: Path) -> set[Any]:
    stamps = set()
    for index in folder.glob("*.nbi"):
        with index.open("rb") as f:
            version = pickle.load(f)
            stamp, _ = pickle.loads(f.read())
        assert version == numba.__version__, f"{index}: built with Numba {version}, installed {numba.__version__}"
        stamps.add(stamp)
    return stamps


def test_the_shipped_kernels_are_built_from_these_sources() -> None:
    """Every index in ``_prebuilt`` carries the stamp of today's sources (``make prebuilt`` after editing a kernel)."""
    assert prebuilt.PREBUILT_DIR.is_dir(), "src/stoker/_prebuilt is missing: run `make prebuilt`"
    assert {"stoker.image._resize", "stoker.pipeline.random", "stoker.transforms.flip"} <= set(KERNEL_MODULES)
    stale = [m for m in KERNEL_MODULES if _stamps(prebuilt.PREBUILT_DIR / m) != {prebuilt.source_stamp(m)}]
    assert not stale, f"prebuilt kernels older than their sources: {stale}; run `make prebuilt` and commit src/stoker/_prebuilt"


def _index_cpus(module: str) -> dict[str, set[tuple[str, str]]]:
    """Each kernel's file name base in the shipped module's folder -> the CPU keys of its entries."""
    cpus: dict[str, set[tuple[str, str]]] = {}
    for index in (prebuilt.PREBUILT_DIR / module).glob("*.nbi"):
        with index.open("rb") as f:
            pickle.load(f)
            _, entries = pickle.loads(f.read())
        cpus[index.stem] = {key[1][1:] for key in entries}
    return cpus


def test_the_shipped_kernels_are_generic_and_the_fast_modules_built_for_each_cpu_level_too() -> None:
    """Every shipped kernel has the generic CPU's entries; those of :data:`~stoker.pipeline.prebuilt.FAST_MODULES` (the
    shuffle) have each level's of :data:`~stoker.pipeline.prebuilt.FAST_CPUS` too (x86-64: AVX-512, AVX2), for each
    signature, and no other module does."""
    generic = (prebuilt.GENERIC_CPU, "")
    fast = {(cpu, "") for cpu, _ in prebuilt.FAST_CPUS}
    assert "stoker.pipeline.random" in prebuilt.FAST_MODULES
    for module in KERNEL_MODULES:
        for kernel, cpus in _index_cpus(module).items():
            expected = {generic} | (fast if module in prebuilt.FAST_MODULES else set())
            assert cpus == expected, (module, kernel, cpus)
    for module in prebuilt.FAST_MODULES:  # (the same signatures for every CPU)
        for index in (prebuilt.PREBUILT_DIR / module).glob("*.nbi"):
            with index.open("rb") as f:
                pickle.load(f)
                _, entries = pickle.loads(f.read())
            by_cpu: dict[tuple[str, str], set[str]] = {}
            for sig, magic, _ in entries:
                by_cpu.setdefault(magic[1:], set()).add(str(sig))
            assert len(set(map(frozenset, by_cpu.values()))) == 1, (index.name, by_cpu)


def test_a_cpu_loads_the_best_level_it_has_every_feature_of(monkeypatch: pytest.MonkeyPatch) -> None:
    """A level's code on a CPU that lacks one of its features would stop the process (``SIGILL``): a CPU looks up the
    entries of the best level of :data:`~stoker.pipeline.prebuilt.FAST_CPUS` whose every feature it has (whichever one
    it lacks of a better level), then the generic ones; the fast modules only."""
    if not prebuilt.FAST_CPUS:
        pytest.skip("no fast build on this architecture")
    (v4, v4_needs), (v3, v3_needs) = prebuilt.FAST_CPUS
    assert {"avx512f", "avx512dq", "avx2", "fma", "sse4.2"} <= set(v4_needs) and {"avx2", "fma", "sse4.2"} <= set(v3_needs)
    assert not {f for f in v4_needs if f.startswith("avx512")} & set(v3_needs) and set(v3_needs) < set(v4_needs)
    every = dict.fromkeys(v4_needs, True)
    assert prebuilt.fast_cpus(every) == [v4, v3]
    for missing in v4_needs:
        want = [v3] if missing not in v3_needs else []
        assert prebuilt.fast_cpus(every | {missing: False}) == want, missing
        assert prebuilt.fast_cpus({f: True for f in v4_needs if f != missing}) == want, missing

    class Codegen:
        def magic_tuple(self) -> tuple[str, str, str]:
            return ("x86_64-unknown-linux-gnu", "this-cpu", "+avx512f")

    def key(cpu: str) -> tuple[str, str, str]:
        return ("x86_64-unknown-linux-gnu", cpu, "")

    for host, want in (([], []), ([v4, v3], [v4]), ([v3], [v3])):
        monkeypatch.setitem(prebuilt._MEMO, "host fast cpus", host)
        assert prebuilt._magics("stoker.pipeline.random", Codegen()) == [*map(key, want), key(prebuilt.GENERIC_CPU)]
        assert prebuilt._magics("stoker.image._resize", Codegen()) == [key(prebuilt.GENERIC_CPU)]


FAST = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from stoker.pipeline import prebuilt
    from stoker.pipeline.random import order_steps, shuffle

    if sys.argv[1] != "as is":  # (told the CPU's levels: none, or AVX2's only)
        prebuilt._MEMO["host fast cpus"] = json.loads(sys.argv[1])
    if prebuilt.enabled():  # (STOKER_PREBUILT=0: compiled here)
        prebuilt.attach(shuffle)
        prebuilt.attach(order_steps)
    v = np.arange(300_000, dtype=np.int64)
    shuffle(v, np.uint64(7))
    w = np.empty_like(v)
    state = np.zeros(2 + 4096, dtype=np.int64)
    state[0] = len(w) - 1
    while order_steps(w, v, state, np.uint64(9), 1000):
        pass
    print(json.dumps({"cpus": prebuilt.hit_cpus, "fast": prebuilt.fast_cpus(), "v": v[::997].tolist(), "w": w[::997].tolist()}))
    """
)


def test_a_new_process_loads_the_shuffle_built_for_its_cpu(tmp_path: Path) -> None:
    """Empty caches: the shuffle loads from the shipped files, built for the best CPU level this CPU has (AVX-512 here),
    for AVX2 when told the CPU has that level only (if it has it), and the generic build when told it has none: the
    same order every time, and as a process with the shipped files off compiles it."""
    env = dict(os.environ, STOKER_HOST_KERNELS="0")
    for name in ("STOKER_CACHE_KERNELS_DIR", "STOKER_PREBUILT", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    here = prebuilt.fast_cpus()
    # (told levels, prebuilt files on or off, the build each kernel should come from; none: compiled there)
    cases = [("as is", "1", here[0] if here else prebuilt.GENERIC_CPU), ("[]", "1", prebuilt.GENERIC_CPU), ("as is", "0", None)]
    if "x86-64-v3" in here:  # (never told a level this CPU lacks: its code would stop the process)
        cases.append(('["x86-64-v3"]', "1", "x86-64-v3"))
    got = []
    for i, (told, shipped, want) in enumerate(cases):
        env.update(
            STOKER_CACHE_DIR=str(tmp_path / str(i) / "cache"), NUMBA_CACHE_DIR=str(tmp_path / str(i) / "numba"), STOKER_PREBUILT=shipped
        )
        proc = subprocess.run([sys.executable, "-c", FAST, told], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        assert got[-1]["cpus"] == ({"shuffle": want, "order_steps": want} if want else {}), (told, shipped)
    assert got[0]["fast"] == here
    assert all(case["v"] == got[-1]["v"] and case["w"] == got[-1]["w"] for case in got)


def _referred_modules(module: Any) -> set[str]:
    """The modules of stoker that a module's kernels refer to: what their globals and closures name."""
    found = set()
    for value in vars(module).values():
        if not isinstance(value, numba.core.dispatcher.Dispatcher):
            continue
        func = value.py_func
        names = set(func.__code__.co_names)
        for const in func.__code__.co_consts:  # (nested functions' names too)
            if hasattr(const, "co_names"):
                names |= set(const.co_names)
        refs = [func.__globals__[n] for n in names if n in func.__globals__]
        refs += [c.cell_contents for c in func.__closure__ or ()]
        for ref in refs:
            owner = getattr(getattr(ref, "py_func", ref), "__module__", None) or getattr(ref, "__name__", None)
            if isinstance(owner, str) and owner.startswith("stoker."):
                found.add(owner)
    return found


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_a_kernels_dependencies_hold_every_module_it_refers_to(name: str) -> None:
    module = sys.modules.get(name) or __import__(name, fromlist=["_"])
    deps = set(prebuilt.dependencies(name))
    missing = {m for m in _referred_modules(module) if m in sys.modules} - deps
    assert not missing, f"{name}'s kernels refer to {missing}, which its prebuilt stamp does not cover"


def test_an_edit_changes_the_stamps_of_the_modules_that_reach_it_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = tmp_path / "stoker"
    shutil.copytree(prebuilt._PACKAGE, tree, ignore=shutil.ignore_patterns("__pycache__", "_prebuilt"))
    monkeypatch.setattr(prebuilt, "_PACKAGE", tree)
    modules = ["stoker.image._resize", "stoker.transforms.flip", "stoker.pipeline.random", "stoker.loader._planner"]

    def stamps() -> dict[str, Any]:
        monkeypatch.setattr(prebuilt, "_STAMPS", {})
        monkeypatch.setattr(prebuilt, "_MEMO", {})
        return {m: prebuilt.source_stamp(m) for m in modules}

    before = stamps()
    for edited, changed in [
        ("loader/_engine.py", {"stoker.loader._planner"}),  # the Loader: not the kernels below it
        ("flow/_pipeline.py", set()),
        ("transforms/normalize.py", {"stoker.transforms.flip", "stoker.loader._planner"}),  # (flip's package imports it)
        ("pipeline/native.py", set(modules)),  # (Numba's extensions: every kernel)
    ]:
        path = tree / edited
        path.write_text(path.read_text() + "\n# an edit\n")
        after = stamps()
        assert {m for m in modules if after[m] != before[m]} == changed, edited
        before = after


# ---- a new environment (the README's install: empty caches, the shipped kernels) ------------------------------------

SRC = str(Path(__file__).parents[2] / "src")

NEW_ENVIRONMENT = textwrap.dedent(
    """
    import json, sys
    from numba.core import event
    from stoker.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from stoker.loader import Loader, OrderOption
    from stoker.pipeline import prebuilt
    from stoker.transforms import RandomHorizontalFlip, ToTensor

    compiled = []

    class Count(event.Listener):
        def on_start(self, ev):
            compiled.append(ev.data["dispatcher"].py_func.__qualname__)

        def on_end(self, ev):
            pass

    event.register("numba:compile", Count())
    pipelines = {"image": [RandomResizedCropRGBImageDecoder((32, 32)), RandomHorizontalFlip(), ToTensor()], "label": [IntDecoder(), ToTensor()]}
    with Loader(sys.argv[1], batch_size=8, num_workers=2, order=OrderOption.RANDOM, seed=5, pipelines=pipelines) as loader:
        batches = [[x.numpy().tolist(), y.numpy().tolist()] for x, y in loader]
    print(json.dumps({"batches": batches, "compiled": compiled, "hits": prebuilt.hits}))
    """
)


@pytest.mark.compiled_loop
def test_a_new_environment_runs_photos_on_the_shipped_kernels(tmp_path: Path) -> None:
    """Empty caches, the shipped kernels (compiled for the generic CPU, calling each other by symbol): the JPEG
    decoder's kernels load instead of compiling, and the epoch's batches equal this process's (kernels compiled here)."""
    from stoker.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from stoker.loader import Loader, OrderOption
    from stoker.transforms import RandomHorizontalFlip, ToTensor
    from tests.pipeline.test_parallel_kernels import _photos

    path = _photos(tmp_path)
    env = dict(os.environ, STOKER_CACHE_DIR=str(tmp_path / "cache"), NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    for name in ("STOKER_CACHE_KERNELS_DIR", "STOKER_PREBUILT", "STOKER_COMPILE_IN_BACKGROUND", "NUMBA_CPU_NAME"):
        env.pop(name, None)  # (as a new user's process: the suite's shared kernels folder and settings left out)
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", NEW_ENVIRONMENT, str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"decode_images", "_decode_one", "resize"} <= set(got["hits"]), got["hits"]
    assert not {"decode_images", "_decode_one", "resize", "decode_sample_code"} & set(got["compiled"]), got["compiled"]
    pipelines = {
        "image": [RandomResizedCropRGBImageDecoder((32, 32)), RandomHorizontalFlip(), ToTensor()],
        "label": [IntDecoder(), ToTensor()],
    }
    with Loader(path, batch_size=8, num_workers=2, order=OrderOption.RANDOM, seed=5, pipelines=pipelines) as loader:
        here = [[x.numpy().tolist(), y.numpy().tolist()] for x, y in loader]
    assert got["batches"] == here


FIRST = textwrap.dedent(
    """
    import json, time
    import numpy as np
    from stoker.pipeline import linking, prebuilt
    from stoker.pipeline.random import shuffle

    prebuilt.attach(shuffle)
    v = np.arange(50, dtype=np.int64)
    shuffle(v, np.uint64(7))
    (argtypes,) = list(shuffle.overloads)
    time.sleep(1.5)
    during = len(prebuilt.host_compiles)  # (nothing beside the process's work: at its exit)
    prebuilt._start_host_compile()  # (what the exit would run; the exit then finds nothing pending)
    code = prebuilt.host_compiles[0].wait(600)
    queued = [tuple(item[:3]) for item in prebuilt.host_compiled]
    _, linked = linking.link("stoker.pipeline.random", "shuffle", False, argtypes)
    print(json.dumps({"hits": prebuilt.hits, "queued": queued, "code": code, "order": v[:10].tolist(), "during": during,
                      "linked generic": id(linked) in prebuilt._GENERIC, "in memory generic": id(shuffle.overloads[argtypes]) in prebuilt._GENERIC}))
    """
)

NEXT = textwrap.dedent(
    """
    import json
    import numpy as np
    from stoker.pipeline import prebuilt
    from stoker.pipeline.random import shuffle

    prebuilt.attach(shuffle)
    v = np.arange(50, dtype=np.int64)
    shuffle(v, np.uint64(7))
    print(json.dumps({"hits": prebuilt.hits, "pending": len(prebuilt._PENDING), "order": v[:10].tolist(),
                      "cache hits": sum(shuffle.stats.cache_hits.values())}))
    """
)


def test_a_prebuilt_kernel_is_compiled_for_this_cpu_in_the_background(tmp_path: Path) -> None:
    """A process that loads a prebuilt kernel (the generic CPU's code) has it compiled for this CPU by a background
    process; code linked afterwards calls that one, and the next process loads it from its cache, not the prebuilt."""
    env = dict(os.environ, STOKER_CACHE_DIR=str(tmp_path / "cache"), NUMBA_CACHE_DIR=str(tmp_path / "numba"), STOKER_HOST_KERNELS="1")
    for name in ("STOKER_CACHE_KERNELS_DIR", "STOKER_PREBUILT", "NUMBA_CPU_NAME"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])

    def run(code: str) -> dict[str, Any]:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    first = run(FIRST)
    assert first["hits"] == ["shuffle"] and first["queued"] == [["stoker.pipeline.random", "shuffle", False]], first
    assert first["code"] == 0 and first["during"] == 0
    assert first["in memory generic"] and not first["linked generic"], "linked code calls this CPU's build once saved"
    second = run(NEXT)
    assert second["hits"] == [] and second["cache hits"] == 1 and second["pending"] == 0, second
    assert second["order"] == first["order"], "the two builds compute the same"


AT_EXIT = textwrap.dedent(
    """
    import json
    import numpy as np
    from stoker.pipeline import prebuilt
    from stoker.pipeline.random import shuffle

    prebuilt.attach(shuffle)
    shuffle(np.arange(50, dtype=np.int64), np.uint64(7))
    print(json.dumps({"hits": prebuilt.hits, "started": len(prebuilt.host_compiles)}))
    """
)


def test_the_compile_for_this_cpu_starts_when_the_process_exits(tmp_path: Path) -> None:
    """The process that loaded a prebuilt kernel starts the compile for this CPU at its exit (never beside its work):
    a later process finds the kernel compiled for this CPU in its cache."""
    env = dict(os.environ, STOKER_CACHE_DIR=str(tmp_path / "cache"), NUMBA_CACHE_DIR=str(tmp_path / "numba"), STOKER_HOST_KERNELS="1")
    for name in ("STOKER_CACHE_KERNELS_DIR", "STOKER_PREBUILT", "NUMBA_CPU_NAME"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", AT_EXIT], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"hits": ["shuffle"], "started": 0}
    deadline = time.monotonic() + 600
    while True:  # (the detached compile's result: a process that loads it instead of the prebuilt kernel)
        probe = subprocess.run(
            [sys.executable, "-c", NEXT], env=dict(env, STOKER_HOST_KERNELS="0"), capture_output=True, text=True, timeout=900
        )
        assert probe.returncode == 0, probe.stderr[-3000:]
        got = json.loads(probe.stdout.strip().splitlines()[-1])
        if got["hits"] == [] and got["cache hits"] == 1:
            break
        assert time.monotonic() < deadline, got
        time.sleep(1.0)


COMPILE_AHEAD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from stoker.fields import IntField, NDArrayField
    from stoker.loader import Loader
    from stoker.pipeline import prebuilt
    from stoker.writer import DatasetWriter

    path = sys.argv[1] + "/table.stoker"
    rows = [(np.full(3, i, dtype=np.float32), i) for i in range(40)]
    DatasetWriter(path, {"x": NDArrayField(np.dtype("float32"), (3,)), "y": IntField()}, num_workers=1, progress=False).from_indexed_dataset(rows)
    with Loader(path, batch_size=8, num_workers=1) as loader:
        loader.compile()
        after_compile = list(prebuilt.hits)
        batches = [[x.tolist(), y.tolist()] for x, y in loader]
    print(json.dumps({"after compile": after_compile, "hits": prebuilt.hits, "batches": batches}))
    """
)


def test_compiling_ahead_compiles_the_kernels_for_this_cpu(tmp_path: Path) -> None:
    """``Loader.compile()`` (and ``stoker warmup``) is asked for this machine's code: with empty caches it compiles the
    library's kernels rather than loading the prebuilt ones."""
    env = dict(os.environ, STOKER_CACHE_DIR=str(tmp_path / "cache"), NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    for name in ("STOKER_CACHE_KERNELS_DIR", "STOKER_PREBUILT", "NUMBA_CPU_NAME"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", COMPILE_AHEAD, str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["after compile"] == [], got["after compile"]
    assert [int(y) for batch in got["batches"] for y in np.ravel(batch[1])] == list(range(40))


def test_a_background_loop_is_taken_into_use_once_compiled_while_a_compile_for_this_cpu_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Plan.usable``: a loop whose background compilation ended is taken into use at once, even while the library's
    kernels are still being compiled for this CPU: it calls the generic CPU's code (photo crops: 0.94x this CPU's),
    where the Python producers it replaces ran at half the speed beside the compiles."""
    import types

    from stoker.loader._planner import Plan

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    monkeypatch.setattr(prebuilt, "_PENDING", [("stoker.pipeline.random", "shuffle", False, ())])
    monkeypatch.setattr(prebuilt, "host_compiles", [proc])
    plan = Plan(loop=object(), background=types.SimpleNamespace(done=lambda: True, error=None))  # type: ignore[arg-type]
    try:
        assert plan.usable(None) and plan.ready  # type: ignore[arg-type]
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(60)


PREBUILT_STATE = textwrap.dedent(
    """
    import json
    import numba
    import numpy as np
    from stoker.pipeline import _ahead, prebuilt, warm
    from stoker.pipeline.random import shuffle

    prebuilt.attach_all()  # (as a Loader does: nothing where STOKER_PREBUILT=0)
    argtypes = (numba.typeof(np.arange(50, dtype=np.int64)), numba.typeof(np.uint64(7)))
    before = warm.state(shuffle, argtypes)
    started = _ahead.start([_ahead.Call(shuffle, argtypes)])
    if started is not None:
        started.wait(600)
    shuffle(np.arange(50, dtype=np.int64), np.uint64(7))
    print(json.dumps({"before": before, "children": started is not None, "after": warm.state(shuffle, argtypes),
                      "hits": prebuilt.hits}))
    """
)


@pytest.mark.parametrize("shipped", [True, False])
def test_a_kernel_in_the_prebuilt_files_counts_as_cached_and_starts_no_compile_children(tmp_path: Path, shipped: bool) -> None:
    """Empty caches: a kernel the prebuilt files hold is ``cached`` to the first batch's compile children
    (:mod:`stoker.pipeline._ahead`), which are not started for it (every process forked two, busy the first 1.5 s
    of photo crops at half speed, until the kernels were compiled for this CPU); without the files it is missing."""
    env = dict(os.environ, STOKER_CACHE_DIR=str(tmp_path / "cache"), NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               STOKER_COMPILE_IN_BACKGROUND="1", STOKER_COMPILE_CHILDREN="1", STOKER_PREBUILT="1" if shipped else "0")  # fmt: skip
    for name in ("STOKER_CACHE_KERNELS_DIR", "NUMBA_CPU_NAME"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", PREBUILT_STATE], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if shipped:
        assert got == {"before": "cached", "children": False, "after": "ready", "hits": ["shuffle"]}, got
    else:
        assert got == {"before": "missing", "children": True, "after": "ready", "hits": []}, got
