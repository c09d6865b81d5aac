"""docs/mixing.md's runnable example runs as written and prints what the page says (issue 33)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.misc.test_readme import python_blocks

DOC = Path(__file__).resolve().parents[2] / "docs" / "mixing.md"
BLOCKS = python_blocks(DOC.read_text(encoding="utf-8"))


def test_the_mixing_example_runs(tmp_path: Path) -> None:
    (code,) = BLOCKS
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.splitlines() == ["13", "39", "130", "[[0, [91, 39]], [1, [65, 65]]]"]
