"""The examples run as a user runs them, and PickACorner does what the guide says."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from stoker.loader import Loader, OrderOption

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})}
    )
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.long
@pytest.mark.slow
def test_pick_a_corner_example_prints_both_shapes(tmp_path: Path) -> None:
    out = run_example("pick_a_corner.py", "--samples", "2048", "--epochs", "1", "--num-workers", "2", "--out", str(tmp_path))
    with_ = re.search(r"Method: with \| Shape: torch\.Size\(\[(.*?)\]\) \| Time per epoch: ([0-9.]+)s", out)
    without = re.search(r"Method: without \| Shape: torch\.Size\(\[(.*?)\]\) \| Time per epoch: ([0-9.]+)s", out)
    assert with_ is not None and without is not None, out
    assert with_.group(1) == "512, 16, 16, 3"
    assert without.group(1) == "512, 32, 32, 3"


@pytest.mark.long
@pytest.mark.slow
def test_otto_example_trains(tmp_path: Path) -> None:
    out = run_example("otto_mlp.py", env={"OTTO_EPOCHS": "1", "OTTO_SAMPLES": "16384", "OTTO_OUT": str(tmp_path)})
    assert "stoker: batch x (1024, 93) torch.float32, y (1024,) torch.int64" in out, out
    assert "torch: batch x (1024, 93) torch.float32, y (1024,) torch.int64" in out, out
    for name in ("STOKER", "TORCH", "UPLIFT (%)"):
        assert re.search(rf"^\s*{re.escape(name)}(\s+-?[0-9.]+){{3}}\s*$", out, re.MULTILINE), out
    loss = re.search(r"final loss: (\S+)", out)
    assert loss is not None, out
    assert math.isfinite(float(loss.group(1)))


@pytest.mark.parametrize("samples", [pytest.param(100, marks=pytest.mark.long), 1])  # (TEST_SPLIT.md)
def test_otto_example_runs_on_a_small_table(tmp_path: Path, samples: int) -> None:
    """A table smaller than one batch: one batch of every row per epoch, timed without warm-up batches."""
    out = run_example("otto_mlp.py", "--samples", str(samples), "--epochs", "2", "--out", str(tmp_path))
    for name in ("stoker", "torch"):
        assert f"{name}: batch x ({samples}, 93) torch.float32, y ({samples},) torch.int64" in out, out
    for name in ("STOKER", "TORCH", "UPLIFT (%)"):
        assert re.search(rf"^\s*{re.escape(name)}(\s+-?[0-9.]+){{3}}\s*$", out, re.MULTILINE), out
    loss = re.search(r"final loss: (\S+)", out)
    assert loss is not None and math.isfinite(float(loss.group(1))), out


@pytest.mark.parametrize("compile", [pytest.param(True, marks=pytest.mark.long), False], ids=["jit", "python"])  # (TEST_SPLIT.md)
def test_pick_a_corner_returns_a_quadrant(tmp_path: Path, compile: bool) -> None:
    example = load_example("pick_a_corner")
    from stoker.decoders import IntDecoder, SimpleRGBImageDecoder
    from stoker.transforms import ToTensor

    path = str(tmp_path / "cifar.stoker")
    ds = example.write_random_cifar(path, 300, seed=3)
    loader = Loader(
        path,
        batch_size=64,
        num_workers=2,
        order=OrderOption.SEQUENTIAL,
        compile=compile,
        pipelines={
            "image": [SimpleRGBImageDecoder(), example.PickACorner(), ToTensor()],
            "label": [IntDecoder(), ToTensor()],
        },
    )
    seen = {"top-left": 0, "bottom-right": 0}
    start = 0
    for images, labels in loader:
        images, labels = images.numpy(), labels.numpy().reshape(-1)
        assert images.shape[1:] == (16, 16, 3) and images.dtype == np.uint8
        for i, out in enumerate(images):
            source = ds.images[start + i]
            assert labels[i] == ds.labels[start + i]
            if np.array_equal(out, source[:16, :16]):
                seen["top-left"] += 1
            elif np.array_equal(out, source[16:, 16:]):
                seen["bottom-right"] += 1
            else:
                pytest.fail(f"sample {start + i}: the output is neither the top-left nor the bottom-right quadrant")
        start += len(images)
    assert start == 300
    # one in four top-left: 300 draws all on one side has probability < 1e-37
    assert seen["top-left"] > 0 and seen["bottom-right"] > seen["top-left"], seen
