#!/usr/bin/env bash
# Build the demo pair with onnxruntime-genai's own model builder, in its own environment: the
# builder needs transformers 5.x, our exporter pins < 4.58.
#   bash bench/genai_env.sh [OUT_DIR]     -> OUT_DIR/{target,draft} (default build/genai)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/genai}
venv=build/genai-venv
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet torch==2.13.0           # the CPU wheel, first and pinned
    "$venv/bin/pip" install --quiet onnxruntime-genai==0.18.0 "transformers>=5" onnx onnx_ir
fi
for role in target draft; do
    "$venv/bin/python" -m onnxruntime_genai.models.builder -i "models/demo/$role" \
        -o "$out/$role" -p fp32 -e cpu > "$out.$role.log" 2>&1 || { cat "$out.$role.log"; exit 1; }
done
echo "built $out/target and $out/draft with $("$venv/bin/pip" show onnxruntime-genai | grep ^Version)"
