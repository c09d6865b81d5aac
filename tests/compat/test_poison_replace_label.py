"""Poison and ReplaceLabel: against numpy models of FFCV's formulas, and in a loader by dataset index."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from stoker.fields import IntField, RGBImageField
from stoker.fields.decoders import IntDecoder, SimpleRGBImageDecoder
from stoker.loader import Loader, OrderOption
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.state import State
from stoker.transforms import ToTensor
from stoker.transforms.poisoning import Poison
from stoker.transforms.replace_label import ReplaceLabel
from stoker.writer import DatasetWriter

N, H, W = 30, 9, 7
HWC = State(True, None, (H, W, 3), np.dtype(np.uint8), layout="HWC")
LABELS = State(True, None, (1,), np.dtype(np.int64))


def source_images() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (N, H, W, 3), dtype=np.uint8)


def mask_and_alpha() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(8)
    return rng.integers(0, 256, (H, W, 3)).astype(np.uint8), rng.uniform(0, 1, (H, W))


def poison_reference(
    images: np.ndarray, indices: np.ndarray, chosen: set[int], mask: np.ndarray, alpha: np.ndarray, clamp: tuple[int, int]
) -> np.ndarray:
    """FFCV's ``poison``: a float32 scratch image, ``*= 1 - alpha``, ``+= mask * alpha``, clipped, assigned back."""
    out = images.copy()
    alpha3 = np.repeat(alpha[:, :, None], 3, axis=2)
    blended = mask.astype("float") * alpha3
    for i, index in enumerate(indices):
        if int(index) in chosen:
            temp = images[i].astype(np.float32)
            temp *= 1 - alpha3
            temp += blended
            np.clip(temp, clamp[0], clamp[1], out=temp)
            out[i] = temp
    return out


@pytest.fixture(params=[True, False], ids=["compiled", "python"])
def compiled(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.mark.parametrize("clamp", [(0, 255), (40, 200)])
def test_poison_matches_numpy_model(compiled: bool, clamp: tuple[int, int]) -> None:
    mask, alpha = mask_and_alpha()
    chosen = [3, 17, 4, 29]
    op = Poison(mask, alpha, chosen, clamp=clamp)
    assert op.declare_state_and_memory(HWC) == (HWC, None)
    indices = np.array([29, 0, 3, 5, 17, 17, 8, 4])
    images = source_images()[indices]
    with Compiler.enabled(compiled):
        out = op.generate_code()(images.copy(), None, indices)
    np.testing.assert_array_equal(out, poison_reference(images, indices, set(chosen), mask, alpha, clamp))
    poisoned = np.isin(indices, chosen)
    assert (out[poisoned] != images[poisoned]).any(axis=(1, 2, 3)).all()
    np.testing.assert_array_equal(out[~poisoned], images[~poisoned])


@pytest.mark.parametrize(
    ("state", "match"),
    [
        (replace(HWC, shape=(H, W + 1, 3)), "layout of the mask"),
        (replace(HWC, dtype=np.dtype(np.float32)), "uint8 images"),
        (replace(HWC, shape=(3, H, W), layout="CHW"), "uint8 images"),
        (replace(HWC, jit_mode=False), "compiled operation on numpy batches"),
    ],
)
def test_poison_refuses_other_batches(state: State, match: str) -> None:
    mask, alpha = mask_and_alpha()
    with pytest.raises(ValueError, match=match):
        Poison(mask, alpha, [0]).declare_state_and_memory(state)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": np.ones((H, W + 1))}, "mask must be"),
        ({"mask": np.ones((H, W))}, "mask must be"),
        ({"indices": [[1, 2]]}, "1-d sequence"),
        ({"indices": [0.5]}, "1-d sequence"),
        ({"indices": [-1]}, ">= 0"),
        ({"clamp": (255, 0)}, "low <= high"),
    ],
)
def test_poison_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    mask, alpha = mask_and_alpha()
    args: dict[str, object] = {"mask": mask, "alpha": alpha, "indices": [0]} | kwargs
    with pytest.raises(ValueError, match=match):
        Poison(**args)  # type: ignore[arg-type]


def test_replace_label_changes_exactly_the_chosen_samples(compiled: bool) -> None:
    op = ReplaceLabel([9, 2, 5], new_label=7)
    assert op.declare_state_and_memory(LABELS) == (LABELS, None)
    indices = np.array([0, 2, 9, 9, 3, 5, 1])
    labels = (indices * 10)[:, None].astype(np.int64)
    with Compiler.enabled(compiled):
        out = op.generate_code()(labels.copy(), None, indices)
    expected = np.where(np.isin(indices, [9, 2, 5]), 7, indices * 10)[:, None]
    np.testing.assert_array_equal(out, expected)


def test_replace_label_bad_arguments() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        ReplaceLabel([-3], 1)
    with pytest.raises(ValueError, match="before ToTensor"):
        ReplaceLabel([1], 1).declare_state_and_memory(replace(LABELS, jit_mode=False))


def test_in_a_loader_the_chosen_dataset_indices_are_poisoned_and_relabelled(tmp_path: Path) -> None:
    images = source_images()
    path = tmp_path / "poison.stoker"
    fields = {"img": RGBImageField(), "label": IntField()}
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset([(images[i], i) for i in range(N)])
    mask, alpha = mask_and_alpha()
    chosen = [1, 11, 12, 28]
    pipelines = {
        "img": [SimpleRGBImageDecoder(), Poison(mask, alpha, chosen), ToTensor()],
        "label": [IntDecoder(), ReplaceLabel(chosen, new_label=-1), ToTensor()],
    }
    loader = Loader(path, batch_size=8, order=OrderOption.RANDOM, seed=3, num_workers=2, pipelines=pipelines)
    seen = 0
    for img, label in loader:
        for image, lab in zip(img.numpy(), label.numpy()[:, 0], strict=True):
            if lab == -1:
                # relabelled samples are the chosen ones: the image tells which (its poisoned version is unique)
                matches = [
                    i
                    for i in chosen
                    if np.array_equal(image, poison_reference(images[i : i + 1], np.array([i]), {i}, mask, alpha, (0, 255))[0])
                ]
                assert len(matches) == 1
                seen += 1
            else:
                np.testing.assert_array_equal(image, images[lab])
                assert lab not in chosen
    assert seen == len(chosen)
