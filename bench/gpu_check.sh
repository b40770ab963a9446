#!/usr/bin/env bash
# The device check on a machine with an NVIDIA GPU, in at most 8 minutes (README: "NVIDIA GPUs").
#
#   bash bench/gpu_check.sh [gpu_check.py options]
#
# onnxruntime-gpu is used where it is installed; else it is installed (no network needed) from
# build/ortgpu/: its wheel, or the wheel's pieces (`split -b 28M`, named WHEEL.part-*), which
# is how it reaches a machine whose transfers are capped. The CUDA libraries of the nvidia-*
# pip packages are put on LD_LIBRARY_PATH. The report goes to build/gpu_report.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${SPECRT_GPU_SITE:-/tmp/specrt-gpu-site}

has_cuda() {
  "$PY" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null
}

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi sees none): run it on a machine with one" >&2
  exit 2
fi
if ! has_cuda; then
  wheel=$(ls build/ortgpu/*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    first=$(ls build/ortgpu/*.whl.part-* 2>/dev/null | head -n 1 || true)
    if [ -z "$first" ]; then
      echo "gpu_check: no onnxruntime-gpu here and no wheel in build/ortgpu/: pip install onnxruntime-gpu, or put its wheel there (README: NVIDIA GPUs)" >&2
      exit 2
    fi
    wheel="/tmp/$(basename "${first%.part-*}")"
    cat build/ortgpu/*.whl.part-* > "$wheel"
  fi
  "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" "$wheel"
  export PYTHONPATH="$SITE:$PYTHONPATH"
fi
libs=$("$PY" - <<'PYLIBS'
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
dirs = {os.path.dirname(p) for r in roots for p in glob.glob(os.path.join(r, "nvidia", "*", "lib", "*.so*"))}
print(":".join(sorted(dirs)))
PYLIBS
)
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! has_cuda; then
  echo "gpu_check: onnxruntime has no CUDA provider even so; running the CPU dry run" >&2
  exec timeout 480 "$PY" bench/gpu_check.py --dry-run "$@"
fi
exec timeout 480 "$PY" bench/gpu_check.py "$@"
