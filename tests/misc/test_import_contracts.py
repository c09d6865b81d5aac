"""Layers point one way: the import contracts of ``pyproject.toml`` hold, and they catch a planted circle.

``make lint`` runs the same contracts (``lint-imports``); this test keeps the rule in the suite too, against the
stoker the tests import. See docs/ARCHITECTURE.md for the layers.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import stoker

pytest.importorskip("importlinter")
grimp = pytest.importorskip("grimp")

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
PACKAGE = Path(stoker.__file__).resolve().parent

#: FFCV's decoder path, the one compatibility module: ``stoker.fields.decoders`` re-exports the decoders for users
FACADES = ["stoker.fields.decoders"]

#: the one documented exception to the layers: FFCV's decoder names, handed out by the fields (docs/ARCHITECTURE.md)
FFCV_EXCEPTION = ("stoker.fields", "stoker.decoders")


def folder(module: str) -> str:
    """The package's folder (or top-level module) that ``module`` belongs to: ``stoker.format.reader`` -> ``stoker.format``."""
    return ".".join(module.split(".")[:2])


def folder_circles(graph: grimp.ImportGraph, exception: tuple[str, str] | None) -> list[list[str]]:
    """The circles between the package's folders (strongly connected groups of more than one), counting every import
    of ``graph``; ``exception`` (importer folder, imported folder) left out."""
    edges: dict[str, set[str]] = {}
    for importer in graph.modules:
        if importer == "stoker":
            continue  # the package root names its exports lazily (importlib): it imports no folder
        for imported in graph.find_modules_directly_imported_by(importer):
            a, b = folder(importer), folder(imported)
            if a != b and b != "stoker" and (a, b) != exception:
                edges.setdefault(a, set()).add(b)
    # Tarjan's strongly connected components, on a few dozen nodes
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(circles)


def lint_imports(src: Path, config: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package under ``src``, with ``config``'s contracts."""
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, str(config)], cwd=src, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.skipif(not PYPROJECT.exists(), reason="needs the source tree's pyproject.toml")
def test_the_import_contracts_hold() -> None:
    done = lint_imports(PACKAGE.parent, PYPROJECT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.skipif(not PYPROJECT.exists(), reason="needs the source tree's pyproject.toml")
@pytest.mark.parametrize(
    ("module", "planted"),
    [
        # the format reading a Loader name, inside a function: the circle the layers forbid
        ("format/reader.py", "def _planted() -> None:\n    from stoker.loader import Loader  # noqa: F401\n"),
        # the storage layer importing the datasets above it, at module level
        ("remote/_store.py", "from stoker.dataset import _manifest  # noqa: F401\n"),
        # the single file naming the datasets above it, for type hints only: still an import
        (
            "format/writer.py",
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from stoker.dataset import ShardedReader  # noqa: F401\n",
        ),
        # planning reaching up into the consumer loop: the Loader's split undone
        ("loader/_planner.py", "def _planted() -> None:\n    from stoker.loader._engine import CompiledEpoch  # noqa: F401\n"),
        # the consumer loop naming the Loader's class for a type hint: the parts read a LoaderView (loader/_view.py)
        (
            "loader/_engine.py",
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from stoker.loader.loader import Loader  # noqa: F401\n",
        ),
    ],
)
def test_a_planted_upward_import_breaks_the_contract(tmp_path: Path, module: str, planted: str) -> None:
    shutil.copytree(PACKAGE, tmp_path / "stoker", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "stoker" / module
    path.write_text(path.read_text() + "\n\n" + planted)
    shutil.copy(PYPROJECT, tmp_path / "pyproject.toml")
    done = lint_imports(tmp_path, tmp_path / "pyproject.toml")
    assert done.returncode != 0, done.stdout
    assert "BROKEN" in done.stdout
    importer = "stoker." + module.removesuffix(".py").replace("/", ".")
    assert importer in done.stdout, done.stdout


def test_no_stoker_module_imports_a_compatibility_path() -> None:
    """The compatibility module is for users only: stoker's own code imports the decoders from ``stoker.decoders``."""
    graph = grimp.build_graph("stoker", exclude_type_checking_imports=False)
    users = {facade: sorted(graph.find_modules_that_directly_import(facade)) for facade in FACADES}
    assert {f: u for f, u in users.items() if u} == {}


def test_no_circle_between_folders_counting_every_import() -> None:
    """Every import counts (module level, inside a function, under TYPE_CHECKING): the folders form no circle, but for
    the documented exception, FFCV's decoder names in ``fields``."""
    graph = grimp.build_graph("stoker", exclude_type_checking_imports=False)
    assert folder_circles(graph, FFCV_EXCEPTION) == []
    # the exception is real: without it, one circle through fields and decoders (fields -> decoders -> ... -> fields)
    (circle,) = folder_circles(graph, None)
    assert {"stoker.fields", "stoker.decoders"} <= set(circle)


@pytest.mark.skipif(not PYPROJECT.exists(), reason="needs the source tree's pyproject.toml")
def test_the_contract_ignores_ffcvs_decoder_names_only() -> None:
    """The layers contract's only exceptions are FFCV's: a field module naming a decoder; and it counts every import."""
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    assert not config.get("exclude_type_checking_imports", False)
    (layers,) = [c for c in config["contracts"] if c["id"] == "layers"]
    assert layers["ignore_imports"]
    for rule in layers["ignore_imports"]:
        importer, _, imported = rule.partition(" -> ")
        assert folder(importer) == FFCV_EXCEPTION[0] and folder(imported) == FFCV_EXCEPTION[1], rule


def test_nothing_under_the_loader_imports_the_loaders_module() -> None:
    """Counting every import (under TYPE_CHECKING too), only the package ``stoker.loader`` and the layers above it
    import ``stoker.loader.loader``: its parts read a ``LoaderView``; the loader contract ignores nothing."""
    graph = grimp.build_graph("stoker", exclude_type_checking_imports=False)
    importers = graph.find_modules_that_directly_import("stoker.loader.loader")
    assert importers  # (the package and the layers above it do)
    assert sorted(m for m in importers if m.startswith("stoker.loader.")) == []
    if PYPROJECT.exists():
        (contract,) = [c for c in tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"] if c["id"] == "loader"]
        assert not contract.get("ignore_imports")


def test_one_function_decides_every_cache_root() -> None:
    """Only ``stoker._cache_roots`` reads where caches go (``STOKER_CACHE_DIR``, ``XDG_CACHE_HOME``, ``~/.cache``)."""
    readers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_cache_roots.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value in ("STOKER_CACHE_DIR", "XDG_CACHE_HOME", "~/.cache", ".cache")
            ):
                readers.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert readers == []
