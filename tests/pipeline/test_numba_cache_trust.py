"""Compiled code is loaded only from stoker's private cache folder, whatever ``NUMBA_CACHE_DIR`` says.

Numba reads a cached function's index with ``pickle`` and runs its machine code. With ``NUMBA_CACHE_DIR`` set,
Numba puts a function's cache at a name anyone can compute (``<folder>_<sha1 of the source folder>/<module>.<name>-
<line>.pyXY.nbi``); a folder there planted by another user (``nobody``) ran its pickle in the loader's process. Here
an index is planted, as ``nobody``, at every name Numba would read for stoker's kernels and for a loader's generated
functions; its unpickling makes a marker folder. A child process with its own environment then runs a loader and a
library kernel (the generated functions compiled there): the marker must never appear and nothing may be read or
written there. The next process still loads everything from stoker's own cache.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numba
import pytest
from numba.core.caching import UserProvidedCacheLocator

import stoker

SRC = str(Path(stoker.__file__).resolve().parents[1])  # the child imports the same stoker as this process
NOBODY = 65534

CHILD = textwrap.dedent(
    """
    import json, sys, warnings
    import numpy as np
    from stoker.loader import Loader, OrderOption
    from stoker.decoders import IntDecoder, NDArrayDecoder
    from stoker.pipeline import cache
    from stoker.pipeline.random import shuffle

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        v = np.arange(50, dtype=np.int64)
        shuffle(v, np.uint64(7))
        loader = Loader(sys.argv[1], batch_size=100, seed=3, order=OrderOption.RANDOM, num_workers=1,
                        pipelines={"x": [NDArrayDecoder()], "y": [IntDecoder()]})
        total = sum(float(x.sum()) + float(y.sum()) for x, y in loader)
        loader.close()

    def stats(d):
        return [sum(d.stats.cache_hits.values()), sum(d.stats.cache_misses.values()), d.stats.cache_path]

    print(json.dumps({
        "total": total,
        "order": v[:5].tolist(),
        "kernel": stats(shuffle),
        "generated": [stats(d) for d in cache._LOADED.values()],
        "warnings": [str(w.message) for w in caught if "cache" in type(w.message).__name__.lower()],
    }))
    """
)


def _run(table: Path, env: dict[str, str]) -> dict[str, Any]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_CACHE", "STOKER_CACHE"))}
    full.update(env, PYTHONPATH=SRC, STOKER_PREBUILT="0", STOKER_COMPILE_IN_BACKGROUND="0")
    done = subprocess.run([sys.executable, "-c", CHILD, str(table)], env=full, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


class _Payload:
    """Unpickled, makes the folder ``marker`` (and its parent): what a planted index could run in the victim's process."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.makedirs, (self.marker, 0o777, True))  # (exist_ok: every planted index that runs leaves it)


def _kernel_names() -> set[tuple[str, str]]:
    """``(subfolder, file name base)`` of every cached kernel of stoker's modules imported here, and of their serial twins."""
    names = set()
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("stoker.") or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, numba.core.dispatcher.Dispatcher) and value.py_func.__module__ == module_name:
                fn = value.py_func
                source = fn.__code__.co_filename
                quals = [fn.__qualname__] + ([f"{fn.__qualname__}_serial"] if value.targetoptions.get("parallel") else [])
                for qual in quals:
                    names.add((_subpath(source), _base(Path(source).stem, qual, fn.__code__.co_firstlineno)))
    return names


