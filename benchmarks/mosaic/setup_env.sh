#!/usr/bin/env bash
# Mosaic streaming's own environment for the remote-dataset benchmark (issue 24).
#
#   bash benchmarks/mosaic/setup_env.sh [--force]
#
# Creates benchmarks/mosaic/.venv (Python 3.11, gitignored) with:
#   - torch 2.13.0 CPU (the +cpu wheel from the machine's local wheel folder; never a CUDA build);
#   - mosaicml-streaming 0.13.0 installed with --no-deps (its metadata asks for torch, torchvision,
#     transformers and every cloud's SDK), then the dependencies that `import streaming` and its S3
#     path really need, by hand;
#   - a stand-in for torchvision (shim/torchvision): `import streaming` imports streaming.vision,
#     which needs torchvision.datasets.VisionDataset and transforms.functional.to_tensor, and the only
#     torchvision wheels pip reaches here are CUDA builds that cannot load beside CPU torch.
# Idempotent: does nothing when the environment is complete and was made by this version of the
# script (a stamp file holds the script's hash); --force rebuilds it. Prints the environment's size.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.stoker-mosaic-env"
STAMP_VALUE="$(cat "$0" "$HERE"/shim/torchvision/*.py "$HERE"/shim/torchvision/*/*.py | sha256sum | cut -c1-16)"

TORCH="torch==2.13.0+cpu"
STREAMING="mosaicml-streaming==0.13.0"
# streaming 0.13.0's runtime needs, with the bounds of its metadata (numpy < 2.2 included):
# transformers (imported by streaming.base.dataloader at `import streaming`), the compressions and
# hashes of the MDS format, boto3 for s3://, filelock, tqdm (the writer's upload), catalogue
# (the registry of downloaders), Pillow (the jpeg encoding).
DEPS=(
  "numpy>=1.21.5,<2.2.0"
  "pillow"
  "boto3>=1.21.45,<2"
  "Brotli>=1.0.9"
  "python-snappy>=0.6.1,<1"
  "xxhash>=3.0.0,<4"
  "zstd>=1.5.2.5,<2"
  "tqdm>=4.64.0,<5"
  "transformers>=4.21.3,<5"
  "catalogue>=2,<3"
  "filelock"
)
# what `pip check` may report and why: streaming's metadata lists these, its code imports each
# only inside the function for another store (GCS, Azure, OCI, SFTP) or the simulator's plots.
EXPECTED_MISSING='azure-identity|azure-storage-blob|azure-storage-file-datalake|google-cloud-storage|matplotlib|oci|paramiko|torchvision'

force=0
[[ "${1:-}" == "--force" ]] && force=1

size() { du -sh "$VENV" | cut -f1; }

if [[ $force == 0 && -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_VALUE" ]] && "$PY" -c "import streaming" 2>/dev/null; then
  echo "mosaic env: up to date at $VENV ($(size))"
  exit 0
fi

start=$(date +%s)
PY311="$(command -v python3.11 || true)"
[[ -n "$PY311" ]] || { echo "mosaic env: python3.11 not found" >&2; exit 1; }
rm -rf "$VENV"
"$PY311" -m venv "$VENV"

# a constraint file that keeps torch on the CPU build whatever a later install asks for
CONSTRAINTS="$VENV/constraints.txt"
echo "$TORCH" > "$CONSTRAINTS"
LOG="$VENV/pip-install.log"
# pip's log goes to a file, shown on failure only (its resolver warns about the extras left out on purpose)
pip_install() { "$PY" -m pip install --disable-pip-version-check -c "$CONSTRAINTS" "$@" >>"$LOG" 2>&1 || { tail -40 "$LOG" >&2; return 1; }; }

# 1. torch first, CPU build only (pip's find-links folder holds the +cpu wheel)
pip_install "$TORCH" || {
  echo "mosaic env: $TORCH is not to be had here (it comes from the machine's local wheel folder)" >&2
  exit 1
}
# 2. streaming without its declared dependencies, then its real runtime dependencies
pip_install --no-deps "$STREAMING"
pip_install "${DEPS[@]}"
# 3. the torchvision stand-in (no dist-info: pip and transformers see no torchvision)
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "$SITE/torchvision"
cp -r "$HERE/shim/torchvision" "$SITE/torchvision"
find "$SITE/torchvision" -name __pycache__ -prune -exec rm -rf {} +

# 4. checks: torch is the CPU build, streaming imports, pip check says only what is expected
"$PY" - <<'EOF'
import torch
import streaming
from streaming import MDSWriter, StreamingDataset  # noqa: F401
import boto3  # noqa: F401
from PIL import Image  # noqa: F401

assert torch.__version__.endswith("+cpu"), torch.__version__
assert not torch.cuda.is_available()
print(f"mosaic env: torch {torch.__version__}, mosaicml-streaming {streaming.__version__}, boto3 {boto3.__version__}")
EOF
check="$("$PY" -m pip check 2>&1 || true)"
unexpected="$(grep -v "^No broken requirements" <<<"$check" | grep -Ev "^mosaicml-streaming [0-9.]+ requires ($EXPECTED_MISSING)," || true)"
if [[ -n "$unexpected" ]]; then
  echo "mosaic env: pip check reports more than the expected missing extras:" >&2
  echo "$unexpected" >&2
  exit 1
fi
echo "mosaic env: pip check: only streaming's unused extras missing ($(grep -c requires <<<"$check" || true) lines: other stores' SDKs, matplotlib, torchvision)"

echo "$STAMP_VALUE" > "$STAMP"
echo "mosaic env: ready at $VENV in $(( $(date +%s) - start )) s ($(size))"
