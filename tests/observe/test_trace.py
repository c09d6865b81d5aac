"""The timeline: trace-event JSON that parses, with the spans the run produced; spans in torch.profiler."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import torch

from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.flow import PipelineBuilder
from stoker.loader import Loader
from stoker.observe import record_span
from stoker.transforms import Convert, ToTensor
from tests.observe._ops import Spin, sleepy

EPOCH_BATCHES = 10


def _check_format(path: Path) -> list[dict[str, Any]]:
    """Every event has the required fields; durations are non-negative; every track is named."""
    events = json.loads(path.read_text())["traceEvents"]
    named = set()
    for e in events:
        for key in ("name", "ph", "pid", "tid"):
            assert key in e, e
        if e["ph"] == "M":
            if e["name"] == "thread_name":
                assert e["args"]["name"]
                named.add(e["tid"])
            continue
        assert e["ph"] == "X", e
        assert isinstance(e["ts"], float | int) and e["ts"] >= 0, e
        assert isinstance(e["dur"], float | int) and e["dur"] >= 0, e
    assert {e["tid"] for e in events if e["ph"] == "X"} <= named
    return [e for e in events if e["ph"] == "X"]


def test_a_loader_trace(table: Path, tmp_path: Path) -> None:
    with Loader(
        table,
        batch_size=32,
        num_workers=2,
        pipelines={"x": [NDArrayDecoder(), Spin(2), ToTensor()], "y": [IntDecoder(), ToTensor(), Convert(torch.float32)]},
    ) as loader:
        list(loader)  # before the trace: not in it
        out = tmp_path / "run.json"
        with loader.trace(out):
            for _ in range(2):
                for _batch in loader:
                    time.sleep(0.001)
        spans = _check_format(out)
    n = 2 * EPOCH_BATCHES
    names = [e["name"] for e in spans]
    assert sum(name.startswith("batch ") for name in names) == n  # each batch on the track of whoever made it
    assert names.count("x: NDArrayDecoder+Spin") == n and names.count("y: IntDecoder") == n
    assert names.count("y: ToTensor") == n and names.count("y: Convert") == n  # the loop's Python stages, each batch
    # a tail of views only is made once per slot and kept while no one holds it (FieldPipeline.keep_tail): a batch
    # served from it ran no stage, so the trace shows none (how many: which batches took the loop's fast path)
    assert names.count("x: ToTensor") <= n
    assert names.count("step") == n - 2  # between two next() of the same epoch
    waits = [e for e in spans if e["name"].startswith("wait for batch")]
    assert 0 < len(waits) <= n
    tracks = {e["tid"] for e in spans if e["name"].startswith("batch ")}
    assert len(tracks) >= 2  # producers and the loop's own thread


def test_record_span_is_the_hook_for_lower_layers(table: Path, tmp_path: Path) -> None:
    out = tmp_path / "hook.json"
    with Loader(table, batch_size=32, num_workers=1) as loader, loader.trace(out):
        t0 = time.perf_counter_ns()

        def download() -> None:
            record_span("GET shard-0", t0, t0 + 1_000_000, "download", {"bytes": 10})

        thread = threading.Thread(target=download, name="downloader")
        thread.start()
        thread.join()
        list(loader)
    record_span("after the trace", t0, t0 + 1)  # no trace active: nothing, no error
    events = json.loads(out.read_text())["traceEvents"]
    gets = [e for e in events if e["name"] == "GET shard-0"]
    assert len(gets) == 1 and gets[0]["cat"] == "download" and gets[0]["dur"] == 1000.0
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[gets[0]["tid"]] == "downloader"
    assert not any(e["name"] == "after the trace" for e in events)


def test_a_flow_trace(tmp_path: Path) -> None:
    flow = PipelineBuilder().add_source(range(12)).pipe(sleepy(0.002), concurrency=2).pipe(str).add_sink(2).build(num_threads=2)
    out = tmp_path / "flow.json"
    with flow.trace(out):
        got = list(flow)
    assert len(got) == 12
    names = [e["name"] for e in _check_format(out)]
    assert names.count("sleepy") == 12 and names.count("str") == 12
    assert names.count("step") == 11


def test_spans_appear_in_torch_profiler(table: Path) -> None:
    from torch.profiler import profile

    with Loader(table, batch_size=32, num_workers=1) as loader:
        list(loader)
        with profile() as prof:
            batches = list(loader)
    names = [e.name for e in prof.events()]
    assert sum(name.startswith("stoker: Loader next()") for name in names) == len(batches) + 1  # + the StopIteration
