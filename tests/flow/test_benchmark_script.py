"""``benchmarks/flow.py`` runs end to end on a tiny configuration: checks, table, JSON and chart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "flow.py"


@pytest.mark.long
@pytest.mark.slow
def test_flow_benchmark_runs_and_writes_its_results(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the chart needs the bench extra")  # optional extra, not a stoker dependency
    args = ["--images", "12", "--per-run", "8", "--batch-size", "4", "--runs", "1", "--workers", "1", "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    payload = json.loads((tmp_path / "flow.json").read_text())
    assert set(payload["results"]) and all("torch" in systems for systems in payload["results"].values())
    assert "| configuration | system |" in (tmp_path / "flow.md").read_text()
    assert (tmp_path / "flow.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
