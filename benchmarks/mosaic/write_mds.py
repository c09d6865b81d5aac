"""Write the benchmark's JPEG images in Mosaic streaming's MDS format and upload them to an S3 store.

Runs in Mosaic's own environment (``benchmarks/mosaic/setup_env.sh``)::

    benchmarks/mosaic/.venv/bin/python benchmarks/mosaic/write_mds.py \\
        --input DIR --remote s3://BUCKET/PREFIX --endpoint http://127.0.0.1:PORT [--shard-mb 64]

The input is a folder that any Python can write (:func:`save_blobs`, stdlib only)::

    DIR/jpegs.bin    the JPEG files' bytes, one after another
    DIR/index.json   {"format": "jpeg-blobs/1", "offsets": [0, n0, n0+n1, ...], "labels": [int, ...]}

``offsets`` has one more entry than ``labels``: image ``i`` is ``jpegs.bin[offsets[i]:offsets[i+1]]``.

The MDS columns are ``image: jpeg`` and ``label: int``. Mosaic's ``jpeg`` encoding
decodes with Pillow (``Image.open``) when a sample is read, as its image users do;
it stores a Pillow image's original file bytes when the image was opened from a
file, and re-encodes it otherwise (quality 75). So each JPEG is opened from a
file here (one scratch file, rewritten for each image) and the shards hold the
input's bytes unchanged: the check at the end reads the local copy back and
compares bytes and labels. ``MDSWriter(out=(local, remote))`` uploads each shard
as it is finished and the index last, through boto3 at ``S3_ENDPOINT_URL``
(what streaming reads; ``AWS_ENDPOINT_URL`` is set too). Shards are uncompressed,
at most ``--shard-mb`` MB each (Mosaic's default, 64 MB, is the default here).

Prints one JSON line: samples, shards, the shards' bytes, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FORMAT = "jpeg-blobs/1"


def save_blobs(folder: str | os.PathLike[str], blobs: Sequence[bytes], labels: Sequence[int]) -> Path:
    """Write JPEG ``blobs`` and their int ``labels`` as this script's input folder (stdlib only)."""
    if len(blobs) != len(labels):
        raise ValueError(f"{len(blobs)} images but {len(labels)} labels")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    offsets = [0]
    with open(out / "jpegs.bin", "wb") as fh:
        for b in blobs:
            fh.write(b)
            offsets.append(offsets[-1] + len(b))
    (out / "index.json").write_text(json.dumps({"format": FORMAT, "offsets": offsets, "labels": [int(y) for y in labels]}))
    return out


def load_blobs(folder: str | os.PathLike[str]) -> tuple[memoryview, list[int], list[int]]:
    """The input folder's bytes (one buffer), offsets and labels."""
    meta = json.loads((Path(folder) / "index.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{folder}/index.json: format {meta.get('format')!r}, expected {FORMAT!r}")
    offsets, labels = meta["offsets"], meta["labels"]
    if len(offsets) != len(labels) + 1:
        raise ValueError(f"{folder}/index.json: {len(offsets)} offsets for {len(labels)} labels (expected one more)")
    data = memoryview((Path(folder) / "jpegs.bin").read_bytes())
    if offsets[-1] != len(data):
        raise ValueError(f"{folder}/jpegs.bin has {len(data)} bytes, index.json says {offsets[-1]}")
    return data, offsets, labels


def set_endpoint(endpoint: str | None) -> None:
    """Point boto3 (and so streaming) at an S3-compatible endpoint; dummy keys when none are set."""
    if endpoint:
        os.environ["S3_ENDPOINT_URL"] = endpoint  # what streaming passes to boto3 as endpoint_url
        os.environ["AWS_ENDPOINT_URL"] = endpoint  # what boto3 reads itself
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


def write(inp: Path, remote: str, local: Path, shard_mb: float, check: bool = True) -> dict[str, Any]:
    from PIL import Image
    from streaming import MDSWriter

    data, offsets, labels = load_blobs(inp)
    t0 = time.perf_counter()
    if local.exists():
        shutil.rmtree(local)
    with tempfile.TemporaryDirectory(prefix="mds-scratch-") as scratch:
        path = os.path.join(scratch, "image.jpg")
        with MDSWriter(
            out=(os.fspath(local), remote), columns={"image": "jpeg", "label": "int"}, size_limit=int(shard_mb * 2**20), keep_local=True
        ) as writer:
            for i, label in enumerate(labels):
                with open(path, "wb") as fh:
                    fh.write(data[offsets[i] : offsets[i + 1]])
                with Image.open(path) as img:  # a file-backed JpegImageFile: the jpeg encoding copies the file's bytes
                    if img.format != "JPEG":
                        raise ValueError(f"image {i} is {img.format}, not JPEG")
                    writer.write({"image": img, "label": int(label)})
    seconds = time.perf_counter() - t0
    index = json.loads((local / "index.json").read_text())
    shards = index["shards"]
    result = {
        "samples": len(labels),
        "shards": len(shards),
        "shard_bytes": sum(s["raw_data"]["bytes"] for s in shards),
        "max_shard_bytes": max(s["raw_data"]["bytes"] for s in shards),
        "jpeg_bytes": offsets[-1],
        "seconds": round(seconds, 3),
        "remote": remote,
    }
    if check:
        result["checked"] = check_local(local, data, offsets, labels)
    return result


def check_local(local: Path, data: memoryview, offsets: list[int], labels: list[int]) -> int:
    """Read the local copy back with Mosaic's reader: every sample's JPEG bytes and label as written."""
    from streaming import LocalDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = LocalDataset(os.fspath(local))
    if len(ds) != len(labels):
        raise AssertionError(f"MDS copy has {len(ds)} samples, input {len(labels)}")
    for i in range(len(labels)):
        sample = ds[i]
        img = sample["image"]
        img.fp.seek(0)
        if img.fp.read() != data[offsets[i] : offsets[i + 1]] or int(sample["label"]) != labels[i]:
            raise AssertionError(f"sample {i}: the MDS copy differs from the input")
    return len(labels)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input", type=Path, required=True, help="folder with jpegs.bin and index.json (see the module's doc)")
    ap.add_argument("--remote", required=True, help="s3://bucket/prefix to upload to")
    ap.add_argument("--endpoint", help="S3-compatible endpoint, e.g. http://127.0.0.1:PORT")
    ap.add_argument("--local", type=Path, help="where the shards are written before upload (default: a temporary folder, removed)")
    ap.add_argument("--shard-mb", type=float, default=64.0, help="MDSWriter size_limit [MB = 2**20 bytes] (default 64)")
    ap.add_argument("--no-check", action="store_true", help="skip reading the local copy back")
    args = ap.parse_args(argv)
    set_endpoint(args.endpoint)
    if args.local is not None:
        result = write(args.input, args.remote, args.local, args.shard_mb, not args.no_check)
    else:
        with tempfile.TemporaryDirectory(prefix="mds-out-") as tmp:
            result = write(args.input, args.remote, Path(tmp) / "mds", args.shard_mb, not args.no_check)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
