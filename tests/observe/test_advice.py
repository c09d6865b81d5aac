"""Each suggestion ``report()`` can make, in the situation it names: the advice must be the right one.

Two kinds of test. Where a small real run is reliably data-bound on the cause
(a slow Python stage, an operation after ``ToTensor``, compiling switched off,
a slow flow source), a real Loader or flow runs (the real runs share one
compiled head, so that the file compiles once; a slow compiled head and a slow
flow stage are run in ``test_loader_accounting.py`` and ``test_flow_accounting.py``). Where a real run cannot be made
to wait on one cause without depending on the machine (reading, the hand-over,
the loader's overhead, a host-to-device copy, a GPU-bound loop, a compiled head
on every CPU), the test writes the accounting inputs that ``report()`` reads, the
step and mark rows of a :class:`~stoker.observe._recorder.Recorder` as the
Loader's hot path writes them, with the settings the Loader puts in its
context, and checks the figures derived from them as well as the advice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.decoders import NDArrayDecoder, SimpleRGBImageDecoder
from stoker.fields import IntField, NDArrayField, RGBImageField
from stoker.flow import PipelineBuilder
from stoker.loader import Loader
from stoker.loader._accounting import DEVICE, components, forms
from stoker.observe._recorder import HANDOVER, M_DONE, M_START, MARK_FIXED, OVERHEAD, ROWS, STEP_FIXED, Component, Recorder
from stoker.observe._report import suggestion, summarize
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State
from stoker.transforms import NormalizeImage, ToDevice, ToTensor, ToTorchImage
from stoker.writer import DatasetWriter
from tests.observe._ops import sleepy

MS = 1_000_000  # ns

# ---- the accounting inputs, as the hot path writes them ----------------------------------------------------------


def rows_summary(
    producer: list[Component],
    loop: list[Component],
    context: dict[str, Any],
    *,
    head_wait: float = 0.0,
    durations: tuple[float, ...] = (),
    loop_side: tuple[float, ...] = (),
    handover: float = 0.0,
    overhead: float = 0.0,
    step: float = 1.0,
    batches: int = 20,
) -> dict[str, Any]:
    """``summarize()`` of ``batches`` steps (after the first, reported apart), each alike [ms]:

    the loop enters ``next()``; its batch's head is done ``head_wait`` later (its producer-side components took
    ``durations``); a sleeping loop wakes ``handover`` after that; it runs the loop-side components (``loop_side``)
    and ``overhead`` of its own; then it is away for ``step``.
    """
    rec = Recorder("Loader('test.stoker', batch_size=32)", "loader")
    rec.configure(producer, loop)
    rec.context.update(context)
    base = rec.epoch_base(0, 0)
    t = 10**12
    for c in range(batches + 1):
        row = (base + c) % ROWS
        t_enter = t
        t_done = t_enter + int(head_wait * MS)
        t_ready = t_done + int(handover * MS)
        for k, v in enumerate(loop_side):
            rec.steps[row, STEP_FIXED + k] = int(v * MS)
        t_exit = t_ready + int((sum(loop_side) + overhead) * MS)
        rec.marks[row, M_START] = t_done - int(sum(durations) * MS)
        rec.marks[row, M_DONE] = t_done
        for k, v in enumerate(durations):
            rec.marks[row, MARK_FIXED + k] = int(v * MS)
        rec.step(row * rec.width, t_enter, t_ready, t_exit, 0, 1 if handover else 0)
        t = t_exit + int(step * MS)
    return summarize(rec)


READ = Component("read", "read", "producer")
X_HEAD = Component("x: NDArrayDecoder", "compiled", "producer", "x")
IMAGE_HEAD = Component("image: RandomResizedCropRGBImageDecoder+RandomHorizontalFlip", "compiled", "producer", "image")
X_TO_TENSOR = Component("x: ToTensor", "python", "loop", "x")
SETTINGS = {"num_workers": 2, "cpus": 2, "batches_ahead": 3, "os_cache": True, "verify": True, "remote": False, "download_ahead": None}


def _advice(summary: dict[str, Any]) -> str:
    assert summary["data_bound"] and summary["verdict"] == "data-bound", summary
    return str(summary["suggestion"])


@pytest.mark.parametrize(
    ("context", "expected", "wrong"),
    [
        ({}, ["CRCs", "check_data=False"], ["faster store", "os_cache=True"]),  # mapped file: "read" is the data check
        ({"os_cache": False}, ["os_cache=True", "faster disk"], ["verify", "download_ahead"]),
        ({"os_cache": False, "remote": True, "download_ahead": 4}, ["download_ahead (now 4)", "cache_limit", "QUASI_RANDOM"], ["os_cache"]),
    ],
    ids=["memory-mapped", "bounded-cache", "object-store"],
)
def test_reading_dominates(context: dict[str, Any], expected: list[str], wrong: list[str]) -> None:
    s = rows_summary([READ, X_HEAD], [X_TO_TENSOR], {**SETTINGS, **context}, head_wait=4, durations=(3.6, 0.4), loop_side=(0.05,))
    assert s["bottleneck"] == "read" and s["stages"]["read"]["stall_share"] == pytest.approx(0.9 * 4 / 4.05, rel=0.01)
    text = _advice(s)
    assert all(e in text for e in expected) and not any(w in text for w in wrong), text


@pytest.mark.parametrize(
    ("head", "workers", "expected", "wrong"),
    [
        (X_HEAD, 1, ["raise num_workers (now 1; this process may use 2 CPUs)"], ["smaller images"]),
        (IMAGE_HEAD, 1, ["raise num_workers (now 1"], ["smaller images"]),
        (IMAGE_HEAD, 2, ["uses every CPU", "max_resolution", "smaller crop"], ["num_workers"]),
        (X_HEAD, 2, ["uses every CPU (2 workers)", "make it cheaper"], ["max_resolution", "raise num_workers"]),
    ],
    ids=["idle-cpus", "image-idle-cpus", "image-every-cpu", "every-cpu"],
)
def test_a_compiled_head_dominates(head: Component, workers: int, expected: list[str], wrong: list[str]) -> None:
    s = rows_summary(
        [READ, head], [X_TO_TENSOR], {**SETTINGS, "num_workers": workers}, head_wait=4, durations=(0.0, 5.0), loop_side=(0.05,)
    )
    assert s["bottleneck"] == head.name and s["stages"][head.name]["kind"] == "compiled"
    text = _advice(s)
    assert all(e in text for e in expected) and not any(w in text for w in wrong), text


@pytest.mark.parametrize(("workers", "more_workers"), [(1, True), (2, False)])
def test_the_hand_over_dominates(workers: int, more_workers: bool) -> None:
    s = rows_summary([READ, X_HEAD], [X_TO_TENSOR], {**SETTINGS, "num_workers": workers}, head_wait=0.1, durations=(0, 2), handover=1.0)
    assert s["bottleneck"] == HANDOVER and s["stages"][HANDOVER]["stall_s"] == pytest.approx(20 * 1e-3, rel=0.01)
    text = _advice(s)
    assert "raise batches_ahead (now 3)" in text
    assert ("num_workers (now 1; this process may use 2 CPUs)" in text) is more_workers, text


def test_the_loaders_own_work_dominates() -> None:
    s = rows_summary([READ, X_HEAD], [X_TO_TENSOR], SETTINGS, durations=(0, 2), loop_side=(0.05,), overhead=2.0)
    assert s["bottleneck"] == OVERHEAD
    assert "larger batches" in _advice(s)


def test_the_copy_to_the_device_dominates() -> None:
    copy = Component("image: ToDevice", "copy", "loop", "image")
    s = rows_summary([READ, IMAGE_HEAD], [copy], SETTINGS, durations=(0, 2), loop_side=(3.0,))
    assert s["bottleneck"] == "image: ToDevice"
    text = _advice(s)
    # (the earlier advice, "keep ToDevice last", contradicted normalising on the device, which needs an operation after it)
    assert "copy fewer bytes" in text and "NormalizeImage placed after ToDevice" in text and "ToDevice last" not in text, text


@pytest.mark.parametrize(
    ("form", "expected", "wrong"),
    [
        ("function", ["make it a compiled operation", "before ToTensor"], ["place it before ToTensor, where"]),
        ("operation", ["make it cheaper", "compiled operation before ToTensor"], ["make it a compiled operation"]),
        ("movable", ["place it before ToTensor", "runs compiled in the field's head"], ["make it a compiled operation", "GPU"]),
        ("movable on the GPU", ["on the GPU", "place it before ToTensor", "float output instead of uint8"], ["make it a compiled"]),
    ],
)
def test_a_python_stage_on_the_loops_thread_dominates(form: str, expected: list[str], wrong: list[str]) -> None:
    stage = Component("image: NormalizeImage" if form.startswith("movable") else "image: stage", "python", "loop", "image")
    s = rows_summary([READ, IMAGE_HEAD], [stage], {**SETTINGS, "forms": {stage.name: form}}, durations=(0, 1), loop_side=(4.0,))
    assert s["bottleneck"] == stage.name and s["stages"][stage.name]["side"] == "loop"
    text = _advice(s)
    assert all(e in text for e in expected) and not any(w in text for w in wrong), text


@pytest.mark.parametrize(
    ("form", "expected"),
    [("decoder", ["decoder that runs as Python on the producer threads", "Custom decoders"]), ("uncompiled", ["compiling is off"])],
)
def test_a_python_head_dominates(form: str, expected: list[str]) -> None:
    head = Component("x: NDArrayDecoder", "python", "producer", "x")
    s = rows_summary(
        [READ, head], [X_TO_TENSOR], {**SETTINGS, "forms": {head.name: form}}, head_wait=4, durations=(0, 5), loop_side=(0.05,)
    )
    text = _advice(s)
    # (the earlier advice said such a head runs "inside next(), on the loop's thread": it runs on producer threads)
    assert all(e in text for e in expected) and "loop's thread" not in text, text


def test_a_gpu_bound_loop_is_told_so_and_a_fast_input_needs_nothing() -> None:
    device = Component(DEVICE, "device", "loop")
    s = rows_summary([READ, X_HEAD], [X_TO_TENSOR, device], SETTINGS, durations=(0, 1), loop_side=(0.02, 8.0), step=2.0)
    assert not s["data_bound"] and s["device_share"] == pytest.approx(8 / 10.02, rel=0.01), s
    assert "GPU-bound" in s["suggestion"] and "faster step on the GPU" in s["suggestion"]
    s = rows_summary([READ, X_HEAD], [X_TO_TENSOR], SETTINGS, durations=(0, 1), loop_side=(0.02,), step=5.0)
    assert not s["data_bound"] and s["suggestion"].startswith("none needed for the input") and "GPU" not in s["suggestion"]


def test_a_stage_the_report_does_not_know_is_named() -> None:
    other = Component("x: mystery", "unknown-kind", "producer", "x")
    s = rows_summary([READ, other], [X_TO_TENSOR], SETTINGS, head_wait=4, durations=(0, 5), loop_side=(0.05,))
    assert _advice(s) == "'x: mystery' causes most of the waiting: make it cheaper"


# ---- real runs -----------------------------------------------------------------------------------------------------

N_IMAGES, BATCH = 96, 32
MEAN, STD = np.array([0.485, 0.456, 0.406]) * 255, np.array([0.229, 0.224, 0.225]) * 255


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("advice") / "images.stoker"
    rng = np.random.default_rng(0)
    pictures = rng.integers(0, 256, (N_IMAGES, 96, 96, 3), dtype=np.uint8)
    DatasetWriter(path, {"image": RGBImageField(write_mode="raw"), "label": IntField()}, num_workers=1, progress=False).from_arrays(
        {"image": pictures, "label": np.arange(N_IMAGES)}
    )
    return path


def _run(loader: Loader, epochs: int = 2) -> dict[str, Any]:
    with loader:
        for _ in range(epochs):
            for _batch in loader:
                pass
        return dict(loader.stats()["accounting"])


@pytest.mark.compiled_loop  # (the producers' share of the wait as users' steady state has it)
def test_normalize_after_to_tensor_is_told_to_move_before_it(images: Path) -> None:
    """The README's image pipeline on the CPU: NormalizeImage after ToTensor runs with torch on the loop's thread.

    It is a compiled operation already (before ToTensor): the advice is to move it there, not to make it compiled.
    """
    tail = [SimpleRGBImageDecoder(), ToTensor(), ToDevice("cpu"), ToTorchImage(), NormalizeImage(MEAN, STD, np.float32)]
    loader = Loader(images, batch_size=BATCH, num_workers=1, pipelines={"image": tail, "label": None})
    context = loader._recorder.context if loader._recorder is not None else {}
    a = _run(loader)
    # the loop's work first; a producer's wake-up (the hand-over) is left out: on a busy machine one wake of the
    # epoch's second batch took longer than the ten normalisations (a busy suite run said "hand-over" here)
    by_work = [n for n in a["stages"] if n != HANDOVER]
    assert by_work[0] == "image: NormalizeImage", a
    assert a["stages"]["image: NormalizeImage"]["kind"] == "python" and a["stages"]["image: NormalizeImage"]["side"] == "loop"
    text = _advice(a) if a["bottleneck"] == by_work[0] else suggestion({**a, "bottleneck": by_work[0]}, context)
    assert "place it before ToTensor" in text and "make it a compiled operation" not in text, text
    # following the advice: NormalizeImage joins the field's compiled head, run by producer threads; nothing of it on the loop
    moved = [SimpleRGBImageDecoder(), NormalizeImage(MEAN, STD, np.float32), ToTensor(), ToDevice("cpu"), ToTorchImage()]
    with Loader(images, batch_size=BATCH, num_workers=1, pipelines={"image": moved, "label": None}) as loader:
        producer, loop = components(loader.pipelines)
    assert Component("image: SimpleRGBImageDecoder+NormalizeImage", "compiled", "producer", "image") in producer
    assert not any("NormalizeImage" in c.name for c in loop), loop


def test_a_python_function_after_to_tensor_is_told_to_become_an_operation(images: Path) -> None:
    slow = sleepy(0.02)
    ops = [SimpleRGBImageDecoder(), ToTensor(), slow]
    a = _run(Loader(images, batch_size=BATCH, num_workers=1, pipelines={"image": ops, "label": None}))
    assert a["bottleneck"] == "image: sleepy", a
    text = _advice(a)
    assert "make it a compiled operation" in text and "stoker.pipeline.Operation" in text, text


class Nap(Operation):
    """An operation that takes ``ms`` per batch in Python (on tensors after ``ToTensor``; as a head when compiling is off)."""

    reentrant = True

    def __init__(self, ms: float) -> None:
        self.seconds = ms / 1e3

    def generate_code(self) -> Callable[..., Any]:
        seconds = self.seconds

        def nap(batch: Any, dst: Any) -> Any:
            time.sleep(seconds)
            return batch

        return nap

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        return previous_state, None


def test_a_tensor_operation_is_told_to_be_cheaper_or_compiled_before_to_tensor(images: Path) -> None:
    ops = [SimpleRGBImageDecoder(), ToTensor(), Nap(20)]
    a = _run(Loader(images, batch_size=BATCH, num_workers=1, pipelines={"image": ops, "label": None}))
    assert a["bottleneck"] == "image: Nap", a
    text = _advice(a)
    assert "make it cheaper" in text and "compiled operation before ToTensor" in text, text


def test_compiling_switched_off_is_named(table: Path) -> None:
    ops = [NDArrayDecoder(), Nap(20), ToTensor()]
    a = _run(Loader(table, batch_size=BATCH, num_workers=1, compile=False, pipelines={"x": ops, "y": None}), epochs=1)
    assert a["bottleneck"] == "x: NDArrayDecoder+Nap", a
    assert a["stages"]["x: NDArrayDecoder+Nap"]["kind"] == "python" and a["stages"]["x: NDArrayDecoder+Nap"]["side"] == "producer"
    text = _advice(a)
    assert "compiling is off" in text and "num_workers" not in text, text


def test_a_slow_flow_source_is_named() -> None:
    def source() -> Any:
        for i in range(16):
            time.sleep(0.015)
            yield i

    flow = PipelineBuilder().add_source(source()).pipe(lambda x: x + 1, concurrency=2).add_sink(2).build(num_threads=2)
    assert list(flow) == list(range(1, 17))
    a = flow.stats().accounting
    assert a["bottleneck"] == "source", flow.report()
    assert "the flow's source is the slowest part" in _advice(a)


def test_what_each_python_component_is(images: Path, table: Path, tmp_path: Path) -> None:
    """``forms()``, what the advice reads, on built pipelines (built only: nothing is compiled or run)."""
    norm = NormalizeImage(MEAN, STD, np.float32)
    cases: list[tuple[Path, dict[str, Any], dict[str, Any], dict[str, str]]] = [
        (images, {"image": [SimpleRGBImageDecoder(), ToTensor(), ToDevice("cpu"), ToTorchImage(), norm, sleepy(0)], "label": None}, {},
         {"image: ToTensor": "operation", "image: ToTorchImage": "operation", "image: NormalizeImage": "movable", "image: sleepy": "function"}),
        # float16 runs as Python before ToTensor too (Numba has no float16): moving it would not take it off the loop
        (images, {"image": [SimpleRGBImageDecoder(), NormalizeImage(MEAN, STD, np.float16), ToTensor()], "label": None}, {},
         {"image: NormalizeImage": "operation", "image: ToTensor": "operation"}),
        (images, {"image": [SimpleRGBImageDecoder(), norm, ToTensor()], "label": None}, {}, {"image: ToTensor": "operation"}),  # in the head
        (table, {"x": [NDArrayDecoder(), ToTensor()], "y": None}, {"compile": False}, {"x: NDArrayDecoder": "uncompiled", "x: ToTensor": "operation"}),
    ]  # fmt: skip
    for path, pipelines, kw, expected in cases:
        with Loader(path, batch_size=BATCH, num_workers=1, pipelines=pipelines, **kw) as loader:
            assert forms(loader.pipelines) == expected
    f16 = tmp_path / "half.stoker"
    DatasetWriter(f16, {"h": NDArrayField(shape=(4,), dtype=np.dtype("float16"))}, num_workers=1, progress=False).from_arrays(
        {"h": np.zeros((8, 4), np.float16)}
    )
    with Loader(f16, batch_size=4, num_workers=1) as loader:
        assert forms(loader.pipelines) == {"h: NDArrayDecoder": "decoder", "h: ToTensor": "operation"}
        producer, _ = components(loader.pipelines)
        assert Component("h: NDArrayDecoder", "python", "producer", "h") in producer
