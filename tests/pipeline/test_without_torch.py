"""A pipeline of numpy batches made of stoker's operations never imports torch; other libraries' operations see
FFCV's first state (``torch.device('cpu')``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.fields import IntField, NDArrayField, RGBImageField
from stoker.format import DatasetWriter
from stoker.loader import Loader
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State

SCRIPT = r"""
import sys

import numpy as np

from stoker.decoders import IntDecoder, NDArrayDecoder, SimpleRGBImageDecoder
from stoker.loader import Loader
from stoker.transforms import RandomHorizontalFlip

path, kind = sys.argv[1], sys.argv[2]
if kind == "numpy":
    pipelines = {"x": [NDArrayDecoder()], "y": [IntDecoder()], "image": [SimpleRGBImageDecoder(), RandomHorizontalFlip()]}
else:
    pipelines = None  # the defaults end with ToTensor
total = 0
for x, y, image in Loader(path, batch_size=8, num_workers=2, pipelines=pipelines, seed=0):
    total += int(np.asarray(y).sum())
print(type(x).__module__.split(".")[0], total, "torch" in sys.modules)
"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("notorch") / "d.stoker"
    rng = np.random.default_rng(0)
    samples = [(rng.random(5).astype(np.float32), i, rng.integers(0, 256, (6, 7, 3), dtype=np.uint8)) for i in range(40)]
    fields = {"x": NDArrayField(np.dtype("float32"), (5,)), "y": IntField(), "image": RGBImageField(write_mode="raw")}
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset(samples)
    return path


@pytest.mark.parametrize(("kind", "expected"), [("numpy", "numpy 780 False"), ("default", "torch 780 True")])
def test_numpy_pipelines_do_not_import_torch(dataset: Path, kind: str, expected: str) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(dataset), kind], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected


class Seen(Operation):
    """Another library's operation: records the state it is given."""

    seen: ClassVar[list[Any]] = []

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        Seen.seen.append(previous_state.device)
        return previous_state, None

    def generate_code(self) -> Any:
        def same(batch: Any, dst: Any) -> Any:
            return batch

        return same


Seen.__module__ = "otherlib.ops"  # what matters is that it is not stoker's


def test_other_libraries_see_ffcvs_first_device(dataset: Path) -> None:
    """FFCV's first state is on torch.device('cpu'); an operation from elsewhere may read it (``.type``)."""
    Seen.seen.clear()
    loader = Loader(dataset, batch_size=8, pipelines={"x": [NDArrayDecoder(), Seen()], "y": [IntDecoder()], "image": None})
    loader.close()
    assert Seen.seen == [torch.device("cpu")]
