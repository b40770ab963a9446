#!/usr/bin/env bash
# Packs onnxruntime-gpu for a GPU machine reached through capped transfers (docs/gpu.md).
#
#   bash bench/gpu_pack.sh      # writes build/ortgpu/onnxruntime-gpu-VERSION.tar.xz.part-aa, -ab, ...
#
# Downloads the wheel here (build/ortgpu-src/, nothing installed), unpacks it and xz-compresses
# what `pip install --target` would lay down as one tar: the CUDA provider library is most of it
# (284 MB unpacked, ~250 MB deflated in the wheel, ~195 MB with xz -6). Each transfer carries the
# repository's tracked files too (38.9 MB on 2026-12-04), so a piece is what they leave of 64 MiB,
# less 1 MiB (`PIECE` overrides it): 8 pieces of 25 MiB then. Send one piece per command (files
# already there are kept between consecutive commands); bench/gpu_check.sh reassembles and
# unpacks them. build/ is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VERSION=${ORTGPU_VERSION:-1.31.1}  # a CUDA 13 build, what the GPU machine's libraries fit
SRC=build/ortgpu-src
OUT=build/ortgpu

mkdir -p "$SRC"
wheel=$(ls "$SRC"/onnxruntime_gpu-"$VERSION"-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 "onnxruntime-gpu==$VERSION" -d "$SRC"
  wheel=$(ls "$SRC"/onnxruntime_gpu-"$VERSION"-*.whl | head -n 1)
fi
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
unzip -q "$wheel" -d "$tree"
mkdir -p "$OUT"
rm -f "$OUT"/onnxruntime-gpu-"$VERSION".tar.xz.part-*  # our own earlier pieces only
tracked=$(git ls-files -z | xargs -0 du -cb | tail -n 1 | cut -f 1)
PIECE=${PIECE:-$(((64 * 1048576 - tracked) / 1048576 - 1))M}
tar -C "$tree" -cf - . | xz -6 -T0 | split -b "$PIECE" - "$OUT/onnxruntime-gpu-$VERSION.tar.xz.part-"
ls -l "$OUT"
echo "gpu_pack: $(ls "$OUT" | wc -l) pieces in $OUT: carry one per command, the last with bash bench/gpu_check.sh"
