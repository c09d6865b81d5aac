"""Generations that outlive their readers: a rewrite at a URL keeps what running jobs read, for the retention.

A job reads the version whose manifest it opened (its shards are downloaded epoch after epoch); a rewrite records
the generation it replaces as retired and keeps it for ``retention`` seconds; the first write after that deletes
it, and the leftovers of writes that never committed (a writer killed outright).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from benchmarks._servers.loopback import S3Server

from stoker import Loader, OrderOption
from stoker.dataset._manifest import MANIFEST_NAME
from stoker.dataset.shards import ShardedWriter, write_shards
from stoker.errors import RemoteNotFoundError
from stoker.fields import IntField, NDArrayField
from stoker.remote import Store
from tests.remote.conftest import options

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"x": NDArrayField(np.dtype("float32"), (64,)), "y": IntField()}


def _arrays(n: int, first: int) -> dict[str, Any]:
    return {"x": np.full((n, 64), first, dtype=np.float32), "y": np.arange(first, first + n, dtype=np.int64)}


def _write(url: str, endpoint: str, n: int, first: int, **storage: Any) -> dict[str, Any]:
    write_shards(url, FIELDS, _arrays(n, first), samples_per_shard=100, num_workers=1, progress=False,
                 storage_options=options(endpoint, **storage))  # fmt: skip
    return dict(json.loads(_read_manifest(url, endpoint)))


def _read_manifest(url: str, endpoint: str) -> bytes:
    from stoker.remote import open_store

    return open_store(url, options(endpoint)).read(MANIFEST_NAME)


def _shards(store: Store) -> set[str]:
    return {k for k in store.list() if k.startswith("shard-")}


def test_a_rewrite_during_an_epoch_lets_the_job_finish_on_its_version(s3: S3Server, store: Store, proxy: Any, tmp_path: Path) -> None:
    """Version 1 is read by a job whose cache holds 2 of its 6 shards; half-way through its epoch the dataset is
    rewritten (version 2): the job's epoch, and its next one, are version 1's samples, each once; a new Loader reads
    version 2."""
    url = store.url
    first = _write(url, proxy.endpoint, 600, 0)
    sizes = [e["file_size"] for e in first["shards"]]
    kw: dict[str, Any] = {"batch_size": 50, "num_workers": 2, "order": OrderOption.QUASI_RANDOM, "seed": 1, "chunk_size": 50}
    with Loader(url, cache_dir=tmp_path / "c", cache_limit=2 * max(sizes), download_ahead=1, storage_options=options(proxy.endpoint),
                **kw) as job:  # fmt: skip
        seen: list[int] = []
        for k, (_, y) in enumerate(job):
            seen += y.numpy().ravel().tolist()
            if k == 5:
                second = _write(url, proxy.endpoint, 300, 1000)  # a rewrite while the job reads
        assert sorted(seen) == list(range(600))
        assert sorted(v for _, y in job for v in y.numpy().ravel().tolist()) == list(range(600))  # the next epoch too
        assert job.stats()["remote"]["downloads"] > len(sizes)  # (it did download version 1's shards after the rewrite)
    assert second["generation"] != first["generation"]
    assert second["retired"] == [
        {"generation": first["generation"], "since": second["retired"][0]["since"], "shards": [e["name"] for e in first["shards"]]}
    ]
    with Loader(url, cache_dir=tmp_path / "c", storage_options=options(proxy.endpoint), **kw) as new:
        assert sorted(v for _, y in new for v in y.numpy().ravel().tolist()) == list(range(1000, 1300))


def test_a_retired_generation_is_deleted_by_the_first_write_after_its_retention(s3: S3Server, store: Store, proxy: Any) -> None:
    url = store.url
    one = _write(url, proxy.endpoint, 200, 0, retention=1.0)
    two = _write(url, proxy.endpoint, 200, 200, retention=1.0)  # one is retired, kept
    names = {g: {e["name"] for e in m["shards"]} for g, m in (("one", one), ("two", two))}
    assert _shards(store) == names["one"] | names["two"]
    time.sleep(1.2)
    three = _write(url, proxy.endpoint, 200, 400, retention=1.0)  # one's retention is over; two was retired just now
    assert _shards(store) == names["two"] | {e["name"] for e in three["shards"]}
    assert [r["generation"] for r in three["retired"]] == [two["generation"]]
    four = _write(url, proxy.endpoint, 200, 600, retention=0)  # no retention: what it replaces goes at once
    assert _shards(store) == {e["name"] for e in four["shards"]} and "retired" not in four


_KILLED = """
import sys, time
import numpy as np
from stoker.fields import IntField, NDArrayField
from stoker.dataset.shards import ShardedWriter
url, endpoint = sys.argv[1:3]

class Stalls:
    def __len__(self):
        return 400
    def __getitem__(self, i):
        if i == 250:  # shards 0 and 1 are uploaded by now
            print("stalled", flush=True)
            time.sleep(600)
        return np.zeros(64, np.float32), i

opts = {"endpoint": endpoint, "access_key_id": "a", "secret_access_key": "b", "region": "us-east-1"}
ShardedWriter(url, {"x": NDArrayField(np.dtype("float32"), (64,)), "y": IntField()}, samples_per_shard=100, num_workers=1,
              progress=False, storage_options=opts).from_indexed_dataset(Stalls())
"""


def test_the_leftovers_of_a_killed_write_are_deleted_after_the_retention(s3: S3Server, store: Store, proxy: Any, tmp_path: Path) -> None:
    """A writer killed outright (SIGKILL) after uploading two shards: no manifest names them; the next write keeps them
    while they are younger than the retention (they could be a write running now), the first write after deletes them."""
    url = store.url
    one = _write(url, proxy.endpoint, 200, 0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]), "TMPDIR": str(tmp_path)}
    child = subprocess.Popen([sys.executable, "-c", _KILLED, url, proxy.endpoint], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)  # fmt: skip
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "stalled", child.stderr.read() if child.stderr else ""
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=60)
    leftovers = _shards(store) - {e["name"] for e in one["shards"]}
    assert len(leftovers) == 2  # shards 0 and 1 of the killed write
    two = _write(url, proxy.endpoint, 200, 200, retention=3.0)  # (S3 times are whole seconds: a retention of a few)
    assert leftovers <= _shards(store)  # young: they could be a write running now
    time.sleep(3.2)
    three = _write(url, proxy.endpoint, 200, 400, retention=3.0)
    assert _shards(store) == {e["name"] for e in two["shards"]} | {e["name"] for e in three["shards"]}  # (one's retention is over)


def test_writing_to_a_missing_bucket_fails_before_anything_is_encoded(s3: S3Server, proxy: Any) -> None:
    encoded: list[int] = []

    class Dataset:
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
            encoded.append(i)
            return np.zeros(64, np.float32), i

    writer = ShardedWriter("s3://no-such-bucket/train/", FIELDS, samples_per_shard=5, num_workers=1, progress=False,
                           storage_options=options(proxy.endpoint))  # fmt: skip
    with pytest.raises(RemoteNotFoundError) as info:
        writer.from_indexed_dataset(Dataset(), chunksize=1)
    text = str(info.value)
    assert text.startswith("s3://no-such-bucket/train/: cannot write the dataset here")
    assert "the bucket 'no-such-bucket' does not exist; create it, or check the URL" in text
    assert encoded == []
