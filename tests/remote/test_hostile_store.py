"""A hostile or broken store: every manifest and head value is checked before use, with an error naming the URL and the field.

The dataset's shards are real; only the manifest (or one shard's object) is broken, in the store, as a broken or
hostile writer would leave it. Whatever the manifest holds, Loader() raises DatasetFormatError (or a RemoteError for
a shard it names that is not there), never a KeyError, TypeError or ValueError from deep inside.
"""

from __future__ import annotations

import contextlib
import copy
import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from benchmarks._servers.loopback import S3Server
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stoker import Loader
from stoker.dataset._manifest import MANIFEST_NAME
from stoker.dataset.shards import write_shards
from stoker.errors import DatasetFormatError, RemoteError
from stoker.fields import BytesField, IntField
from stoker.format import spec
from stoker.remote import Store, open_store
from tests.remote.conftest import options

FIELDS = {"y": IntField(), "blob": BytesField()}


@pytest.fixture(scope="module")
def good(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, bytes]]:
    """A valid manifest and its shards' bytes (2 shards)."""
    folder = tmp_path_factory.mktemp("hostile") / "ds"
    blobs = np.empty(300, dtype=object)
    blobs[:] = [bytes([i % 251]) * (i % 17) for i in range(300)]
    write_shards(folder, FIELDS, {"y": np.arange(300), "blob": blobs}, samples_per_shard=150, num_workers=1, progress=False)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    return manifest, {e["name"]: (folder / e["name"]).read_bytes() for e in manifest["shards"]}


def _publish(s3: S3Server, shards: dict[str, bytes], manifest: bytes) -> tuple[str, Store]:
    prefix = f"hostile-{uuid.uuid4().hex[:10]}/"
    store = open_store(s3.url(prefix), options(s3.endpoint))
    for name, data in shards.items():
        store.write(name, data)
    store.write(MANIFEST_NAME, manifest)
    return s3.url(prefix), store


def _open(s3: S3Server, url: str, tmp_path: Path) -> Loader:
    """The Loader, every shard's head read (the open reads the first; the others as batches need them: read them all)."""
    loader = Loader(url, batch_size=50, num_workers=1, cache_dir=tmp_path / "c", storage_options=options(s3.endpoint, max_attempts=2))
    try:
        loader.reader.read_heads()  # type: ignore[union-attr]
    except BaseException:
        loader.close()
        raise
    return loader


def _edit(manifest: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """``manifest`` with the value at ``path`` (``shards.0.file_size``) replaced; ``...`` deletes it."""
    out = copy.deepcopy(manifest)
    *parents, last = path.split(".")
    node: Any = out
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    key: Any = int(last) if isinstance(node, list) else last
    if value is ...:
        del node[key]
    else:
        node[key] = value
    return out


CASES = [
    ("shards.0.file_size", -5, "'shards[0].file_size': expected an int from 256 to 2**48 [bytes]; got -5"),
    ("shards.0.file_size", 2**60, "'shards[0].file_size': expected an int from 256"),
    ("shards.1.file_size", "4096", "'shards[1].file_size': expected an int"),
    ("shards.0.file_size", 1.5e3, "'shards[0].file_size': expected an int"),
    ("shards.1.header_crc", ..., "'shards[1].header_crc': missing"),
    ("shards.0.header_crc", 2**32, "'shards[0].header_crc': expected a CRC-32"),
    ("shards.0.name", "shard\x00.stoker", "'shards[0].name': expected a file name in the manifest's folder"),
    (
        "shards.0.name",
        "shard\x1f.stoker",
        "'shards[0].name': expected a file name in the manifest's folder",
    ),  # a control character: a key no store takes
    ("shards.0.name", "../secrets", "'shards[0].name': expected a file name"),
    ("shards.0.name", 7, "'shards[0].name': expected a file name (a string); got int"),
    ("shards.0.num_samples", True, "'shards[0].num_samples': expected an int >= 0"),
    ("shards.0.num_samples", -1, "'shards[0].num_samples': expected an int >= 0"),
    ("shards.0", ["a"], "'shards[0]': expected an object; got list"),
    ("shards", {"a": 1}, "'shards': expected a list of shards; got dict"),
    ("fields_sha256", None, "'fields_sha256': expected 64 hex digits"),
    ("generation", "../../x", "'generation': expected 8 hex digits"),
    ("num_samples", 10**6, "'num_samples': expected the sum of the shards' num_samples, 300"),
    ("stoker_manifest", ..., "'stoker_manifest': missing"),
]


@pytest.mark.parametrize(("path", "value", "message"), CASES, ids=[f"{c[0]}={c[1]!r:.20}" for c in CASES])
def test_a_malformed_manifest_is_refused_naming_the_url_and_the_field(s3: S3Server, good: tuple[dict[str, Any], dict[str, bytes]],
                                                                      tmp_path: Path, path: str, value: Any, message: str) -> None:  # fmt: skip
    manifest, shards = good
    url, _ = _publish(s3, shards, json.dumps(_edit(manifest, path, value)).encode())
    with pytest.raises(DatasetFormatError) as info:
        _open(s3, url, tmp_path)
    text = str(info.value)
    assert text.startswith(f"{url}{MANIFEST_NAME}: "), text  # the URL as written (never s3:/bucket/...)
    assert message in text


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        (b"\xff\xfe not json", "not UTF-8 JSON"),
        (b"[1, 2]", "expected a JSON object; got list"),
        (b'{"stoker_manifest": 7}', "manifest version 7"),
    ],
)
def test_a_manifest_that_is_not_one_is_refused(s3: S3Server, good: tuple[dict[str, Any], dict[str, bytes]], tmp_path: Path,
                                               manifest: bytes, message: str) -> None:  # fmt: skip
    url, _ = _publish(s3, good[1], manifest)
    with pytest.raises(DatasetFormatError, match=message) as info:
        _open(s3, url, tmp_path)
    assert str(info.value).startswith(f"{url}{MANIFEST_NAME}: ")


