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
from pathlib import Path

import pytest

import stoker

pytest.importorskip("importlinter")
grimp = pytest.importorskip("grimp")

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
PACKAGE = Path(stoker.__file__).resolve().parent

#: the compatibility modules: old (or FFCV's) paths that re-export a higher layer's names for users
FACADES = [
    "stoker.fields.decoders",
    "stoker.fields.rgb_image_decoders",
    "stoker.format.imagefolder",
    "stoker.format.mixed",
    "stoker.format.sharded",
    "stoker.format.shards",
    "stoker.integrations",
    "stoker.integrations.arrow",
    "stoker.integrations.ray",
    "stoker.pipeline.graph",
]


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
        # planning reaching up into the consumer loop: the Loader's split undone
        ("loader/_planner.py", "def _planted() -> None:\n    from stoker.loader._engine import CompiledEpoch  # noqa: F401\n"),
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
    """The compatibility modules are for users only: stoker's own code imports the new homes."""
    graph = grimp.build_graph("stoker")
    users = {facade: sorted(m for m in graph.find_modules_that_directly_import(facade) if m not in FACADES) for facade in FACADES}
    # the integrations package re-exports its two modules, its own compatibility path
    users["stoker.integrations.arrow"] = [m for m in users["stoker.integrations.arrow"] if m != "stoker.integrations"]
    users["stoker.integrations.ray"] = [m for m in users["stoker.integrations.ray"] if m != "stoker.integrations"]
    assert {f: u for f, u in users.items() if u} == {}


def test_the_loaders_parts_import_the_loader_for_type_hints_only() -> None:
    """The loader contract ignores ``stoker.loader.* -> stoker.loader.loader``: every such import is under TYPE_CHECKING."""
    found = []
    for path in sorted(p for p in (PACKAGE / "loader").glob("_*.py") if p.name != "__init__.py"):
        tree = ast.parse(path.read_text())
        hinted = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
            for node in ast.walk(block)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "stoker.loader.loader":
                found.append(path.name)
                assert id(node) in hinted, f"{path.name}:{node.lineno} imports stoker.loader.loader to run, not for type hints"
    assert found  # the check saw the parts' type-hint imports


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
