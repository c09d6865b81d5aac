"""``make bench`` installs ``.[bench]`` only: everything ``stoker bench`` imports comes with stoker or that extra."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the code `stoker bench` runs: its sub-command, the command line it is part of, and the bench package
BENCH_CODE = [ROOT / "src/stoker/cli", ROOT / "src/stoker/bench"]


def imported_top_level_modules(folders: list[Path]) -> dict[str, str]:
    """Top-level module names imported anywhere in the folders' Python files (lazy imports included) -> a file importing it."""
    found: dict[str, str] = {}
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text("utf-8"))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def test_the_bench_extra_covers_what_stoker_bench_imports() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    allowed = requirement_names(project["dependencies"] + project["optional-dependencies"]["bench"])
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for module, where in imported_top_level_modules(BENCH_CODE).items():
        if module in sys.stdlib_module_names or module == "stoker":
            continue
        dists = {d.lower().replace("_", "-") for d in providers.get(module, [])}
        if not dists & allowed:
            missing[module] = (where, sorted(dists))
    assert not missing, f"stoker bench imports modules that neither stoker's dependencies nor the bench extra install: {missing}"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_bench_installs_the_bench_extra_and_not_the_test_one(tmp_path: Path) -> None:
    """``make -n -B``: what a fresh machine runs, printed, not run."""
    dry = {
        target: subprocess.run(
            ["make", "-n", "-B", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        for target in ("bench", "test")
    }
    assert 'pip install -q -e ".[bench]"' in dry["bench"] and "[test" not in dry["bench"], dry["bench"]
    assert dry["bench"].index("torch==") < dry["bench"].index('".[bench]"')  # torch first, from TORCH_SPEC
    assert 'pip install -q -e ".[test,bench]"' in dry["test"], dry["test"]
