"""The shard cache touches only what it made (issue 43): user files in ``cache_dir`` survive loaders that fill and evict
it; a folder above the cache owned by another user is refused; a shard larger than the disk is the manifest's fault."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from benchmarks._servers.loopback import LatencyProxy, S3Server

from stoker import _cache_roots
from stoker.errors import DatasetFormatError, UnsafeCacheError
from stoker.remote import ShardCache, Store, open_store
from stoker.remote._cache_room import disk_bytes
from tests.remote.conftest import options

#: what a user keeps in the folder they give as cache_dir: names the cache used to take for its own, and others
PLANTED = {
    "heads/notes.txt": 1_000,  # an old stoker removed heads/ at every start
    "heads/sub/important.py": 2_000,
    "0123456789abcdef/checkpoint.pt": 3_000_000,  # 16 hex digits: an old stoker took it for another store's cache
    "0123456789abcdef/.model@1.4096.part": 100,  # a name of the cache's own, in a folder it did not make
    "fedcba9876543210/.a@1.lock": 0,
    "notes.txt": 500,
    ".hidden": 10,
    "mine/data.bin": 50_000,
}
LINK = "0123456789abcdef/latest"  # a link: an old stoker removed links in its folders


def _plant(cache: Path) -> dict[str, tuple[str, int, int]]:
    for name, size in PLANTED.items():
        (cache / name).parent.mkdir(parents=True, exist_ok=True)
        (cache / name).write_bytes(os.urandom(size))
    os.symlink("checkpoint.pt", cache / LINK)
    return _look(cache)


def _look(cache: Path) -> dict[str, tuple[str, int, int]]:
    """Each planted path: its bytes' hash (a link: its target), its inode and its mtime."""
    out = {}
    for name in [*PLANTED, LINK]:
        path = cache / name
        if os.path.lexists(path):
            st = os.lstat(path)
            what = os.readlink(path) if path.is_symlink() else hashlib.sha256(path.read_bytes()).hexdigest()
            out[name] = (what, st.st_ino, st.st_mtime_ns)
    return out


def test_user_files_in_cache_dir_survive_caches_that_fill_and_evict(
    s3: S3Server, proxy: LatencyProxy, store: Store, tmp_path: Path
) -> None:
    """Two stores' caches in one cache_dir, a limit of three objects, twelve objects each pinned in turn: every
    object evicts another, and 0 of the user's files are touched (nor counted: the checkpoint is larger than the limit)."""
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o700)
    before = _plant(cache_dir)
    other = open_store(s3.url(f"other-{tmp_path.name}/"), options(proxy.endpoint))
    size = 200_000
    for s in (store, other):
        for k in range(12):
            s.write(f"k{k}", os.urandom(size))
    limit = 3 * disk_bytes(size) + 4 * 4096
    caches = [ShardCache(s, cache_dir, limit=limit, wait=5.0) for s in (store, other)]
    for k in range(12):
        for cache in caches:
            cache.pin(f"k{k}", size)
            cache.unpin(f"k{k}")
            assert cache.usage_bytes() <= limit
    assert sum(c.stats()["evictions"] for c in caches) >= 18
    after = _look(cache_dir)
    touched = [name for name in before if after.get(name) != before[name]]
    assert touched == [], f"user files touched: {touched}"
    for cache in caches:
        cache.close()


def test_a_folder_named_as_the_cache_but_not_made_by_it_is_refused(store: Store, tmp_path: Path) -> None:
    """The store's own folder name, taken by a folder the cache did not make (no marker), holding a file: refused, the
    file left as it was; an empty one is taken."""
    name = hashlib.sha256(store.url.encode()).hexdigest()[:16]
    cache_dir = tmp_path / "cache"
    (cache_dir / name).mkdir(parents=True)
    (cache_dir / name / "mine.txt").write_bytes(b"keep")
    with pytest.raises(UnsafeCacheError, match=rf"{name}.*did not make it"):
        ShardCache(store, cache_dir, limit=10**6)
    assert (cache_dir / name / "mine.txt").read_bytes() == b"keep"
    (cache_dir / name / "mine.txt").unlink()
    assert ShardCache(store, cache_dir, limit=10**6).directory == cache_dir / name


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="making a folder of another user needs root")
def test_a_folder_above_the_cache_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    """A parent owned by another user (not root), writable only by that owner (0755): they can rename what it holds."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    mine = theirs / "mine"
    mine.mkdir(mode=0o700)
    assert _cache_roots.check_folder(mine) is None  # (owned by root: trusted)
    os.chown(theirs, 12345, 12345)
    problem = _cache_roots.check_folder(mine)
    assert problem is not None and str(theirs) in problem and "uid 12345" in problem
    with pytest.raises(UnsafeCacheError, match="belongs to another user"):
        _cache_roots.open_folder(mine / "cache")


def test_a_shard_larger_than_the_disk_is_the_manifests_error_not_the_limits(store: Store, tmp_path: Path) -> None:
    """2**48 bytes: the message names the object's URL and the manifest, and does not ask for a larger cache_limit."""
    for limit in (10**6, None):
        cache = ShardCache(store, tmp_path / "cache", limit=limit)
        with pytest.raises(DatasetFormatError, match=r"huge.*manifest gives it 281474976710656 bytes.*whole disk") as info:
            cache.pin("huge", 2**48)
        assert f"{store.url}huge" in str(info.value) and "cache_limit above" not in str(info.value)
