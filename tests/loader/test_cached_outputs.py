"""Outputs made once per slot (issue 45, step 1): a tail of views runs once per batch slot, its tensor handed out again.

A field whose tail is all :attr:`~stoker.pipeline.operation.Operation.view_only` steps
(``ToTensor``, ``Squeeze``, ``View``) gives the same tensor, over the same memory, for every
full batch made into a slot (``FieldPipeline.keep_tail``); the fast hand-over hands that tensor
out again while nothing outside the loader holds it or any view of it
(``FieldPipeline.slot_in_use``). Checked here against a numpy model of the epoch
(``loader.epoch_indices``), for every way a user keeps a batch or changes it in place:

* the cache is used (the same tensor object for the same slot, nothing run for the tail);
* a batch kept in any form (the tuple or dict, the tensor, a slice, ``view``, ``unsqueeze``,
  ``.numpy()``, ``np.asarray``, its storage, a dict or list of them) is never overwritten while
  many more batches than slots are made, and every batch handed out is the model's, with its
  shape and dtype, without ``requires_grad``, whatever was done to an earlier one
  (``unsqueeze_``, ``requires_grad_()``, then dropped);
* a step that says it makes a view but copies is not cached (its batches stay right).
"""

from __future__ import annotations

import collections
import os
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from stoker.decoders import IntDecoder
from stoker.fields import IntField
from stoker.loader import Loader, OrderOption
from stoker.loader._ring import DONE
from stoker.observe._recorder import ROWS
from stoker.pipeline import native
from stoker.pipeline.operation import Operation
from stoker.transforms import Convert, NormalizeImage, Squeeze, ToDevice, ToTensor, ToTorchImage, View
from stoker.transforms.module import ModuleWrapper
from stoker.writer import DatasetWriter

from .._profile import examples
from .test_handover import _until

pytestmark = [pytest.mark.skipif(not native.available(), reason="the compiled producer loop needs Linux"), pytest.mark.compiled_loop]

N = 300
#: the producers as set in every epoch (no run-time tuning down to the loop making every batch: the fast path is the
#: subject here)
AS_SET = {"STOKER_TUNING": "0"}
TAILS = {"default": [ToTensor()], "squeeze": [ToTensor(), Squeeze()], "float": [ToTensor(), Squeeze(), View(np.float64)]}
FORMS = ["none", "batch", "tensor", "slice", "view", "unsqueeze", "numpy", "asarray", "storage", "dict", "list",
         "unsqueeze_", "unsqueeze_kept", "requires_grad_"]  # fmt: skip


