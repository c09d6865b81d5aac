"""Seed 002's ``exp_spdl`` (SPDL's multi_thread_preprocessing) runs with the imports changed, over generated JPEGs."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "spdl_multi_thread.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("spdl_multi_thread_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def folder(example: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> str:
    return example.make_image_folder(str(tmp_path_factory.mktemp("jpegs")), 24)


def test_the_generated_images_look_like_photos(folder: str) -> None:
    from PIL import Image

    paths = sorted(Path(folder).rglob("*.JPEG"))
    assert len(paths) == 24
    with Image.open(paths[1]) as img:
        assert img.size == (500, 375) and img.format == "JPEG"
    assert np.mean([p.stat().st_size for p in paths]) > 30_000  # textured like a photograph, not flat


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [({"batch_size": None}, 10), ({"batch_size": 8}, 24), ({"batch_size": 8, "normalize": True}, 24)],
    ids=["decode+resize", "+batch", "+normalize"],
)
def test_exp_spdl_runs_unchanged(example: ModuleType, folder: str, kwargs: dict, expected: int) -> None:
    num_items, elapsed = example.exp_spdl(root_dir=folder, split="val", num_workers=2, max_items=10, **kwargs)
    assert num_items == expected and elapsed > 0


def test_exp_spdl_yields_what_the_dataloader_yields(example: ModuleType, folder: str) -> None:
    """Same shapes and dtypes as the torch baseline (exp_torch's transforms, run here without worker processes)."""
    dataset = example.ImageNet(root=folder, split="val", transform=example.Compose([example.Resize((224, 224)), example.PILToTensor()]))
    want, label = dataset[3]
    filter_desc = example.stoker.io.get_video_filter_desc(scale_width=224, scale_height=224)
    got = torch.from_numpy(example.stoker.io.decode_packets(example.stoker.io.demux_image(dataset.samples[3][0]), filter_desc)).permute(
        2, 0, 1
    )
    assert got.shape == want.shape == (3, 224, 224) and got.dtype == want.dtype == torch.uint8
    assert (got.float() - want.float()).abs().mean() < 3.0 and label == dataset.samples[3][1]