def _generated_names(fused: Path) -> set[tuple[str, str]]:
    """``(subfolder, file name base)`` of every function of the generated modules in ``fused``."""
    names = set()
    for path in fused.glob("fused_*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef):
                names.add((_subpath(str(path)), _base(path.stem, node.name, node.lineno)))
    return names


def _subpath(source: str) -> str:
    return str(UserProvidedCacheLocator.get_suitable_cache_subpath(source))


def _base(module: str, qualname: str, line: int) -> str:
    return f"{module}.{qualname}-{line}.py{sys.version_info[0]}{sys.version_info[1]}{getattr(sys, 'abiflags', '')}"


def _plant(shared: Path, names: set[tuple[str, str]], marker: Path) -> None:
    """An index at each name, in folders that belong to ``nobody`` (when this process may give them away)."""
    for sub, base in names:
        payload = pickle.dumps(_Payload(marker / f"{sub}--{base}"))
        folder = shared / sub
        folder.mkdir(mode=0o755, exist_ok=True)
        index = folder / f"{base}.nbi"
        index.write_bytes(payload)
        if os.geteuid() == 0:
            os.chown(index, NOBODY, NOBODY)
            os.chown(folder, NOBODY, NOBODY)


def _ran(marker: Path) -> list[str]:
    """The planted indices whose pickle ran (their file names)."""
    return sorted(p.name.split("--")[1] for p in marker.iterdir())


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


@pytest.mark.long  # two loader processes compiling generated code (about 15 s); the kernel's case below runs in make test
@pytest.mark.compiled_loop  # (its loaders run the generated producer loop, as users' processes do, whatever the suite sets)
def test_compiled_code_is_never_loaded_from_numba_cache_dir(table_path: Path, tmp_path: Path) -> None:
    # the modules of the kernels a loader calls: their cache names are planted
    import stoker.decoders
    import stoker.loader  # noqa: F401
    from stoker.format import _verify  # noqa: F401
    from stoker.pipeline import native, random  # noqa: F401

    # the victim's own cache root: this session's (private; the kernels the tests compiled so far are cached there,
    # the loader's generated functions are new to it)
    victim = Path(os.environ["STOKER_CACHE_DIR"])
    shared = tmp_path / "shared"  # NUMBA_CACHE_DIR, writable by everyone (a container's or a node's)
    shared.mkdir()
    shared.chmod(0o1777)
    marker = tmp_path / "marker"
    names = _kernel_names() | _generated_names(victim / "fused")
    assert any("random.shuffle-" in base for _, base in names)
    _plant(shared, names, marker)
    before = _listing(shared)
    env = {"STOKER_CACHE_DIR": str(victim), "NUMBA_CACHE_DIR": str(shared)}

    attacked = _run(table_path, env)
    assert not marker.exists(), f"indices planted in NUMBA_CACHE_DIR by another user were unpickled: {_ran(marker)}"
    assert _listing(shared) == before, "nothing may be read from or written to NUMBA_CACHE_DIR for stoker's code"
    paths = [attacked["kernel"][2]] + [g[2] for g in attacked["generated"]]
    assert attacked["generated"] and all(p and Path(p).is_relative_to(victim) for p in paths), paths
    for folder in {victim / "kernels", victim / "fused" / "__pycache__", *(Path(p) for p in paths)}:
        mode = folder.stat().st_mode
        assert stat.S_IMODE(mode) == 0o700 and folder.stat().st_uid == os.geteuid(), f"{folder}: {stat.filemode(mode)}"
    assert not attacked["warnings"], attacked["warnings"]

    # the generated functions it compiled, planted too; the next process loads them and the kernel from stoker's cache
    _plant(shared, _generated_names(victim / "fused"), marker)
    before = _listing(shared)
    again = _run(table_path, env)
    assert not marker.exists(), f"indices planted in NUMBA_CACHE_DIR were unpickled: {_ran(marker)}"
    assert _listing(shared) == before
    assert again["kernel"][0] >= 1 and again["kernel"][1] == 0, f"the kernel should load from the cache: {again['kernel']}"
    assert again["generated"] and all(g[0] >= 1 and g[1] == 0 for g in again["generated"]), again["generated"]
    assert again["total"] == attacked["total"] and again["order"] == attacked["order"]


CHILD_KERNEL = textwrap.dedent(
    """
    import json, sys, warnings
    import numpy as np
    from stoker.pipeline.random import shuffle

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        v = np.arange(50, dtype=np.int64)
        shuffle(v, np.uint64(7))
    print(json.dumps({"misses": sum(shuffle.stats.cache_misses.values()), "path": shuffle.stats.cache_path,
                      "warnings": [str(w.message) for w in caught if "cache" in type(w.message).__name__.lower()]}))
    """
)


def test_no_private_folder_means_no_disk_cache_and_one_warning(tmp_path: Path) -> None:
    from stoker.pipeline import random  # noqa: F401

    root = tmp_path / "open-root"  # stoker's cache root writable by others: no safe place for compiled code
    root.mkdir()
    root.chmod(0o777)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    marker = tmp_path / "marker"
    _plant(shared, _kernel_names(), marker)
    before = _listing(shared)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_CACHE", "STOKER_CACHE"))}
    env.update(STOKER_CACHE_DIR=str(root), NUMBA_CACHE_DIR=str(shared), PYTHONPATH=SRC, STOKER_PREBUILT="0")
    done = subprocess.run([sys.executable, "-c", CHILD_KERNEL], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])
    assert not marker.exists(), f"indices planted in NUMBA_CACHE_DIR were unpickled: {_ran(marker)}"
    assert _listing(shared) == before, "nothing may be read from or written to NUMBA_CACHE_DIR for stoker's code"
    assert run["misses"] == 1 and run["path"] == "", run
    assert len(run["warnings"]) == 1 and str(root) in run["warnings"][0], run["warnings"]
    assert list(root.rglob("*")) == [], "nothing is cached in a folder others can write"


def test_every_module_with_cached_kernels_registers_first() -> None:
    """A module of stoker that defines ``cache=True`` kernels calls ``_numba_cache.register()`` before the first one."""
    package = Path(SRC) / "stoker"
    checked = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        first = next(
            (
                node.lineno
                for node in tree.body
                if isinstance(node, ast.FunctionDef)
                and any(
                    isinstance(d, ast.Call) and any(k.arg == "cache" and getattr(k.value, "value", False) for k in d.keywords)
                    for d in node.decorator_list
                )
            ),
            None,
        )
        if first is None:
            continue
        registers = [
            node.lineno
            for node in tree.body
            if isinstance(node, ast.Expr) and ast.unparse(node.value) == "_numba_cache.register()" and node.lineno < first
        ]
        assert registers, f"{path.relative_to(package)}:{first}: a cache=True kernel before _numba_cache.register()"
        checked.append(path.name)
    assert len(checked) >= 20, checked


def test_a_shared_kernel_folder_is_checked_as_the_root_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``STOKER_CACHE_KERNELS_DIR`` (kernels shared by processes with caches of their own): a folder of the user's is
    made ``0700`` and used; one that others can write is refused with a CacheWarning naming it (no disk cache)."""
    import warnings

    from stoker import _cache_roots

    mine = tmp_path / "mine"
    monkeypatch.setenv(_cache_roots.KERNELS_ENV, str(mine))
    folder = _cache_roots.kernels_dir()
    assert folder is not None and folder.parent == mine.resolve() and folder.name == "kernels"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700

    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    monkeypatch.setenv(_cache_roots.KERNELS_ENV, str(open_to_all))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _cache_roots.kernels_dir() is None
    assert any(issubclass(w.category, _cache_roots.CacheWarning) and str(open_to_all) in str(w.message) for w in caught)
    assert not (open_to_all / "kernels").exists()