@pytest.fixture(scope="module")
def ints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``y`` = ``0 ... N-1`` (``test_handover``'s: the same compiled loop, compiled once per session)."""
    path = tmp_path_factory.mktemp("cached_outputs") / "ints.stoker"
    DatasetWriter(path, {"y": IntField()}, num_workers=1, progress=False).from_indexed_dataset([(i,) for i in range(N)])
    return path


def _values(obj: Any) -> Any:
    """A copy of what ``obj`` (a kept batch, in any form) shows now."""
    if isinstance(obj, dict):
        return {k: _values(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_values(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return (tuple(obj.shape), obj.detach().clone().numpy())
    if isinstance(obj, torch.UntypedStorage):
        return bytes(obj.tolist())
    return (obj.shape, np.array(obj, copy=True))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, tuple):
        return a[0] == b[0] and np.array_equal(a[1], b[1])
    return bool(a == b)


def _keep(form: str, batch: Any, y: torch.Tensor) -> Any:
    """What the user keeps of ``batch`` (``y`` its field ``y``), or ``None``; in-place changes made here."""
    if form == "batch":
        return batch
    if form == "tensor":
        return y
    if form == "slice":
        return y[:3]
    if form == "view":
        return y.view(-1)
    if form == "unsqueeze":
        return y.unsqueeze(0)
    if form == "numpy":
        return y.numpy()
    if form == "asarray":
        return np.asarray(y)
    if form == "storage":
        return y.untyped_storage()
    if form == "dict":
        return {"y": y, "first": y[:1]}
    if form == "list":
        return [y[1:4], y.view(-1)]
    if form in ("unsqueeze_", "unsqueeze_kept"):
        y.unsqueeze_(0)  # (the tensor's shape changed in place: the next batch of its slot must not show it)
        return y if form == "unsqueeze_kept" else None
    if form == "requires_grad_" and y.dtype == torch.float64:
        y.requires_grad_()
    return None


@settings(max_examples=examples(6, 60), deadline=None)
@example(num_workers=1, batch_size=7, tail="float", named=False, holds=3, slow=False,
         forms=["requires_grad_", "unsqueeze_", "storage", "none", "slice", "unsqueeze_kept", "list"])  # fmt: skip
@example(num_workers=2, batch_size=16, tail="squeeze", named=True, holds=4, slow=False,
         forms=["batch", "tensor", "view", "numpy", "asarray", "dict", "unsqueeze", "none", "unsqueeze_"])  # fmt: skip
@example(num_workers=2, batch_size=7, tail="squeeze", named=False, holds=2, slow=True,
         forms=["tensor", "unsqueeze_", "slice", "none", "storage", "requires_grad_", "dict", "unsqueeze_kept"])  # fmt: skip
@given(
    num_workers=st.integers(1, 2),
    batch_size=st.sampled_from([7, 16]),
    tail=st.sampled_from(sorted(TAILS)),
    named=st.booleans(),
    holds=st.integers(0, 5),
    slow=st.booleans(),
    forms=st.lists(st.sampled_from(FORMS), min_size=1, max_size=12),
)
@pytest.mark.filterwarnings("ignore::stoker.loader.HeldBatchesWarning")
def test_kept_batches_in_any_form_are_never_overwritten_and_every_batch_is_the_models(
    ints: Path, num_workers: int, batch_size: int, tail: str, named: bool, holds: int, slow: bool, forms: list[str]
) -> None:  # fmt: skip
    """Two epochs of 19-43 batches over 7-10 slots: batch ``b`` is kept in form ``forms[b % len(forms)]`` (the last
    ``holds`` kept), or changed in place and dropped. Every kept batch shows what it showed when kept; every batch handed
    out is the model's (values, shape, dtype, no ``requires_grad``). By the fast hand-over, or (``slow``) every batch by
    the general ``next()``, which hands out the slots' kept outputs too."""
    with mock.patch.dict(os.environ, AS_SET), Loader(ints, batch_size=batch_size, num_workers=num_workers,
            order=OrderOption.RANDOM, seed=3, batches_ahead=1, named=named,
            pipelines={"y": [IntDecoder(), *TAILS[tail]]}) as loader:  # fmt: skip
        assert loader._num_slots < N // batch_size // 2, "many more batches than slots"
        kept: list[tuple[int, str, Any, Any]] = []
        k = 0
        for _ in range(2):
            order = loader.epoch_indices(loader._next_epoch)
            it = iter(loader)
            assert it._fast is not None  # type: ignore[attr-defined]
            if slow:
                it._fast = None  # type: ignore[attr-defined]
            for b, batch in enumerate(it):
                (y,) = batch.values() if named else batch
                idx = order[b * batch_size : (b + 1) * batch_size]
                shape = (len(idx), 1) if tail == "default" else (len(idx),)
                assert tuple(y.shape) == shape and not y.requires_grad, (b, tuple(y.shape), y.requires_grad)
                assert y.dtype == (torch.float64 if tail == "float" else torch.int64)
                ints_y = y.view(torch.int64) if tail == "float" else y
                np.testing.assert_array_equal(ints_y.reshape(-1).numpy(), idx, err_msg=f"batch {b}")
                form = forms[k % len(forms)]
                k += 1
                obj = _keep(form, batch, y)
                del batch, y, ints_y
                if obj is not None:
                    kept.append((b, form, obj, _values(obj)))
                    del obj
                    if len(kept) > holds:
                        kept.pop(0)
                for kb, kform, kobj, values in kept:  # held while later batches were made: never overwritten
                    assert _same(_values(kobj), values), f"batch {kb} kept as {kform!r} was overwritten"
            del it
        assert loader._pool is None or not loader._pool.busy()


@pytest.mark.parametrize("path", ["fast", "slow"])
@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("tail", ["default", "squeeze"])
def test_a_slot_hands_out_the_same_tensor_again_while_nothing_holds_it(ints: Path, num_workers: int, tail: str, path: str) -> None:
    """Each batch ready before ``next()`` (a condition): every full batch after its slot's first is the very tensor
    object handed out for that slot before (a weak reference: nothing held), no batch counted as kept, and the
    accounting's columns of the tail say 0 for those batches (no step ran). By the fast hand-over, and by the general
    ``next()`` (``slow``: every batch handed over there, as a batch the loop waited for is)."""
    with mock.patch.dict(os.environ, AS_SET), Loader(ints, batch_size=10, num_workers=num_workers,
            order=OrderOption.RANDOM, seed=8, pipelines={"y": [IntDecoder(), *TAILS[tail]]}) as loader:  # fmt: skip
        rec = loader._recorder
        collections.deque(loader, maxlen=0)  # (an epoch first: whatever compiles in this process does so now, not in the
        held = loader._held[0]  # epochs checked, where a compile's garbage could hold a batch; nothing kept of it)
        seen: dict[int, weakref.ref[torch.Tensor]] = {}
        again = same = 0
        for _ in range(2):
            order = loader.epoch_indices(loader._next_epoch)
            it = iter(loader)
            ring = it._ring  # type: ignore[attr-defined]
            if path == "slow":
                it._fast = None  # type: ignore[attr-defined]
            count0 = rec.count if rec is not None else 0
            n_batches = len(it)
            for c in range(n_batches):
                fast = not (c == ring.skip and it._first_claimed)  # type: ignore[attr-defined]  # (else the loop's own)
                if fast:
                    _until(lambda c=c, ring=ring: ring.status[c] == DONE, f"batch {c} made")
                (y,) = next(it)
                np.testing.assert_array_equal(y.reshape(-1).numpy(), order[c * 10 : (c + 1) * 10])
                slot = ring.slot(c)
                ref = seen.pop(slot, None)
                if not fast:  # (the loop makes its first batch itself, and the slow path hands it over: a new tensor)
                    del y
                    continue
                if ref is not None:
                    again += 1
                    if ref() is y:
                        same += 1
                        if rec is not None:  # the tail's columns of this batch's accounting row: nothing ran
                            row = rec.steps[(it._rec_base + c) % ROWS]  # type: ignore[attr-defined]
                            assert not row[[col for *_, col in it._tail_plan[0][4]]].any(), row  # type: ignore[attr-defined]
                seen[slot] = weakref.ref(y)
                del y
            with pytest.raises(StopIteration):
                next(it)
            if rec is not None:
                assert rec.count - count0 == n_batches
            del it
        assert again > 20
        assert same == again, f"{same} of {again} batches in a slot handed out before got its tensor again"
        assert loader._held[0] == held, "a batch counted as kept where nothing held it"


class _CopyingView(Operation):
    """Says it makes a view (``view_only``) but returns a copy: the loader must not hand that copy out again."""

    reentrant = True
    view_only = True

    def declare_state_and_memory(self, previous_state: Any) -> Any:
        return replace(previous_state), None

    def generate_code(self) -> Any:
        def copy(batch: torch.Tensor, dst: Any) -> torch.Tensor:
            return batch.clone()

        return copy


def test_a_step_that_copies_is_not_made_once_for_its_slot(ints: Path) -> None:
    """Only a tensor over the slot's own memory is kept for the slot: a copy (a step mislabelled ``view_only``) is made
    again for every batch; every batch right, a new tensor each time."""
    with Loader(ints, batch_size=10, num_workers=1, order=OrderOption.RANDOM, seed=1,
                pipelines={"y": [IntDecoder(), ToTensor(), _CopyingView()]}) as loader:  # fmt: skip
        order = loader.epoch_indices(loader._next_epoch)
        got = []
        for c, (y,) in enumerate(loader):
            np.testing.assert_array_equal(y.reshape(-1).numpy(), order[c * 10 : (c + 1) * 10])
            got.append(y)
        assert len({id(y) for y in got}) == len(got)
        assert all(c is None for c in loader.pipelines[0]._tail_cache)


def test_which_operations_only_make_views() -> None:
    """``view_only``: the tensor steps that wrap or view memory; not a copy, a conversion, a module, nor a user's own."""
    assert ToTensor().view_only and Squeeze().view_only and View(np.float32).view_only
    assert ToTorchImage().view_only and not ToTorchImage(channels_last=False).view_only
    assert ToDevice("cpu").view_only and not ToDevice("cuda").view_only
    assert not Convert(np.float32).view_only and not NormalizeImage(np.zeros(3), np.ones(3), np.float32).view_only
    assert not ModuleWrapper(lambda t: t).view_only and not Operation.view_only
