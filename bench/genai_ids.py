"""onnxruntime-genai's target alone on given token ids: what `bench/real.py --peers genai` runs in
the genai environment (`bash bench/genai_env.sh smollm2` makes it and the models).

    build/genai-venv/bin/python bench/genai_ids.py --model build/genai-smollm2/int4 \
        --ids ids.json --new-tokens 128 --repeats 3 --threads 2 --out times.json

``--ids``: a JSON list of prompts, each a list of token ids (already rendered with the chat
template, so every contender reads the very same tokens). Greedy, EOS held off by min_length.
Writes ``{"seconds": [[run, ...] per prompt], "outputs": [[token, ...] per prompt]}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from genai_bench import generate, load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a genai model folder")
    parser.add_argument("--ids", type=Path, required=True)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    prompts = json.loads(args.ids.read_text())
    # genai_bench's loader reads MODELS/target: give it the folder above, named as it expects
    model = load_target(args.model, args.threads, folder="")
    generate(model, prompts[0], 8, 0.0, 0, 0)  # one-off costs
    seconds, outputs = [], []
    for ids in prompts:
        times = []
        for _ in range(args.repeats):
            rate, out, _ = generate(model, ids, args.new_tokens, 0.0, 0, 0)
            times.append(len(out) / rate)
        seconds.append(times)
        outputs.append(out)
    args.out.write_text(json.dumps({"seconds": seconds, "outputs": outputs}) + "\n")


if __name__ == "__main__":
    main()
