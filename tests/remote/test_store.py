"""stoker.remote's Store against real servers on loopback: moto's S3 server and an HTTP server with ranges."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks._servers.loopback import LatencyProxy, RangeHTTPServer, S3Server

from stoker.errors import RemoteError, RemoteNotFoundError, RemotePermissionError, StokerError
from stoker.remote import is_url, open_store
from stoker.remote._store import aws_options, printable_url
from tests.remote.conftest import SECRET, options


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("s3://b/p/", True),
        ("gs://b/p", True),
        ("az://c/p", True),
        ("abfs://c@acct.dfs.core.windows.net/p", True),
        ("http://h/p", True),
        ("HTTPS://h/p", True),
        ("/local/folder", False),
        ("file:///x", False),
        ("s3:/nope", False),
        (Path("s3://b"), False),
        (None, False),
    ],
)
def test_is_url(source: object, expected: bool) -> None:
    assert is_url(source) is expected


def test_a_local_path_with_a_colon_slash_slash_is_local_for_every_opener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One URL test (the store's is_url) for a dataset, a mix and the store: ``odd://data`` names no store, so it is
    the local folder ``odd:/data`` (POSIX folds the ``//``) for open_dataset and open_mixed alike (issue 46)."""
    import numpy as np

    from stoker.dataset import open_dataset, write_shards
    from stoker.dataset.mixed import open_mixed
    from stoker.fields import IntField

    write_shards(tmp_path / "odd:" / "data", {"y": IntField()}, {"y": np.arange(30)}, samples_per_shard=10, num_workers=1,
                 progress=False)  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert not is_url("odd://data")
    with open_dataset("odd://data") as one, open_mixed(["odd://data"], ["odd"]) as mix:
        assert len(one) == len(mix) == 30 and mix.read(29) == one.read(29)


def test_printable_url_strips_credentials() -> None:
    assert printable_url("https://user:pw@host/a/b?sig=xyz&token=abc") == "https://host/a/b"


def test_round_trip(store, tmp_path: Path) -> None:
    data = os.urandom(300_000)
    store.write("a.bin", data)
    assert store.read("a.bin") == data
    assert store.size("a.bin") == len(data)
    assert store.read_range("a.bin", 10, 20) == data[10:20]
    assert store.read_range("a.bin", len(data) - 5, len(data) + 100) == data[-5:]
    assert store.read_range("a.bin", 7, 7) == b""
    dest = tmp_path / "a.part"
    assert store.download("a.bin", dest) == len(data)
    assert dest.read_bytes() == data
    # a larger object than expected: no more than `size` bytes written, and a mismatch returned
    assert store.download("a.bin", dest, size=1000) == 1001
    assert dest.stat().st_size == 1000
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(12 << 20))  # multipart upload (parts of 5 MiB)
    store.upload("big.bin", big)
    assert store.read("big.bin") == big.read_bytes()
    assert store.list() == ["a.bin", "big.bin"]
    store.delete("a.bin")
    store.delete("a.bin")  # deleting a missing object is not an error
    assert store.list() == ["big.bin"]
    stats = store.stats()
    assert stats["bytes_uploaded"] == len(data) + (12 << 20)
    assert stats["bytes_downloaded"] >= 2 * len(data) + (12 << 20)
    assert stats["retries"] == 0
    assert store.url.startswith("s3://stoker-test/t-") and store.url.endswith("/")


def test_missing_object_is_named_without_credentials(store) -> None:
    with pytest.raises(RemoteNotFoundError) as info:
        store.read("nope.bin")
    message = str(info.value)
    assert f"{store.url}nope.bin" in message
    assert SECRET not in message and "testing" not in message
    assert isinstance(info.value, StokerError)
    assert store.stats()["retries"] == 0


def test_denied_is_not_retried(store, proxy: LatencyProxy) -> None:
    store.write("x", b"abc")
    proxy.fail_next(1, 403, "AccessDenied")
    with pytest.raises(RemotePermissionError) as info:
        store.read("x")
    assert f"{store.url}x" in str(info.value) and SECRET not in str(info.value)
    assert store.stats()["retries"] == 0
    assert store.read("x") == b"abc"


def test_throttling_is_retried_and_counted(store, proxy: LatencyProxy, tmp_path: Path) -> None:
    store.write("x", b"abc" * 1000)
    proxy.fail_next(2)  # 503 SlowDown twice
    assert store.read("x") == b"abc" * 1000
    assert store.stats()["retries"] == 2
    proxy.fail_next(2, 500, "InternalError")
    assert store.download("x", tmp_path / "x") == 3000
    assert store.stats()["retries"] == 4
    proxy.fail_next(1, 429, "TooManyRequests")
    assert store.read_range("x", 0, 3) == b"abc"
    assert store.stats()["retries"] == 5


def test_a_download_cut_in_the_middle_resumes(s3: S3Server, store, prefix: str, tmp_path: Path) -> None:
    data = os.urandom(1_000_000)
    store.write("big", data)
    # at 300 kB/s the download needs more than 3 s; each request is cut after 2 s, and the next resumes
    with LatencyProxy(s3.host, s3.port, bandwidth=300_000) as slow:
        cut = open_store(s3.url(prefix), options(slow.endpoint, max_attempts=10, client_options={"timeout": "2s"}))
        assert cut.download("big", tmp_path / "big") == len(data)
        downloaded = slow.bytes_down
    assert (tmp_path / "big").read_bytes() == data
    assert cut.stats()["retries"] >= 1
    assert downloaded < 2 * len(data)  # resumed, not started over


