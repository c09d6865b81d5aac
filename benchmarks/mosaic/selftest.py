"""End-to-end check of Mosaic's side of the benchmark, driven as the harness drives it.

Runs in stoker's environment (it uses ``benchmarks._servers.loopback``: moto's S3
server on 127.0.0.1 and the latency/bandwidth proxy), and runs the scripts in
Mosaic's (``benchmarks/mosaic/.venv``, made by ``setup_env.sh``) as subprocesses::

    .venv/bin/python benchmarks/mosaic/selftest.py [--images 2000] [--size 64] [--workers 2]

Makes small synthetic JPEGs (noise plus shapes), writes them as ``write_mds.py``'s
input, uploads the MDS copy straight to the server, then runs
``run_mosaic.py`` through the proxy (20 ms per request, 200 MB/s) and prints its
JSON line with the proxy's byte counter added (``proxy_bytes_down``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MOSAIC_PY = HERE / ".venv" / "bin" / "python"
sys.path.insert(0, os.fspath(HERE))
sys.path.insert(0, os.fspath(HERE.parent))  # benchmarks/: _servers

from write_mds import save_blobs  # noqa: E402


def synthetic_jpegs(n: int, size: int, seed: int = 0) -> tuple[list[bytes], list[int]]:
    """``n`` JPEGs (q90) of ``size`` x ``size``: a noisy background, a filled rectangle and an ellipse; labels 0..9."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    blobs, labels = [], []
    for _ in range(n):
        base = rng.integers(0, 256, 3)
        noise = rng.normal(0, 25, (size, size, 3))
        img = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(img)
        for shape in (draw.rectangle, draw.ellipse):
            x0, y0 = rng.integers(0, size // 2, 2)
            x1, y1 = rng.integers(size // 2, size, 2)
            shape((int(x0), int(y0), int(x1), int(y1)), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        blobs.append(buf.getvalue())
        labels.append(int(rng.integers(0, 10)))
    return blobs, labels


def run_json(cmd: list[str]) -> dict:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = round(time.perf_counter() - t, 3)
    return out


def check(cmd: list[str], tmp: Path, blobs: list[bytes], labels: list[int], crop: int) -> dict:
    """run_mosaic.py --verify-out: its centre-cropped batches equal Pillow's crop of the input JPEGs, labels included."""
    from PIL import Image

    out = tmp / "verify.npz"
    cache = cmd.index("--cache-dir") + 1
    run = [*cmd[:cache], os.fspath(tmp / "verify-cache"), *cmd[cache + 1 :], "--verify-out", os.fspath(out)]
    info = run_json(run)
    got = np.load(out)
    ratio = 224 / 256
    for image, label, i in zip(got["images"], got["labels"], got["ids"], strict=True):
        img = Image.open(io.BytesIO(blobs[i])).convert("RGB")
        c = max(1, int(ratio * min(img.height, img.width)))
        y, x = (img.height - c) // 2, (img.width - c) // 2
        want = np.asarray(img.resize((crop, crop), Image.Resampling.BILINEAR, box=(x, y, x + c, y + c))).transpose(2, 0, 1)
        if not np.array_equal(image, want) or int(label) != labels[i]:
            raise SystemExit(f"run_mosaic.py --verify-out: sample {i} differs from Pillow's decode and crop of the input")
    return {**info, "checked": len(got["ids"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--crop", type=int, default=224)
    ap.add_argument("--shard-mb", type=float, default=1.0, help="small shards so that a small dataset has several")
    ap.add_argument("--cache-limit", default=None, help="bytes; default: none")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--bandwidth", type=float, default=200e6)
    args = ap.parse_args(argv)
    if not MOSAIC_PY.exists():
        raise SystemExit(f"{MOSAIC_PY} is missing: run bash benchmarks/mosaic/setup_env.sh")
    from _servers.loopback import LatencyProxy, s3_server

    blobs, labels = synthetic_jpegs(args.images, args.size)
    with tempfile.TemporaryDirectory(prefix="mosaic-selftest-") as tmp:
        inp = save_blobs(Path(tmp) / "input", blobs, labels)
        with s3_server("mosaic-bench") as s3, LatencyProxy(s3.host, s3.port, latency_ms=args.latency_ms, bandwidth=args.bandwidth) as proxy:
            remote = s3.url("mds/train")
            wrote = run_json([
                os.fspath(MOSAIC_PY), os.fspath(HERE / "write_mds.py"), "--input", os.fspath(inp), "--remote", remote,
                "--endpoint", s3.endpoint, "--shard-mb", str(args.shard_mb),
            ])  # fmt: skip
            print(json.dumps({"write_mds": wrote}), flush=True)
            cmd = [
                os.fspath(MOSAIC_PY), os.fspath(HERE / "run_mosaic.py"), "--remote", remote, "--endpoint", proxy.endpoint,
                "--cache-dir", os.fspath(Path(tmp) / "cache"), "--batch-size", str(args.batch_size), "--workers", str(args.workers),
                "--epochs", "2", "--crop", str(args.crop),
            ]  # fmt: skip
            if args.cache_limit:
                cmd += ["--cache-limit", args.cache_limit]
            checked = check(cmd, Path(tmp), blobs, labels, args.crop)
            print(json.dumps({"verify": checked}), flush=True)
            down0 = proxy.bytes_down
            result = run_json(cmd)
            result["proxy_bytes_down"] = proxy.bytes_down - down0
            result["proxy_requests"] = proxy.requests
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
