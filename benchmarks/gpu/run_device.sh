#!/usr/bin/env bash
# The device check (issue 30) on a lent GPU machine: installs stoker's dependencies from .whl/, prints the machine,
# then runs benchmarks/gpu/check.py (the CUDA tests first, then the training runs and the CPU scaling), which writes
# gpu_check.json and gpu_check.md to $OUT (default ./bench-out) after each section.
#
#   bash benchmarks/gpu/run_device.sh --quick     # about 2 minutes: tiny data, few steps, one DataLoader worker count
#   bash benchmarks/gpu/run_device.sh             # the full check: at most 7 minutes on 16 cores
#
# .whl/ holds (see docs/benchmarks.md, "Device check"): numba 0.68.1, simplejpeg, turbojpeg 0.0.2, isal, tbb and
# tcmlib wheels for CPython 3.12 on manylinux x86-64, and llvmlite 0.50.0 as a tar.xz of its unpacked wheel (the
# wheel is 60 MB; the whole working tree that travels may be 64 MiB). Every other dependency (torch, torchvision,
# numpy, pillow, tqdm, pytest, pytest-timeout, hypothesis) is the machine's.
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/bench-out}"
mkdir -p "$OUT"
SITE=/tmp/site
if [ ! -f "$SITE/.stoker-deps" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 3
    python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" .whl/llvmlite-*.tar.xz "$SITE" || exit 3
    # TBB's shared library goes to <prefix>/lib, where stoker looks for it (--target drops it): install it into the
    # interpreter's own prefix (a throwaway machine); without it Numba uses its OpenMP layer, slower under contention
    PREFIX="$(python3 -c 'import sys; print(sys.prefix)')"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --prefix "$PREFIX" .whl/tbb-*.whl .whl/tcmlib-*.whl \
        || echo "(TBB not installed into $PREFIX: Numba will use another threading layer)"
    touch "$SITE/.stoker-deps"
fi
export PYTHONPATH="$SITE:$PWD/src:$PWD"
# the DataLoader's workers hand batches over in shared memory: a container's /dev/shm can be 64 MB; below 8 GB, make
# room (on the lent machine only: it is given back after the run)
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -gt 0 ]; then
    SHM_KB="$(df -k --output=size /dev/shm 2>/dev/null | tail -1 | tr -d ' ')"
    if [ -n "$SHM_KB" ] && [ "$SHM_KB" -lt 8388608 ]; then
        mount -o remount,size=16G /dev/shm 2>/dev/null || echo "(/dev/shm is ${SHM_KB} KB and could not be enlarged)"
    fi
fi
{
    echo "== machine"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | head -3
    echo "cpus: $(nproc); $(python3 --version); /dev/shm: $(df -h /dev/shm | tail -1 | awk '{print $2}')"
    python3 - <<'EOF'
import numba, numpy, torch, llvmlite
import stoker.pipeline.threads as t
t.prefer_tbb()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, available {torch.cuda.is_available()}), numpy {numpy.__version__}, "
      f"numba {numba.__version__} from {numba.__file__.rsplit('/', 2)[0]}, llvmlite {llvmlite.__version__}, threading layer {t.threading_layer()}")
import torchvision, simplejpeg, PIL
print(f"torchvision {torchvision.__version__}, simplejpeg {simplejpeg.__version__}, pillow {PIL.__version__}")
EOF
} 2>&1 | tee "$OUT/machine.txt"
# the check: sections recorded one by one; its exit status says whether any failed
timeout 570 python3 benchmarks/gpu/check.py --out "$OUT" --data /tmp/stoker-check-data "$@" 2>&1 | tee "$OUT/check.log"
exit "${PIPESTATUS[0]}"
