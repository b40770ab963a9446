"""The benchmark's defaults, read by the CLI and the runner alike."""

from pathlib import Path

BENCH_NEW_TOKENS = 128  # per prompt, EOS ignored
BENCH_MAX_DRAFT_TOKENS = 8  # fixed K = 1..this, and the schedules' cap
GENAI_MODELS = Path("build/genai")  # where bench/genai_env.sh builds the pair for onnxruntime-genai
