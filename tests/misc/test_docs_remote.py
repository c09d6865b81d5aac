"""docs/remote.md's runnable examples run as written (those marked ``# readme: skip`` need a store or several ranks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.misc.test_readme import python_blocks

DOC = Path(__file__).resolve().parents[2] / "docs" / "remote.md"
BLOCKS = python_blocks(DOC.read_text(encoding="utf-8"))


def test_the_elastic_resume_example_runs(tmp_path: Path) -> None:
    (code,) = [b for b in BLOCKS if "load_state_dict" in b]
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["3", "4", "[]", "10", "10", "0"]
