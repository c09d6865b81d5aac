"""Loading libjpeg-turbo: the file the pinned wheel bundles, and every TurboJPEG 3 function checked at load."""

from __future__ import annotations

import ctypes.util
import importlib.metadata
from pathlib import Path

import pytest

from stoker.errors import PipelineError
from stoker.image import _turbojpeg
from stoker.image._turbojpeg import KERNEL_FUNCTIONS, TurboJPEG


def test_the_library_is_the_file_the_wheel_declares() -> None:
    path = _turbojpeg._library_path()
    assert path is not None
    assert Path(path).is_file()
    assert Path(path).parent.name == "turbojpeg.libs" and Path(path).name.startswith("libturbojpeg")
    declared = {str(f.locate()) for f in importlib.metadata.files("turbojpeg") or ()}
    assert path in declared


def test_pyproject_pins_the_wheel_whose_layout_is_used() -> None:
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    (line,) = [s for s in pyproject.splitlines() if s.strip().startswith('"turbojpeg')]
    assert '"turbojpeg==0.0.2;' in line
    assert importlib.metadata.version("turbojpeg") == "0.0.2"


def test_no_wheel_means_no_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_turbojpeg, "DISTRIBUTION", "no-such-distribution-stoker-test")
    assert _turbojpeg._library_path() is None


def test_every_function_is_found_and_handles_work() -> None:
    tj = TurboJPEG.load()
    assert tj is not None
    pointers = tj.kernel_pointers()
    assert len(pointers) == len(KERNEL_FUNCTIONS) and all(pointers)
    handles = tj.new_handles(3, fast_dct=True, fast_upsample=False)
    assert len(set(handles)) == 3 and all(handles)
    tj.destroy_handles(handles)


def test_a_missing_function_is_named_with_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    path = _turbojpeg._library_path()
    assert path is not None
    extra = ("tj3NoSuchFunction", [ctypes.c_size_t], ctypes.c_int)
    monkeypatch.setattr(_turbojpeg, "_FUNCTIONS", (*_turbojpeg._FUNCTIONS, extra))
    with pytest.raises(PipelineError, match=f"libjpeg-turbo at {path} has no function tj3NoSuchFunction: .*TurboJPEG 3"):
        TurboJPEG(path)


def test_a_library_without_turbojpeg_3_is_refused() -> None:
    libc = ctypes.util.find_library("c")
    if libc is None:
        pytest.skip("no C library to load")
    with pytest.raises(PipelineError, match=f"libjpeg-turbo at {libc} has no function tj3Init"):
        TurboJPEG(libc)


def test_a_library_that_does_not_load_is_refused(tmp_path: Path) -> None:
    bogus = tmp_path / "libturbojpeg.so.0"
    bogus.write_bytes(b"not a shared library")
    with pytest.raises(PipelineError, match=f"libjpeg-turbo at {bogus} cannot be loaded"):
        TurboJPEG(str(bogus))
