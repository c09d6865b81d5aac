"""Fill the wheel folder that ``benchmarks/gpu/run_device.sh`` installs from, from the package registries (pip).

Two targets:

* ``python3 benchmarks/gpu/fetch_wheels.py`` (the device, the default): wheels for the lent GPU machine, which
  reaches no registry. It is CPython 3.12 on x86-64 Linux with torch (CUDA), torchvision, numpy, pillow, tqdm, pytest
  and hypothesis already installed (``/work/.library/device/KINDS.md``); what it lacks of stoker's dependencies is
  :data:`DEVICE_PINS`, fetched with ``pip download --no-deps --python-version 3.12 --platform manylinux...`` into
  ``.whl/``. llvmlite's wheel is 60 MB and everything that travels to that machine may be 64 MiB: it is stored as
  a ``.tar.xz`` of the unpacked wheel (about 42 MB). ``--python-version`` for a device with another Python.
* ``python3 benchmarks/gpu/fetch_wheels.py --local`` (``run_device.sh --cpu``): every wheel the check's CPU mode
  needs, for the interpreter that runs this script, dependencies resolved by pip, into ``.whl-cpu/`` (never
  carried). torch: the interpreter's own when it imports; else a CPU build, from the PyTorch CPU index when it is
  reachable, else the newest ``+cpu`` build pip's configured indexes offer (a CUDA build would pull gigabytes of
  CUDA libraries); ``--torch SPEC`` names one.

The folder gets a ``FETCHED`` file (target, Python, files): ``run_device.sh`` fetches when it is missing.
Standard library only; ``pip`` is the interpreter's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: what the device lacks of stoker's dependencies, at the versions the suite runs with (``tests/bench/test_gpu_check.py``
#: checks that each satisfies ``pyproject.toml``'s range)
DEVICE_PINS = {
    "numba": "0.68.1",
    "llvmlite": "0.50.0",
    "simplejpeg": "1.9.0",
    "turbojpeg": "0.0.2",
    "isal": "1.9.1",
    "tbb": "2023.2.0",
    "tcmlib": "1.6.0",  # (tbb's own dependency)
}
#: stoker's dependencies the device machine's image already holds (KINDS.md: torch 2.11.0, numpy 2.5.2, ...)
DEVICE_HAS = {"torch", "numpy", "pillow", "tqdm"}
#: the Python of the device (KINDS.md: python3 is Python 3.12.3)
DEVICE_PYTHON = "3.12"
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (28, 27, 24, 17)] + ["manylinux2014_x86_64"]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def pip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``python -m pip ARGS``, its output kept (and shown when it fails)."""
    cmd = [sys.executable, "-m", "pip", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        noise = "WARNING: Location"  # a configured local index without that package: not the error
        err = "\n".join(line for line in (done.stdout + done.stderr).splitlines() if noise not in line)
        raise SystemExit(f"fetch_wheels: `pip {' '.join(args)}` failed (exit {done.returncode}):\n{err[-3000:]}")
    return done


def requirements() -> list[str]:
    """stoker's runtime requirements, as ``pyproject.toml`` lists them (markers included)."""
    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def requirement_name(req: str) -> str:
    """The distribution name of a requirement string: ``"numba>=0.68.1,<0.70"`` -> ``"numba"``."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if match is None:
        raise ValueError(f"not a requirement: {req!r}")
    return match.group(1).lower().replace("_", "-")


def repack_llvmlite(folder: Path) -> None:
    """Replace llvmlite's wheel in ``folder`` by a ``.tar.xz`` of its unpacked files (about 42 MB instead of 60)."""
    (wheel,) = folder.glob("llvmlite-*.whl")
    target = folder / (wheel.name.removesuffix(".whl") + ".tar.xz")
    print(f"  packing {wheel.name} as {target.name} (xz: a minute or two)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        zipfile.ZipFile(wheel).extractall(tmp)
        partial = target.with_suffix(".part")
        with tarfile.open(partial, "w:xz", preset=6) as tar:
            for entry in sorted(os.listdir(tmp)):
                tar.add(os.path.join(tmp, entry), arcname=entry)
        partial.replace(target)
    wheel.unlink()


def fetch_device(folder: Path, python_version: str) -> None:
    """The wheels the device lacks, for CPython ``python_version`` on x86-64 Linux, with no dependencies."""
    specs = [f"{name}=={version}" for name, version in DEVICE_PINS.items()]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    print(f"fetching for the device (CPython {python_version}, manylinux x86-64): {' '.join(specs)}", flush=True)
    pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
        *platforms, "-d", str(folder), *specs)  # fmt: skip
    repack_llvmlite(folder)


def is_cpu_build(wheel: Path) -> bool:
    """Whether a torch wheel needs no CUDA libraries (its metadata requires no ``nvidia-*`` or ``cuda-*`` package)."""
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        meta = z.read(name).decode()
    needs = [line for line in meta.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    return not any(re.match(r"Requires-Dist:\s*(nvidia|cuda)[-_]", line, re.IGNORECASE) for line in needs)


def download_cpu_torch(folder: Path, *args: str) -> str | None:
    """``pip download torch ARGS`` into ``folder``: the version when pip got a CPU build, else ``None`` (nothing kept)."""
    with tempfile.TemporaryDirectory() as tmp:
        done = pip("download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp, *args, check=False)
        wheels = list(Path(tmp).glob("torch-*.whl"))
        if done.returncode != 0 or len(wheels) != 1 or not is_cpu_build(wheels[0]):
            return None
        shutil.move(str(wheels[0]), folder / wheels[0].name)
        return wheels[0].name.split("-")[1]


def local_torch(folder: Path, spec: str | None) -> str | None:
    """Download a CPU build of torch into ``folder`` for this interpreter; the requirement that names it (``None``: this
    interpreter imports torch already and ``spec`` names none)."""
    if spec is None and importlib.util.find_spec("torch") is not None:
        print("  torch: this interpreter's own", flush=True)
        return None
    if spec is not None:
        pip("download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(folder), spec)
        return spec
    # the PyTorch CPU index first (pip's configured indexes are asked too: only a CPU build is kept)
    version = download_cpu_torch(folder, "--timeout", "20", "--retries", "1", "--index-url", TORCH_CPU_INDEX, "torch>=2.1,<3")
    if version is None:
        # every version pip's configured indexes and links offer
        listed = pip("index", "versions", "torch", check=False)
        found = re.search(r"Available versions: (.*)", listed.stdout)
        cpu = [v.strip() for v in found.group(1).split(",") if v.strip().endswith("+cpu")] if found else []
        cpu.sort(key=lambda v: tuple(int(p) for p in re.findall(r"\d+", v.split("+")[0])), reverse=True)
        version = next((v for v in cpu[:3] if download_cpu_torch(folder, f"torch=={v}")), None)
    if version is None:
        raise SystemExit(
            f"fetch_wheels: no CPU build of torch found ({TORCH_CPU_INDEX} not reached, and pip's indexes offer no '+cpu' "
            "version): install torch into this Python, or pass --torch 'torch==VERSION'"
        )
    print(f"  torch: {version} (a CPU build)", flush=True)
    return f"torch=={version}"


def fetch_local(folder: Path, torch_spec: str | None) -> None:
    """Every wheel the check's CPU mode needs, for this interpreter, dependencies resolved by pip."""
    v = sys.version_info
    print(f"fetching for this machine (CPython {v.major}.{v.minor}, {sys.executable})", flush=True)
    torch = local_torch(folder, torch_spec)
    reqs = [r for r in requirements() if requirement_name(r) != "torch"] + ([torch] if torch else [])
    pip("download", "-q", "--only-binary=:all:", "--find-links", str(folder), "-d", str(folder), *reqs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", action="store_true", help="for this interpreter (run_device.sh --cpu): into .whl-cpu/")
    parser.add_argument("--python-version", default=DEVICE_PYTHON, help=f"the device's Python (default {DEVICE_PYTHON})")
    parser.add_argument("--torch", default=None, metavar="SPEC", help="with --local: the torch to fetch (default: a CPU build)")
    parser.add_argument("--dir", type=Path, default=None, help="the folder to fill (default .whl/, with --local .whl-cpu/)")
    args = parser.parse_args(argv)
    folder = args.dir or ROOT / (".whl-cpu" if args.local else ".whl")
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    if args.local:
        fetch_local(folder, args.torch)
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
    else:
        fetch_device(folder, args.python_version)
        python = args.python_version
    files = sorted(p.name for p in folder.iterdir())
    size = sum((folder / f).stat().st_size for f in files)
    (folder / "FETCHED").write_text(f"target {'local' if args.local else 'device'}\npython {python}\n" + "".join(f"{f}\n" for f in files))
    print(f"{folder}: {len(files)} files, {size / 2**20:.1f} MiB", flush=True)
    if not args.local and size > 60 * 2**20:
        print("  (over 60 MiB: with the working tree, more than the device machine takes, 64 MiB)", file=sys.stderr)
    print(f"  next: bash benchmarks/gpu/run_device.sh{' --cpu' if args.local else ' --quick'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
