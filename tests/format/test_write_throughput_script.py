"""benchmarks/write_throughput.py runs end to end at tiny sizes and prints its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "write_throughput.py"


@pytest.mark.long
def test_quick_run_prints_a_row_per_case(tmp_path: Path) -> None:
    cmd = [sys.executable, str(SCRIPT), "--quick", "--repeats", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].startswith("| dataset | method | workers |")
    cases = [tuple(cell.strip() for cell in row.split("|")[1:4]) for row in rows[1:]]
    assert cases == [
        ("otto", "from_indexed_dataset", "1"),
        ("otto", "from_indexed_dataset", "2"),
        ("otto", "from_arrays", "-"),
        ("images-raw", "from_indexed_dataset", "1"),
        ("images-raw", "from_indexed_dataset", "2"),
        ("images-jpg", "from_indexed_dataset", "1"),
        ("images-jpg", "from_indexed_dataset", "2"),
    ]
    assert list(tmp_path.iterdir()) == []  # its temporary files are gone
