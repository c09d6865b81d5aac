"""Clear words at the edge: no credentials, URLs as the user wrote them, store errors as themselves, inspect of a URL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from benchmarks._servers.loopback import S3Server, free_port

from stoker import Loader
from stoker.dataset._manifest import MANIFEST_NAME
from stoker.dataset.shards import write_shards
from stoker.errors import DatasetFormatError, RemoteError, RemotePermissionError
from stoker.fields import IntField
from stoker.remote import open_store
from tests.remote.conftest import options

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An environment without AWS credentials (and a home without ~/.aws)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
                 "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_SKIP_SIGNATURE",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))


@pytest.mark.parametrize("how", ["endpoint", "metadata disabled"])
def test_no_credentials_says_so_and_how_to_give_them(no_credentials: None, s3: S3Server, tmp_path: Path, how: str) -> None:
    """Where an endpoint is configured, or AWS_EC2_METADATA_DISABLED is set, the instance-metadata service is never
    asked: the store is refused at once with 'no credentials found' and the ways to give them."""
    given = {"endpoint": s3.endpoint} if how == "endpoint" else {"region": "us-east-1"}
    with pytest.raises(RemoteError) as info:
        Loader("s3://stoker-test/some/data/", batch_size=8, cache_dir=tmp_path, storage_options=given)
    text = str(info.value)
    assert text.startswith("s3://stoker-test/some/data/: no credentials found")
    assert "AWS_ACCESS_KEY_ID" in text and "AWS_PROFILE" in text and "'skip_signature': True" in text
    assert "169.254" not in text


def test_an_instance_metadata_failure_reads_no_credentials_found(no_credentials: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine that may have an instance-metadata service (no endpoint, not disabled), its failure is told as
    'no credentials found', not as a request to its address (here a closed local port stands for the service)."""
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED", raising=False)
    store = open_store("s3://stoker-test/p/", {"region": "us-east-1", "metadata_endpoint": f"http://127.0.0.1:{free_port()}"})
    with pytest.raises(RemoteError) as info:
        store.read("x")
    text = str(info.value)
    assert text.startswith("s3://stoker-test/p/x: read: no credentials found") and "/latest/api/token" not in text
    assert store.stats()["retries"] == 0  # not a transient error


def test_skip_signature_asks_without_credentials(no_credentials: None, s3: S3Server) -> None:
    """skip_signature (a public bucket): no credentials are needed; a private bucket then answers 403, said as such."""
    open_store(s3.url("public/"), options(s3.endpoint)).write("x", b"hello")
    anonymous = open_store(s3.url("public/"), {"endpoint": s3.endpoint, "skip_signature": True})
    with pytest.raises(RemotePermissionError, match=r"^s3://stoker-test/public/x: read: permission denied"):
        anonymous.read("x")  # (moto's bucket is private)


@pytest.fixture(scope="module")
def dataset(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("edge") / "ds"
    write_shards(folder, {"y": IntField()}, {"y": np.arange(300)}, samples_per_shard=100, num_workers=1, progress=False)
    store = open_store(s3.url("edge-ds/"), options(s3.endpoint))
    for p in sorted(folder.iterdir()):
        if p.name != MANIFEST_NAME:
            store.upload(p.name, p)
    store.upload(MANIFEST_NAME, folder / MANIFEST_NAME)
    return s3.url("edge-ds/")


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stoker", *args], capture_output=True, text=True, env=env, timeout=300)


def test_inspect_takes_a_url(dataset: str, s3: S3Server, tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT / "src"), "STOKER_CACHE_DIR": str(tmp_path / "c"),
           "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b", "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3.endpoint}  # fmt: skip
    done = _cli("inspect", dataset, "--verify", env=env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"url:            {dataset}" in out and "shards:         3" in out and "samples:        300" in out
    assert "all checksums OK (3 shards checked" in out
    missing = _cli("inspect", s3.url("nothing-here/"), env=env)
    assert missing.returncode == 1, missing.stderr
    assert missing.stderr.startswith(f"stoker inspect: error: {s3.url('nothing-here/')}{MANIFEST_NAME}: read: no such object")
    assert "No such file or directory" not in missing.stderr and "s3:/stoker" not in missing.stderr


def test_a_corrupt_head_is_named_by_its_url(s3: S3Server, dataset: str, tmp_path: Path) -> None:
    """A shard whose field table is corrupt (its header intact): the error names the shard's URL, not the local copy."""
    source = open_store(dataset, options(s3.endpoint))
    manifest = json.loads(source.read(MANIFEST_NAME))
    name = manifest["shards"][1]["name"]
    data = bytearray(source.read(name))
    data[300] ^= 0xFF  # in the field table (it starts at byte 256)
    target = open_store(s3.url("edge-corrupt-head/"), options(s3.endpoint))
    for entry in manifest["shards"]:
        target.write(entry["name"], bytes(data) if entry["name"] == name else source.read(entry["name"]))
    target.write(MANIFEST_NAME, json.dumps(manifest).encode())
    with (
        Loader(target.url, batch_size=8, cache_dir=tmp_path, storage_options=options(s3.endpoint)) as loader,
        pytest.raises(DatasetFormatError) as info,
    ):
        for _ in loader:  # (the open reads the first head; a batch of shard 1 reads its head first)
            pass
    assert str(info.value).startswith(f"{target.url}{name}: ")
