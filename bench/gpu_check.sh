#!/usr/bin/env bash
# The device check on a machine with an NVIDIA GPU, in at most 8 minutes (docs/gpu.md).
#
#   bash bench/gpu_check.sh [gpu_check.py options]
#
# onnxruntime-gpu is used where its CUDA provider already works; else it is installed (no
# network needed) from build/ortgpu/: the pieces bench/gpu_pack.sh writes (an xz-compressed
# tar of the wheel's files, *.tar.xz.part-*), or a wheel, or a wheel's pieces (`split -b 28M`,
# named WHEEL.part-*), which is how it reaches a machine whose transfers are capped. The CUDA
# libraries of the nvidia-* pip packages are put on LD_LIBRARY_PATH. The report goes to
# build/gpu_report.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${SPECRT_GPU_SITE:-/tmp/specrt-gpu-site}
SCRIPT=${SPECRT_GPU_SCRIPT:-bench/gpu_check.py}  # or another probe, e.g. bench/gpu_attention.py

# Whether the CUDA provider really runs here: listed is not enough (onnxruntime-gpu lists it
# without a GPU, and falls back to the CPU when a CUDA library does not load), so a model of one
# MatMul (cuBLAS) must load with CUDA first and compute. Says why not on stderr.
cuda_works() {
  "$PY" - <<'PROBE'
import sys

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

if "CUDAExecutionProvider" not in ort.get_available_providers():
    sys.exit(f"onnxruntime {ort.__version__} has no CUDA provider")
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])
graph = helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"])], "probe", [x], [y])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 8  # what every onnxruntime since 1.10 reads
providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
session = ort.InferenceSession(model.SerializeToString(), providers=providers)
if session.get_providers()[0] != "CUDAExecutionProvider":
    sys.exit(f"the CUDA provider did not load (a CUDA library missing?): {session.get_providers()}")
a = np.array([[1, 2], [3, 4]], np.float32)
if not np.allclose(session.run(None, {"x": a})[0], a @ a):
    sys.exit("the CUDA provider computed a wrong MatMul")
PROBE
}

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi sees none): run it on a machine with one" >&2
  exit 2
fi
if ! cuda_works 2>/dev/null; then
  packed=$(ls build/ortgpu/*.tar.xz.part-* 2>/dev/null | head -n 1 || true)
  wheel=$(ls build/ortgpu/*.whl 2>/dev/null | head -n 1 || true)
  first=$(ls build/ortgpu/*.whl.part-* 2>/dev/null | head -n 1 || true)
  rm -rf "$SITE"
  mkdir -p "$SITE"
  if [ -n "$packed" ]; then  # the wheel's files, as pip would lay them down (Python's xz)
    cat "${packed%.part-*}".part-* | "$PY" -c 'import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1], filter="data")' "$SITE"
  elif [ -n "$wheel" ] || [ -n "$first" ]; then
    if [ -z "$wheel" ]; then
      wheel="/tmp/$(basename "${first%.part-*}")"
      cat "${first%.part-*}".part-* > "$wheel"
    fi
    "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" "$wheel"
  else
    echo "gpu_check: no onnxruntime-gpu here and nothing in build/ortgpu/: pip install onnxruntime-gpu, or bash bench/gpu_pack.sh and send its pieces (docs/gpu.md)" >&2
    exit 2
  fi
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
if ! cuda_works; then
  echo "gpu_check: onnxruntime's CUDA provider does not run here even so (above); running the CPU dry run" >&2
  exec timeout 480 "$PY" "$SCRIPT" --dry-run "$@"
fi
exec timeout 480 "$PY" "$SCRIPT" "$@"
