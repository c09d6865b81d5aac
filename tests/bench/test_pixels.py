"""The image benchmarks' pixel checks accept what different decoders and resizers give and reject broken images."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.bench.loading import BenchCheckError
from stoker.bench.pixels import Tolerance, check_images, check_maybe_flipped, layout

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "images.py"
TOL = Tolerance(mean_abs=2.0, max_abs=16, border=2, edge_max_abs=64)


@pytest.fixture
def want() -> np.ndarray:
    """64 smooth NCHW uint8 images with grain, like the benchmark's."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:48, 0:40] / 48.0
    base = 127 + 80 * np.sin(3 * xx[None, None] + rng.uniform(0, 6, (64, 3, 1, 1))) * np.cos(2 * yy[None, None])
    return np.clip(base + rng.normal(0, 10, base.shape), 0, 255).astype(np.uint8)


def test_accepts_small_differences_and_edge_effects(want: np.ndarray) -> None:
    rng = np.random.default_rng(1)
    got = np.clip(want + rng.integers(-1, 2, want.shape), 0, 255).astype(np.uint8)
    got[:, :, 0, :] = np.clip(got[:, :, 0, :].astype(int) + 40, 0, 255)  # a resizer that treats the top row its own way
    stats = check_images(got, want, TOL, "ok")
    assert stats["mean_abs"] < 2.0 and stats["max_abs"] <= 1 and stats["edge_max_abs"] > 16


@pytest.mark.parametrize(
    "broken",
    [
        lambda w: w[:, ::-1],  # channels swapped (RGB <-> BGR)
        lambda w: np.roll(w, 1, axis=-1),  # shifted by a pixel
        lambda w: w[..., ::-1],  # flipped where no flip was asked for
        lambda w: np.where(np.arange(w.shape[-1]) == 20, 0, w),  # one corrupt column
        lambda w: np.zeros_like(w),
    ],
    ids=["channels", "shift", "flip", "column", "black"],
)
def test_rejects_wrong_images(want: np.ndarray, broken) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(BenchCheckError, match="differ from the expected"):
        check_images(np.ascontiguousarray(broken(want)), want, TOL, "broken")


def test_rejects_another_shape(want: np.ndarray) -> None:
    with pytest.raises(BenchCheckError, match="expected to be"):
        check_images(want.transpose(0, 2, 3, 1), want, TOL, "NHWC")


def test_flips_are_recognised_and_counted(want: np.ndarray) -> None:
    flip = np.random.default_rng(2).random(64) < 0.5
    got = np.where(flip[:, None, None, None], want[..., ::-1], want)
    stats = check_maybe_flipped(got, want, TOL, "flip")
    assert stats["flipped"] == flip.mean() and stats["max_abs"] == 0
    with pytest.raises(BenchCheckError, match="were flipped"):
        check_maybe_flipped(want, want, TOL, "never flips")
    with pytest.raises(BenchCheckError, match="differ from the expected"):
        check_maybe_flipped(np.roll(got, 1, axis=-1), want, TOL, "shifted")


def test_layout() -> None:
    x = torch.zeros(2, 5, 6, 3, dtype=torch.uint8)
    assert layout(x.permute(0, 3, 1, 2)) == "channels_last"
    assert layout(x.permute(0, 3, 1, 2).contiguous()) == "contiguous"
    assert layout(x.permute(0, 3, 2, 1)) == "strided"
    assert layout(np.zeros((2, 5, 6, 3)).transpose(0, 3, 1, 2)) == "channels_last"


@pytest.mark.long
@pytest.mark.slow
def test_images_benchmark_quick_b(tmp_path: Path) -> None:
    """Scenario B end to end at a small size: every system checked, same layout, one row each."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--only", "B", "--out", str(tmp_path)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "every loader's batches: (3, 32, 32) float32, contiguous (NCHW)" in proc.stdout
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    assert set(rows) >= {"stoker", "raw_gather_limit", "dataloader_w0", "dataloader_w2", "dataloader_best"}
    for name in ("stoker", "dataloader_w0", "dataloader_w2"):
        assert "| same |" in rows[name], rows[name]
