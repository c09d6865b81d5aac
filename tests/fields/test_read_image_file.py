"""``RGBImageField`` reads an image file's bytes with one ``os.read``: whole files, whatever their size or kind."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.fields.rgb_image import _read_file


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=5000) | st.integers(0, 3).map(lambda k: bytes(range(256)) * (1 << (8 + 2 * k)) + b"end"))
def test_whole_file(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    path = tmp_path_factory.mktemp("read") / "f.jpg"
    path.write_bytes(data)
    assert _read_file(path) == data
    assert _read_file(str(path)) == data


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_a_file_without_a_size_is_read_to_its_end(tmp_path: Path) -> None:
    """A pipe reports size 0: reading goes on to its end (also more than one read's worth)."""
    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    payload = os.urandom(300_000)

    def feed() -> None:
        with open(fifo, "wb") as fh:
            fh.write(payload)

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        assert _read_file(fifo) == payload
    finally:
        writer.join(5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_proc_file() -> None:
    assert b"Name:" in _read_file("/proc/self/status")  # st_size 0, content there


def test_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read the image file .*missing\.jpg.*No such file"):
        _read_file(tmp_path / "missing.jpg")
    with pytest.raises(ValueError, match=r"cannot read the image file .*Is a directory"):
        _read_file(tmp_path)
