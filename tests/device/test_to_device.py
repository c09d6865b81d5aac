"""``to_device`` on nested structures of every supported kind (CPU and ``meta`` targets: no GPU needed)."""

from __future__ import annotations

import dataclasses
import types
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

import stoker
from stoker.device import to_device
from stoker.device._transfer import move
from stoker.device._tree import tree_map
from stoker.errors import StokerError


class Pair(NamedTuple):
    image: torch.Tensor
    label: Any


OldPair = namedtuple("OldPair", ["a", "b"])  # the collections form


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    names: list[str]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class Frozen:
    x: torch.Tensor
    n: int


@dataclasses.dataclass
class Derived:
    """``__post_init__`` computes a field: it must not run again (it would recompute ``total`` on the old device)."""

    x: torch.Tensor
    total: torch.Tensor = dataclasses.field(init=False)
    runs: int = dataclasses.field(default=0, init=False)

    def __post_init__(self) -> None:
        self.total = self.x.sum()
        self.runs += 1


class TaggedList(list):
    tag = "kept"


class TaggedDict(dict):
    def __init__(self, *args: Any, required: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.required = required


def _tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    tree_map(collect, tree)
    return found


def _every_kind() -> dict[str, Any]:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return {
        "tensor": t,
        "list": [torch.ones(2), "text", 3, None],
        "tuple": (torch.zeros(1, dtype=torch.int64), 2.5),
        "namedtuple": Pair(torch.full((2, 2), 7, dtype=torch.uint8), "cat"),
        "old_namedtuple": OldPair(torch.tensor(True), b"bytes"),
        "dataclass": Sample(torch.eye(2), ["a", "b"], {"w": torch.tensor([0.5])}),
        "frozen": Frozen(torch.tensor([1, 2]), 4),
        "ordered": OrderedDict([("z", torch.tensor(1)), ("a", torch.tensor(2))]),
        "default": defaultdict(list, {"k": torch.tensor([3.0])}),
        "return_types": torch.max(torch.tensor([[1.0, 5.0], [7.0, 2.0]]), dim=1),
        "numpy": np.arange(3),
        "size": torch.Size([2, 3]),
        "nested": [{"deep": (torch.tensor([9]), [torch.tensor([10])])}],
    }


def test_cpu_batch_to_cpu_is_returned_as_is() -> None:
    batch = _every_kind()
    moved = to_device(batch, "cpu")
    assert moved is batch
    assert to_device(batch["tensor"], torch.device("cpu")) is batch["tensor"]


def test_every_kind_moves_and_keeps_its_structure() -> None:
    batch = _every_kind()
    moved = to_device(batch, "meta")
    assert type(moved) is dict and list(moved) == list(batch)
    for old, new in zip(_tensors(batch), _tensors(moved), strict=True):
        assert new.device.type == "meta"
        assert new.shape == old.shape and new.dtype == old.dtype
    assert all(t.device.type == "cpu" for t in _tensors(batch)), "the input batch is not modified"
    # leaves that are not tensors are the same objects
    assert moved["list"][1:] == ["text", 3, None]
    assert moved["numpy"] is batch["numpy"], "numpy arrays are leaves: not converted"
    assert moved["size"] is batch["size"]
    assert moved["namedtuple"].label == "cat" and moved["old_namedtuple"].b == b"bytes"
    # container types
    assert type(moved["namedtuple"]) is Pair and type(moved["old_namedtuple"]) is OldPair
    assert type(moved["tuple"]) is tuple and moved["tuple"][1] == 2.5
    assert type(moved["return_types"]) is type(batch["return_types"])
    assert moved["return_types"].indices.device.type == "meta"
    assert type(moved["dataclass"]) is Sample and moved["dataclass"].names is batch["dataclass"].names
    assert moved["dataclass"].extra["w"].device.type == "meta"
    assert type(moved["frozen"]) is Frozen and moved["frozen"].n == 4
    assert type(moved["ordered"]) is OrderedDict and list(moved["ordered"]) == ["z", "a"]
    assert type(moved["default"]) is defaultdict and moved["default"].default_factory is list
    assert moved["nested"][0]["deep"][1][0].device.type == "meta"


def test_unchanged_containers_are_not_rebuilt() -> None:
    on_meta = torch.zeros(2, device="meta")
    batch = {"done": (on_meta, "x"), "todo": [torch.zeros(1)]}
    moved = to_device(batch, "meta")
    assert moved is not batch
    assert moved["done"] is batch["done"], "nothing moved inside: the same tuple"
    assert moved["todo"] is not batch["todo"]


def test_a_tensor_that_appears_twice_is_copied_once() -> None:
    t = torch.arange(4)
    moved, created = move({"a": t, "b": [t, t.clone()]}, "meta")
    assert moved["a"] is moved["b"][0]
    assert moved["b"][1] is not moved["a"]
    assert len(created) == 2, "one copy of t, one of its clone"


def test_dataclass_is_copied_not_reconstructed() -> None:
    d = Derived(torch.arange(3.0))
    moved = to_device(d, "meta")
    assert moved is not d and type(moved) is Derived
    assert moved.runs == 1, "__post_init__ did not run again"
    assert moved.x.device.type == "meta" and moved.total.device.type == "meta", "init=False fields move too"
    assert d.x.device.type == "cpu" and d.total.device.type == "cpu"


def test_subclasses_keep_their_type_and_attributes() -> None:
    items = TaggedList([torch.ones(1), 2])
    mapping = TaggedDict({"x": torch.ones(1)}, required="yes")
    moved_list, moved_map = to_device((items, mapping), "meta")
    assert type(moved_list) is TaggedList and moved_list[1] == 2 and moved_list[0].is_meta
    assert type(moved_map) is TaggedDict and moved_map.required == "yes" and moved_map["x"].is_meta


def test_read_only_mapping() -> None:
    proxy = types.MappingProxyType({"x": torch.ones(1), "y": 1})
    moved = to_device(proxy, "meta")
    assert isinstance(moved, types.MappingProxyType) and moved["x"].is_meta and moved["y"] == 1


def test_tensors_requiring_grad_stay_in_the_graph() -> None:
    w = torch.ones(3, requires_grad=True)
    moved = to_device({"w": w}, "meta")
    assert moved["w"].requires_grad and moved["w"].grad_fn is not None


def test_sets_and_strings_are_leaves() -> None:
    batch = {"s": "abc", "set": {1, 2}, "t": torch.ones(1)}
    moved = to_device(batch, "meta")
    assert moved["s"] is batch["s"] and moved["set"] is batch["set"]


def test_cycles_are_refused() -> None:
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    with pytest.raises(ValueError, match="contains itself"):
        to_device(loop, "meta")


def test_shared_containers_are_fine() -> None:
    shared = [torch.ones(1)]
    moved = to_device({"a": shared, "b": shared}, "meta")
    assert moved["a"][0] is moved["b"][0]


def test_move_reports_what_it_allocated() -> None:
    t = torch.ones(2)
    moved, created = move({"t": t, "n": 1}, "meta")
    assert created == [moved["t"]]
    assert move({"t": t}, "cpu")[1] == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(StokerError, match="CUDA is not available"):
        to_device({"x": torch.ones(1)}, "cuda")


def test_exported_from_stoker() -> None:
    assert stoker.to_device is to_device
    assert "to_device" in stoker.__all__ and "prefetch" in stoker.__all__
