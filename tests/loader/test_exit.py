"""A process that ends, or gets Ctrl-C, while a JPEG epoch is in flight exits cleanly (no segfault).

The producer threads decode with libjpeg-turbo handles; at interpreter exit
they must be stopped and joined before anything they use goes away. Each
scenario runs in fresh processes, many times: the crash this guards against
was a race (5 crashes in 6 runs before the fix).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from stoker.fields import IntField, RGBImageField
from stoker.writer import DatasetWriter

from .._profile import examples

RUNS = examples(ci=2, long=6)  # fresh processes per scenario (the race crashed 5 runs in 6 before the fix)

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from stoker.loader import Loader, OrderOption
    from stoker.decoders import RandomResizedCropRGBImageDecoder, IntDecoder
    from stoker.transforms import RandomHorizontalFlip, ToTensor

    loader = Loader(sys.argv[1], batch_size=8, num_workers=2, order=OrderOption.RANDOM, seed=int(sys.argv[3]),
                    batches_ahead=8, pipelines={"image": [RandomResizedCropRGBImageDecoder((160, 160)),
                                                          RandomHorizontalFlip(), ToTensor()],
                                                "label": [IntDecoder(), ToTensor()]})
    it = iter(loader)
    x, y = next(it)
    assert x.shape == (8, 160, 160, 3)
    print("first batch", flush=True)
    if sys.argv[2] == "sigint":
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the producers decode ahead
        signal.pause()
    """
)


class _Photos:
    """~800x600 JPEG-sized images with texture, so that decoding takes real time."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        rng = np.random.default_rng(i)
        small = rng.integers(0, 256, (75, 100, 3), dtype=np.uint8)
        image = np.repeat(np.repeat(small, 8, axis=0), 8, axis=1)
        image = (image.astype(np.int16) + rng.integers(-20, 20, image.shape)).clip(0, 255).astype(np.uint8)
        return image, i


@pytest.fixture(scope="module")
def jpeg_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("exit") / "photos.stoker"
    fields = {"image": RGBImageField(write_mode="jpg", jpeg_quality=90), "label": IntField()}
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset(_Photos(96))
    return path


def _run(path: Path, mode: str, seed: int) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("PYTHONFAULTHANDLER", None)
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), mode, str(seed)], capture_output=True, text=True, timeout=120, env=env, check=False
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exit", "sigint"])
def test_exit_with_jpeg_epoch_in_flight_does_not_crash(jpeg_path: Path, mode: str) -> None:
    expected = 0 if mode == "exit" else -signal.SIGINT
    for run in range(RUNS):
        result = _run(jpeg_path, mode, run)
        assert "first batch" in result.stdout, result.stderr[-2000:]
        crashed = result.returncode in (-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS)
        assert not crashed, f"run {run}: killed by signal {-result.returncode}\n{result.stderr[-2000:]}"
        assert result.returncode == expected, f"run {run}: exit status {result.returncode}\n{result.stderr[-2000:]}"
        assert "Fatal Python error" not in result.stderr and "stack smashing" not in result.stderr, result.stderr[-2000:]
        if mode == "sigint":
            assert "KeyboardInterrupt" in result.stderr
