"""What a writer leaves behind in the store and in ``$TMPDIR``: nothing, however it ends.

A writer killed outright (SIGKILL) in the middle of a multipart upload cannot abort it, nor remove its staging folder
(``$TMPDIR/stoker-upload-*``): the next write into the dataset does both (the uploads under the dataset's prefix older
than the retention, S3's ``ListMultipartUploads``; the staging folders whose writer is gone). A previous manifest that
this stoker cannot read (a newer version, or a corrupt one) may name any shard: a rewrite deletes none of them.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
from benchmarks._servers.loopback import LatencyProxy, S3Server
from hypothesis import given, settings
from hypothesis import strategies as st

import stoker
from stoker.dataset._manifest import MANIFEST_NAME, MANIFEST_VERSION
from stoker.dataset.shards import write_shards
from stoker.errors import RemoteError
from stoker.fields import IntField, NDArrayField
from stoker.remote import open_store
from tests.remote.conftest import options

boto3 = pytest.importorskip("boto3")

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"x": NDArrayField(np.dtype("float32"), (64,)), "y": IntField()}

# one shard of 7 samples of 1 MiB: over obstore's 5 MiB multipart threshold, uploaded in 2 parts
_KILLED = """
import sys
import numpy as np
from stoker.fields import IntField, NDArrayField
from stoker.dataset.shards import write_shards
from stoker.errors import RemoteError
url, endpoint = sys.argv[1:3]
opts = {"endpoint": endpoint, "access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}
x = np.ones((7, 1 << 18), np.float32)
write_shards(url, {"x": NDArrayField(np.dtype("float32"), (1 << 18,)), "y": IntField()}, {"x": x, "y": np.arange(7)},
             samples_per_shard=10, num_workers=1, progress=False, storage_options=opts)
"""


def _uploads(s3: S3Server, prefix: str) -> list[dict[str, Any]]:
    """The multipart uploads in progress under ``prefix``, as an independent client (boto3) lists them."""
    client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")  # fmt: skip
    return list(client.list_multipart_uploads(Bucket=s3.bucket, Prefix=prefix).get("Uploads", []))


def _staging(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("stoker-upload-*"))


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private ``$TMPDIR`` for this process (and the children it starts)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    yield tmp


def test_a_writer_killed_mid_upload_leaves_nothing_after_the_next_write(s3: S3Server, prefix: str, private_tmp: Path) -> None:
    """SIGKILL while a shard's multipart upload runs (slowed to 1 MB/s by a proxy, so that it is in progress): its
    upload and its staging folder are left; one later write with ``retention=0`` aborts the one and removes the other."""
    url = s3.url(prefix)
    with LatencyProxy(s3.host, s3.port, bandwidth=1e6) as slow:
        child = _start_writer(url, slow.endpoint)
        try:
            _wait_for_upload(s3, prefix, child)
        finally:
            child.send_signal(signal.SIGKILL)
            _, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, err
    assert len(_uploads(s3, prefix)) == 1, err  # the killed writer's upload, in progress
    assert len(_staging(private_tmp)) == 1  # and its staging folder, with the shard
    write_shards(url, SMALL, {"x": np.zeros((10, 64), np.float32), "y": np.arange(10)}, samples_per_shard=5, num_workers=1,
                 progress=False, storage_options=options(s3.endpoint, retention=0))  # fmt: skip
    assert _uploads(s3, prefix) == []
    assert _staging(private_tmp) == []


def _start_writer(url: str, endpoint: str) -> subprocess.Popen[str]:
    package = Path(stoker.__file__).resolve().parents[1]  # the child runs the stoker this process runs
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package), str(ROOT)])}
    return subprocess.Popen([sys.executable, "-c", _KILLED, url, endpoint], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip


def _wait_for_upload(s3: S3Server, prefix: str, child: subprocess.Popen[str] | None = None) -> None:
    deadline = time.monotonic() + 60  # (generous: a child imports stoker, encodes 7 MiB, starts the upload)
    while not _uploads(s3, prefix) and (child is None or child.poll() is None) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_writer_interrupted_mid_upload_aborts_it_and_removes_its_staging_folder(s3: S3Server, prefix: str, private_tmp: Path) -> None:
    """Ctrl-C (SIGINT) while a shard's multipart upload runs: the writer ends with KeyboardInterrupt, leaving no upload
    in progress and no staging folder, with no later write."""
    url = s3.url(prefix)
    with LatencyProxy(s3.host, s3.port, bandwidth=1e6) as slow:
        child = _start_writer(url, slow.endpoint)
        try:
            _wait_for_upload(s3, prefix, child)
            child.send_signal(signal.SIGINT)
            _, err = child.communicate(timeout=120)
        finally:
            if child.poll() is None:
                child.kill()
                child.communicate()
    assert "KeyboardInterrupt" in err, err
    assert _uploads(s3, prefix) == []
    assert _staging(private_tmp) == []


def test_a_write_whose_upload_fails_aborts_it_and_removes_its_staging_folder(s3: S3Server, prefix: str, private_tmp: Path) -> None:
    """A request of a shard's multipart upload refused (403 from the proxy, once the upload is in progress): the write
    raises, and leaves no upload in progress and no staging folder."""
    url = s3.url(prefix)
    big = {"x": NDArrayField(np.dtype("float32"), (1 << 18,)), "y": IntField()}
    with LatencyProxy(s3.host, s3.port, bandwidth=2e6) as slow:
        refuse = threading.Thread(target=lambda: (_wait_for_upload(s3, prefix), slow.fail_next(1, 403, "AccessDenied")))
        refuse.start()
        try:
            with pytest.raises(RemoteError):
                write_shards(url, big, {"x": np.ones((7, 1 << 18), np.float32), "y": np.arange(7)}, samples_per_shard=10,
                             num_workers=1, progress=False, storage_options=options(slow.endpoint, max_attempts=1))  # fmt: skip
        finally:
            refuse.join()
    assert _uploads(s3, prefix) == []
    assert _staging(private_tmp) == []


def _newer(manifest: bytes) -> bytes:
    data = json.loads(manifest)
    data["stoker_manifest"] = MANIFEST_VERSION + 1
    data["written_by"] = "a newer stoker"
    return json.dumps(data).encode()


@pytest.mark.parametrize("kind", ["newer", "corrupt"])
def test_a_rewrite_deletes_no_shard_of_a_manifest_it_cannot_read(
    s3: S3Server, prefix: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest from a newer stoker (or a corrupt one) beside a rewrite with ``retention=0``: every shard it may name
    survives the rewrite (kept as retired, for the jobs reading it), and the rewrite says why."""
    url = s3.url(prefix)
    store = open_store(url, options(s3.endpoint))
    arrays = {"x": np.zeros((10, 64), np.float32), "y": np.arange(10)}
    write_shards(url, SMALL, arrays, samples_per_shard=5, num_workers=1, progress=False, storage_options=options(s3.endpoint))
    old = {k for k in store.list("shard-")}
    assert len(old) == 2
    published = store.read(MANIFEST_NAME)
    store.write(MANIFEST_NAME, _newer(published) if kind == "newer" else published[: len(published) // 2])
    with caplog.at_level(logging.WARNING, logger="stoker"):
        write_shards(url, SMALL, arrays, samples_per_shard=5, num_workers=1, progress=False,
                     storage_options=options(s3.endpoint, retention=0))  # fmt: skip
    assert old <= set(store.list("shard-"))
    manifest = json.loads(store.read(MANIFEST_NAME))
    assert set(manifest["retired"][0]["shards"]) == old
    assert any(url + MANIFEST_NAME in r.getMessage() and "cannot read" in r.getMessage() for r in caplog.records)


_KEY = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_./", min_size=1, max_size=40)


@settings(max_examples=25, deadline=None)
@given(
    prefix=st.sampled_from([None, "", "train", "a/b/c/"]),
    key=_KEY,
    upload_id=st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+/=._-", min_size=1, max_size=60),
    token=st.sampled_from(["", "FwoGZXIvYXdzE/+token=="]),
    region=st.sampled_from(["us-east-1", "eu-west-3"]),
    seconds=st.integers(0, 2**31),
)
def test_the_list_and_abort_requests_are_signed_as_botocore_signs_them(
    prefix: str | None, key: str, upload_id: str, token: str, region: str, seconds: int
) -> None:
    """The SigV4 signatures of ``ListMultipartUploads`` and ``AbortMultipartUpload`` are those botocore (the AWS SDK's
    signer) computes for the same requests, credentials and time."""
    botocore_auth = pytest.importorskip("botocore.auth")
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from stoker.remote._multipart import MultipartClient, _query

    secret = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"
    config = {"bucket": "bkt", "access_key_id": "AKIDEXAMPLE", "secret_access_key": secret, "session_token": token, "region": region,
              "endpoint": "http://127.0.0.1:9000"}  # fmt: skip
    client = MultipartClient(config, prefix)
    now = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    requests = [("GET", client.path + "/", {"uploads": "", "prefix": client.prefix + key}),
                ("DELETE", client.path + "/" + quote(client.prefix + key, safe="/~"), {"uploadId": upload_id})]  # fmt: skip
    for method, path, query in requests:
        mine = client.sign(method, path, query, now)
        request = AWSRequest(method=method, url=f"http://127.0.0.1:9000{path}?{_query(query)}",
                             headers={"x-amz-content-sha256": mine["x-amz-content-sha256"], "X-Amz-Date": stamp})  # fmt: skip
        if token:
            request.headers["X-Amz-Security-Token"] = token
        request.context["timestamp"] = stamp
        auth = botocore_auth.S3SigV4Auth(Credentials("AKIDEXAMPLE", secret, token or None), "s3", region)
        signature = auth.signature(auth.string_to_sign(request, auth.canonical_request(request)), request)
        assert mine["Authorization"].endswith(f"Signature={signature}")
        assert f"SignedHeaders={auth.signed_headers(auth.headers_to_sign(request))}," in mine["Authorization"]