def test_retries_give_up_after_max_attempts(s3: S3Server, proxy: LatencyProxy, prefix: str) -> None:
    store = open_store(s3.url(prefix), options(proxy.endpoint, max_attempts=3))
    store.write("x", b"abc")
    proxy.fail_next(3)
    with pytest.raises(RemoteError) as info:
        store.read("x")
    assert not isinstance(info.value, (RemoteNotFoundError, RemotePermissionError))
    assert "SlowDown" in str(info.value) and f"{store.url}x" in str(info.value)
    assert "after 3 attempts over" in str(info.value) and "max_attempts=3" in str(info.value)
    assert store.stats()["retries"] == 2


def test_connection_refused_is_an_error_without_secrets(prefix: str) -> None:
    from benchmarks._servers.loopback import free_port

    store = open_store(f"s3://stoker-test/{prefix}", options(f"http://127.0.0.1:{free_port()}", max_attempts=2))
    with pytest.raises(RemoteError) as info:
        store.read("x")
    assert SECRET not in str(info.value)
    assert store.stats()["retries"] == 1


def test_environment_is_read_as_the_aws_tools_do(tmp_path: Path) -> None:
    (tmp_path / "credentials").write_text(
        "[default]\naws_access_key_id = D\naws_secret_access_key = DS\n[work]\naws_access_key_id = W\naws_secret_access_key = WS\n"
    )
    (tmp_path / "config").write_text("[default]\nregion = eu-west-1\n[profile work]\nregion = us-west-2\nendpoint_url = http://work:9000\n")
    files = {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"), "AWS_CONFIG_FILE": str(tmp_path / "config")}
    assert aws_options(files) == {"access_key_id": "D", "secret_access_key": "DS", "region": "eu-west-1"}
    assert aws_options({**files, "AWS_PROFILE": "work"}) == {
        "access_key_id": "W",
        "secret_access_key": "WS",
        "region": "us-west-2",
        "endpoint": "http://work:9000",
    }
    env = {**files, "AWS_PROFILE": "work", "AWS_ACCESS_KEY_ID": "E", "AWS_SECRET_ACCESS_KEY": "ES", "AWS_SESSION_TOKEN": "T"}
    env.update(AWS_REGION="ap-south-1", AWS_ENDPOINT_URL="http://generic:1", AWS_ENDPOINT_URL_S3="http://s3only:2")
    assert aws_options(env) == {
        "access_key_id": "E",
        "secret_access_key": "ES",
        "session_token": "T",
        "region": "ap-south-1",
        "endpoint": "http://s3only:2",
    }


def test_open_store_uses_the_environment(s3: S3Server, proxy: LatencyProxy, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # overridden by the S3-specific one
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
    store = open_store(s3.url(prefix))
    store.write("k", b"v")
    assert store.read("k") == b"v"
    assert proxy.requests == 2


def test_http_store(http_server: RangeHTTPServer, tmp_path: Path) -> None:
    data = os.urandom(200_000)
    (tmp_path / "www" / "d").mkdir()
    (tmp_path / "www" / "d" / "s.bin").write_bytes(data)
    store = open_store(f"http://user:{SECRET}@127.0.0.1:{http_server.port}/d/", {"backoff": 0.01})
    assert store.url == f"http://127.0.0.1:{http_server.port}/d/"
    assert store.read("s.bin") == data
    assert store.read_range("s.bin", 1000, 1010) == data[1000:1010]
    assert store.size("s.bin") == len(data)
    assert store.download("s.bin", tmp_path / "s.part") == len(data)
    assert (tmp_path / "s.part").read_bytes() == data
    http_server.fail_next(2, 503)
    assert store.read_range("s.bin", 5, 9) == data[5:9]
    assert store.stats()["retries"] == 2
    with pytest.raises(RemoteNotFoundError, match=r"/d/missing\.bin") as missing:
        store.read("missing.bin")
    assert SECRET not in str(missing.value)  # the client's own message names the URL, user:password@ included
    http_server.fail_next(1, 403)
    with pytest.raises(RemotePermissionError):
        store.read("s.bin")
    with pytest.raises(RemoteError, match="read-only") as info:
        store.upload("new.bin", tmp_path / "s.part")
    assert SECRET not in str(info.value)


def test_other_stores_are_constructed() -> None:
    gcs = open_store("gs://bucket/train/", {"bucket": "bucket"})
    assert gcs.url == "gs://bucket/train/" and gcs.writable
    azure = open_store("az://container/train", {"account_name": "acct", "account_key": "a2V5"})
    assert azure.url == "az://container/train/"


def test_not_a_url() -> None:
    with pytest.raises(ValueError, match="not an object store URL"):
        open_store("/a/folder")


def test_stoker_does_not_import_the_client_and_the_hint_names_the_extra() -> None:
    code = (
        "import sys, stoker, stoker.remote, stoker.dataset.shards\n"
        "assert 'obstore' not in sys.modules, 'obstore imported'\n"
        "sys.modules['obstore'] = None\n"
        "from stoker.remote import open_store\n"
        "try:\n    open_store('s3://b/p/')\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert 'pip install "stoker[remote]"' in out