def test_an_oversized_manifest_is_not_read_whole(s3: S3Server, good: tuple[dict[str, Any], dict[str, bytes]], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from stoker.dataset import _remote

    monkeypatch.setattr(_remote, "MAX_MANIFEST_BYTES", 4096)
    manifest, shards = good
    url, _store = _publish(s3, shards, json.dumps({**manifest, "padding": "x" * 100_000}).encode())
    with pytest.raises(DatasetFormatError, match="the manifest is larger than 4096 bytes") as info:
        _open(s3, url, tmp_path)
    assert str(info.value).startswith(f"{url}{MANIFEST_NAME}: ")


def test_a_shard_whose_object_differs_from_the_manifest_is_refused(s3: S3Server, good: tuple[dict[str, Any], dict[str, bytes]],
                                                                   tmp_path: Path) -> None:  # fmt: skip
    """The object's size (from the first range answer) against the manifest's file_size, before anything is sized by it."""
    manifest, shards = good
    name = manifest["shards"][1]["name"]
    url, _store = _publish(s3, {**shards, name: shards[name] + b"tail"}, json.dumps(manifest).encode())
    with pytest.raises(DatasetFormatError) as info:
        _open(s3, url, tmp_path)
    size = manifest["shards"][1]["file_size"]
    assert str(info.value) == (
        f"{url}{name}: the object is {size + 4} bytes, the manifest's file_size says {size}: the shard was replaced, or the manifest is wrong"
    )


def _header_with(data: bytes, **values: int) -> bytes:
    """The shard ``data`` with header fields changed and the header's CRC made right again."""
    header = np.frombuffer(data[: spec.HEADER_SIZE], dtype=spec.HEADER_DTYPE).copy()
    for key, value in values.items():
        header[0][key] = value
    raw = bytearray(header.tobytes())
    raw[252:256] = spec.crc32(bytes(raw[:252])).to_bytes(4, "little")
    return bytes(raw) + data[spec.HEADER_SIZE :]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"data_offset": 1 << 40}, "header fields data_offset, checksum_offset out of order"),
        ({"checksum_offset": 100}, "header fields data_offset, checksum_offset out of order"),
        ({"file_size": 1 << 40}, "header field file_size: 1099511627776 bytes; the manifest says"),
    ],
)
def test_a_hostile_header_is_refused_before_it_sizes_a_read(s3: S3Server, good: tuple[dict[str, Any], dict[str, bytes]], tmp_path: Path,
                                                            values: dict[str, int], message: str) -> None:  # fmt: skip
    """A header whose CRC matches the manifest's record but whose offsets point anywhere: refused by name."""
    manifest, shards = good
    name = manifest["shards"][0]["name"]
    forged = _header_with(shards[name], **values)
    hostile = copy.deepcopy(manifest)
    hostile["shards"][0]["header_crc"] = int.from_bytes(forged[252:256], "little")
    url, _ = _publish(s3, {**shards, name: forged}, json.dumps(hostile).encode())
    with pytest.raises(DatasetFormatError, match=message) as info:
        _open(s3, url, tmp_path)
    assert str(info.value).startswith(f"{url}{name}: ")


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
_PATHS = ["stoker_manifest", "generation", "fields_sha256", "num_samples", "shards", "retired", "shards.0", "shards.0.name",
          "shards.0.num_samples", "shards.0.file_size", "shards.0.header_crc", "shards.1.name", "shards.1.file_size"]  # fmt: skip


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.sampled_from(_PATHS), _JSON | st.just(...)), min_size=1, max_size=3))
@example(edits=[("num_samples", ...), ("shards.0", ...)])  # a valid manifest of the second shard alone
@example(edits=[("shards.0", []), ("shards.0.name", 0)])  # a place whose parent an earlier edit made a list
def test_any_value_anywhere_in_the_manifest_is_refused_cleanly_or_read(s3: S3Server, good: tuple[dict[str, Any], dict[str, bytes]],
                                                                       tmp_path_factory: pytest.TempPathFactory,
                                                                       edits: list[tuple[str, Any]]) -> None:  # fmt: skip
    """Random values (of any JSON type, or deleted) at random places: the loader opens a valid manifest, and refuses
    any other with DatasetFormatError naming the URL (or RemoteError for a shard name the store does not hold)."""
    manifest, shards = good
    for path, value in edits:
        with contextlib.suppress(KeyError, IndexError, TypeError, ValueError):  # (the place is gone: an earlier edit replaced its parent)
            manifest = _edit(manifest, path, value)
    url, _ = _publish(s3, shards, json.dumps(manifest).encode())
    try:
        loader = _open(s3, url, tmp_path_factory.mktemp("c"))
    except DatasetFormatError as exc:
        assert str(exc).startswith(url), str(exc)
    except RemoteError as exc:
        assert str(exc).startswith(url) and "no such object" in str(exc), str(exc)
    else:  # a manifest the edits left valid (and true to its shards): the dataset it names, which may be fewer shards
        # (deleting `num_samples` and `shards.0` leaves a valid one-shard dataset)
        # (the samples each shard truly holds, from the good manifest: an edited count the loader accepted would not hide)
        holds = {e["name"]: range(150 * i, 150 * i + e["num_samples"]) for i, e in enumerate(good[0]["shards"])}
        named = sorted(v for e in manifest["shards"] for v in holds[e["name"]])
        with loader:
            assert sorted(int(v) for y, _ in loader for v in y.numpy().ravel()) == named
