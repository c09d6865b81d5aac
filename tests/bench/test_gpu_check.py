"""The device check (benchmarks/gpu/check.py): its CPU-only mode end to end, and its targets and table from figures."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu" / "check.py"


def _check_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", module)  # (its dataclasses look their module up while they are made)
    spec.loader.exec_module(module)
    return module


@pytest.mark.long
@pytest.mark.slow
def test_the_cpu_mode_runs_every_section_and_checks_the_batches(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["mode"] == "cpu" and set(data["sections"]) == {"data", "small_cnn_cpu", "scaling"}
    assert not any("error" in sec for sec in data["sections"].values())
    assert data["sections"]["data"]["photos"]["images"] == 96 and data["sections"]["data"]["tiny"]["images"] == 1024
    train = data["sections"]["small_cnn_cpu"]
    assert set(train["systems"]) == {"stoker", "dataloader_w1"}
    for name, r in train["systems"].items():
        assert r["images_per_s"] > 0 and 0 < r["busy_share"] <= 1 and r["steps"] >= 3, name
        assert r["batch"] == [[64, 3, 32, 32], "uint8", [64], "int64"], name  # the same batches from both
    assert train["systems"]["stoker"]["verdict"] in ("data-bound", "not data-bound")
    assert "verdict:" in train["systems"]["stoker"]["report"]
    scaling = data["sections"]["scaling"]["threads"]
    assert set(scaling) == {"1", "2"}
    for r in scaling.values():
        assert r["stoker_images_per_s"] > 0 and r["dataloader_images_per_s"] > 0
        assert r["batch"] == [[16, 224, 224, 3], "uint8", [16], "int64"]
    assert data["targets"] == []  # (no GPU: the targets are the GPU run's)
    table = (out / "gpu_check.md").read_text()
    assert table.strip() in proc.stdout and "| scaling | 2 threads |" in table


def _system(images: float, busy: float) -> dict[str, Any]:
    return {"images_per_s": images, "busy_share": busy, "verdict": "not data-bound", "stall_share": 0.01, "device_share": 0.3, "loss": 6.9}


def _measured(r50_busy: float, dl_busy: float, r18_ratio: float, scale16: float, worst: float) -> dict[str, Any]:
    r50 = {"systems": {"stoker": _system(2800, r50_busy), "stoker_loop_thread": _system(2700, r50_busy - 0.02),
                       "dataloader_w8": _system(2000, dl_busy - 0.1), "dataloader_w16": _system(2400, dl_busy)},
           "dataloader_best": "dataloader_w16", "stoker_over_dataloader": 2800 / 2400, "ahead_over_loop_thread": 2800 / 2700,
           "ahead_over_loop_thread_busy": 1.02}  # fmt: skip
    r18 = {"systems": {"stoker": _system(100000 * r18_ratio, 0.5), "dataloader_w16": _system(100000, 0.3)},
           "dataloader_best": "dataloader_w16", "stoker_over_dataloader": r18_ratio, "ahead_over_loop_thread": 0.97,
           "ahead_over_loop_thread_busy": 1.0}  # fmt: skip
    threads = {str(k): {"stoker_images_per_s": 100.0 * k, "dataloader_images_per_s": 30.0 * k, "stoker_over_dataloader": 10 / 3,
                        "stoker_over_1_thread": float(k)} for k in (1, 2, 4, 8)}  # fmt: skip
    threads["16"] = {"stoker_images_per_s": 100 * scale16, "dataloader_images_per_s": 100 * scale16 / worst,
                     "stoker_over_dataloader": worst, "stoker_over_1_thread": scale16}  # fmt: skip
    sections = {
        "tests": {"summary": "31 passed in 50.0s", "seconds_tests": 50.0},
        "resnet50": r50,
        "resnet18": r18,
        "scaling": {"threads": threads},
    }
    return {"mode": "full", "env": {"device": "NVIDIA H100 80GB HBM3", "cpus": 16, "torch": "2.11.0"}, "sections": sections}


def test_the_targets_follow_the_figures() -> None:
    check = _check_module()
    met = {t["target"]: t["met"] for t in check.targets(_measured(0.97, 0.9, 2.5, 13.0, 2.6))}
    assert len(met) == 6 and all(v for k, v in met.items() if "loop thread" not in k or "ResNet-50" in k)
    assert met["ResNet-18: copy ahead >= loop thread"] is False  # 0.97x
    missed = {t["target"]: t["met"] for t in check.targets(_measured(0.94, 0.9, 1.9, 11.0, 2.4))}
    assert not missed["ResNet-50: stoker keeps the GPU busy >= 95%, the best DataLoader does not"]
    assert not missed["ResNet-18 32x32: >= 2x the DataLoader's images/s"]
    assert not missed["photo task: >= 12x its 1-thread throughput at 16 threads"]
    assert not missed["photo task: >= 2.5x the DataLoader at every thread count"]
    both_busy = {t["target"]: t["met"] for t in check.targets(_measured(0.97, 0.96, 2.5, 13.0, 2.6))}
    assert not both_busy["ResNet-50: stoker keeps the GPU busy >= 95%, the best DataLoader does not"]


def test_the_table_names_the_device_every_system_and_a_failed_section() -> None:
    check = _check_module()
    data = _measured(0.97, 0.9, 2.5, 13.0, 2.6)
    data["sections"]["resnet18"] = {"error": "RuntimeError: CUDA out of memory", "seconds": 3.0}
    data["targets"] = check.targets(data)
    text = check.table(data)
    assert "NVIDIA H100 80GB HBM3" in text and "| tests | pytest -m gpu | | | | 31 passed in 50.0s (50.0 s) |" in text
    for system in ("stoker", "stoker_loop_thread", "dataloader_w8", "dataloader_w16"):
        assert f"| resnet50 | {system} |" in text
    assert "| resnet18 | **failed** |" in text and "CUDA out of memory" in text
    assert "copy ahead / loop thread: 1.04x images/s" in text
    assert "| scaling | 16 threads | 1300 (DataLoader 500) |" in text
    assert not any("ResNet-18" in t["target"] for t in data["targets"])  # (its section failed: no target judged)


def test_a_cpu_run_is_not_labelled_gpu_busy() -> None:
    """Without a GPU the busy column is the loop's share of time in its steps: the table and the lines say so."""
    check = _check_module()
    system = {**_system(500, 0.9), "busy_of": "cpu_steps"}
    sections = {"small_cnn_cpu": {"systems": {"stoker": system}, "dataloader_best": "stoker", "stoker_over_dataloader": 1.0}}
    text = check.table({"mode": "cpu", "env": {"device": "cpu (no GPU)", "cpus": 2, "torch": "2.13.0+cpu"}, "sections": sections})
    assert "GPU busy" not in text and "for the GPU" not in text, text
    assert "in steps (CPU, no GPU)" in text and "| small_cnn_cpu | stoker | 500 | 90.0% |" in text
    assert check.busy_label(True) == "GPU busy" and "GPU busy" in check.table(_measured(0.97, 0.9, 2.5, 13.0, 2.6))


def test_the_device_wheels_cover_stokers_dependencies() -> None:
    """fetch_wheels.py's pins satisfy pyproject.toml's ranges, and every dependency on the device's platform is either
    pinned there or one the device machine already holds."""
    import tomllib

    from packaging.requirements import Requirement

    spec = importlib.util.spec_from_file_location("fetch_wheels", ROOT / "benchmarks" / "gpu" / "fetch_wheels.py")
    assert spec is not None and spec.loader is not None
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    device = {"sys_platform": "linux", "platform_machine": "x86_64", "python_version": fetch.DEVICE_PYTHON}
    deps = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    needed = {r.name.lower(): r for r in deps if r.marker is None or r.marker.evaluate(device)}
    assert needed.keys() <= fetch.DEVICE_PINS.keys() | fetch.DEVICE_HAS
    for name, version in fetch.DEVICE_PINS.items():
        if name in needed:
            assert needed[name].specifier.contains(version), (name, version, str(needed[name].specifier))
    assert fetch.requirement_name("numba>=0.68.1,<0.70") == "numba"
    assert fetch.requirement_name("isal>=1.6; sys_platform == 'linux'") == "isal"
