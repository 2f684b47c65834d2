#!/usr/bin/env bash
# Set up dsa-train on a fresh Colab runtime or single-GPU box, check what it has, and train.
set -euo pipefail

usage() {
    cat <<USAGE
Usage: scripts/setup_box.sh [options] [-- extra 'dsa-train run' arguments]

Installs dsa-train from this checkout, prints what it found (Python, torch, CUDA and the GPU,
the C compiler for DiskSparseAdam's fast path, free space for the optimizer state), then runs
a recipe with the optimizer state on a local disk. Works on CPU-only machines too.

Options:
  --recipe FILE     recipe to run (default: recipes/quickstart.yaml)
  --state-dir DIR   parent of the optimizer state: a local SSD, not a network drive
                    (default: /content/dsa_state on Colab, else \${TMPDIR:-/tmp}/dsa_state)
  --device D        auto, cpu or cuda (default: auto)
  --no-install      do not pip install (dsa-train is installed already)
  --check-only      set up and check, do not train
  -h, --help        show this help

Examples:
  scripts/setup_box.sh
  scripts/setup_box.sh --recipe recipes/fb15k237-distmult.yaml --state-dir /mnt/nvme/dsa -- --set train.epochs=5
USAGE
}

here="$(cd "$(dirname "$0")/.." && pwd)"
recipe="$here/recipes/quickstart.yaml"
if [ -d /content ] && [ -n "${COLAB_RELEASE_TAG:-${COLAB_GPU:-}}" ]; then state_parent=/content/dsa_state; else state_parent="${TMPDIR:-/tmp}/dsa_state"; fi
device=auto
install=1
train=1
while [ $# -gt 0 ]; do
    case "$1" in
        --recipe) recipe="$2"; shift 2 ;;
        --state-dir) state_parent="$2"; shift 2 ;;
        --device) device="$2"; shift 2 ;;
        --no-install) install=0; shift ;;
        --check-only) train=0; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) echo "Error: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done

python="${PYTHON:-python3}"
if [ "$install" = 1 ]; then
    echo "== installing dsa-train from $here" >&2
    "$python" -m pip install --quiet -e "$here"
fi

mkdir -p "$state_parent"
echo "== what this box has" >&2
STATE_PARENT="$state_parent" "$python" - <<'PY'
import os, platform, shutil, sys
import torch
from dsa_train.optim import native

print(f"python      {platform.python_version()} ({sys.executable})")
print(f"torch       {torch.__version__}, {torch.get_num_threads()} CPU threads")
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print(f"cuda        {torch.version.cuda}, {torch.cuda.get_device_name(0)}, {props.total_memory / 2**30:.1f} GiB")
else:
    print("cuda        none (training runs on the CPU)")
kernel = native.load()
print(f"fast path   {'compiled kernel' if kernel else 'pure torch (no C compiler found: install gcc for ~2x)'}")
free = shutil.disk_usage(os.environ["STATE_PARENT"]).free
print(f"state disk  {os.environ['STATE_PARENT']}: {free / 2**30:.1f} GiB free")
PY

if [ "$train" = 1 ]; then
    name="$(basename "$recipe" .yaml)-$(date +%Y%m%d-%H%M%S)"
    echo "== dsa-train run $recipe (optimizer state in $state_parent/$name)" >&2
    dsa-train run "$recipe" --device "$device" --set "optimizer.state_dir=$state_parent/$name" "$@"
fi
