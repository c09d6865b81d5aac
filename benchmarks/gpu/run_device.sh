#!/usr/bin/env bash
# The device check (issue 30), one command from a clone (docs/device.md, "The device check"): installs what the machine
# lacks of stoker's dependencies from a wheel folder, prints the machine, then runs benchmarks/gpu/check.py (the CUDA
# tests first, then the training runs and the CPU scaling), which writes gpu_check.json and gpu_check.md to $OUT
# (default ./bench-out) after each section.
#
#   bash benchmarks/gpu/run_device.sh --quick     # about 2 minutes: tiny data, few steps, one DataLoader worker count
#   bash benchmarks/gpu/run_device.sh             # the full check: at most 7 minutes on 16 cores
#   bash benchmarks/gpu/run_device.sh --cpu       # no GPU: the CPU parts, on any machine (the smoke test)
#
# The wheels: .whl/ for a GPU run (what the device lacks: numba, llvmlite, simplejpeg, turbojpeg, isal, tbb, for its
# Python), .whl-cpu/ for --cpu (everything, torch included, for this python3). A folder without its FETCHED file is
# filled first by benchmarks/gpu/fetch_wheels.py, from the package registries; a machine that reaches none (the lent
# GPU machine) gets .whl/ from the machine that sends it there: `python3 benchmarks/gpu/fetch_wheels.py` there, then
# this script with .whl carried.
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore
OUT="${OUT:-$PWD/bench-out}"
mkdir -p "$OUT"
PY="$(python3 -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')" || exit 3
case " $* " in
    *" --cpu "*) WHEELS=.whl-cpu FETCH=(--local) ;;
    *) WHEELS=.whl FETCH=(--python-version "$PY") ;;
esac
if [ ! -f "$WHEELS/FETCHED" ]; then
    echo "== $WHEELS/ is empty: fetching it (benchmarks/gpu/fetch_wheels.py ${FETCH[*]})"
    python3 benchmarks/gpu/fetch_wheels.py "${FETCH[@]}" || {
        echo "could not fill $WHEELS/ (no package registry reachable?): run 'python3 benchmarks/gpu/fetch_wheels.py" \
             "${FETCH[*]}' on a machine that reaches one and bring $WHEELS/ here (docs/device.md)" >&2
        exit 3
    }
fi
WANT="$(sed -n 's/^python //p' "$WHEELS/FETCHED")"
if [ "$WANT" != "$PY" ]; then
    echo "$WHEELS/ holds wheels for Python $WANT, this python3 is $PY: run 'python3 benchmarks/gpu/fetch_wheels.py" \
         "${FETCH[*]}' (on a machine that reaches the registries) and bring $WHEELS/ here" >&2
    exit 3
fi
# one site per wheel set: installed once, again when the wheels change
SITE="/tmp/stoker-site-$(cksum <"$WHEELS/FETCHED" | cut -d' ' -f1)"
if [ ! -f "$SITE/.stoker-deps" ]; then
    rm -rf "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 3
    for packed in "$WHEELS"/llvmlite-*.tar.xz; do  # (llvmlite, packed to travel: see fetch_wheels.py)
        [ -f "$packed" ] || continue
        python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" "$packed" "$SITE" || exit 3
    done
    # TBB's shared library goes to <prefix>/lib, where stoker looks for it (--target drops it): install it into the
    # interpreter's own prefix on the lent machine (a throwaway one); elsewhere Numba uses another threading layer
    if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -gt 0 ] && [ -w "$(python3 -c 'import sys; print(sys.prefix)')" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --prefix "$(python3 -c 'import sys; print(sys.prefix)')" \
            "$WHEELS"/tbb-*.whl "$WHEELS"/tcmlib-*.whl || echo "(TBB not installed: Numba will use another threading layer)"
    fi
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
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | head -3
    else
        echo "no nvidia-smi: no NVIDIA GPU here"
    fi
    echo "cpus: $(nproc); $(python3 --version); /dev/shm: $(df -h /dev/shm | tail -1 | awk '{print $2}')"
    python3 - <<'EOF'
import numba, numpy, torch, llvmlite
import stoker.pipeline.threads as t
t.prefer_tbb()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, available {torch.cuda.is_available()}), numpy {numpy.__version__}, "
      f"numba {numba.__version__} from {numba.__file__.rsplit('/', 2)[0]}, llvmlite {llvmlite.__version__}, threading layer {t.threading_layer()}")
import simplejpeg, PIL
try:
    import torchvision
    vision = torchvision.__version__
except ImportError:
    vision = "not installed (the GPU sections need it)"
print(f"torchvision {vision}, simplejpeg {simplejpeg.__version__}, pillow {PIL.__version__}")
EOF
} 2>&1 | tee "$OUT/machine.txt"
# the check: sections recorded one by one; its exit status says whether any failed
timeout 570 python3 benchmarks/gpu/check.py --out "$OUT" --data /tmp/stoker-check-data "$@" 2>&1 | tee "$OUT/check.log"
exit "${PIPESTATUS[0]}"
