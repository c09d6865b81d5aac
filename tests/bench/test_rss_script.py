"""benchmarks/rss_vs_dataloader.py runs end to end on a small table and reports every system."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rss_vs_dataloader.py"


@pytest.mark.long
def test_rss_benchmark_runs_and_reports_every_system(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "5000", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-2000:]
    table = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    systems = [line.split("|")[1].strip() for line in table[1:]]
    assert systems == ["stoker os_cache=True", "stoker os_cache=False", "DataLoader"], out.stdout
    for line in table[1:]:
        peak = float(line.split("|")[4].strip().split()[0])
        assert peak > 0
