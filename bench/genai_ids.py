"""onnxruntime-genai's target alone, run on request: what `bench/real.py --peers genai` starts in
the genai environment (`bash bench/genai_env.sh smollm2` makes it and the models), so that its
runs take turns with specrt's on each prompt and the machine's drift falls on both alike.

    build/genai-venv/bin/python bench/genai_ids.py --model int4=build/genai-smollm2/int4 \
        --model fp32=build/genai-smollm2/fp32 --new-tokens 128 --threads 2

Prints ``{"ready": true}`` once the models are loaded and have run once. Then reads one request
a line on stdin, ``{"model": NAME, "ids": [...]}``: a prompt's token ids, already rendered with
the chat template, so every contender reads the very same tokens. Greedy, EOS held off by
min_length. Answers each with a line ``{"seconds": ..., "output": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from genai_bench import generate, load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", action="append", required=True, help="NAME=FOLDER, a genai model folder"
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    models = {}
    for given in args.model:
        name, _, folder = given.partition("=")
        # genai_bench's loader reads MODELS/target: give it the folder itself
        models[name] = load_target(Path(folder), args.threads, folder="")
        generate(models[name], [1, 2, 3], 8, 0.0, 0, 0)  # one-off costs
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        rate, out, _ = generate(
            models[request["model"]], request["ids"], args.new_tokens, 0.0, 0, 0
        )
        print(json.dumps({"seconds": len(out) / rate, "output": out}), flush=True)


if __name__ == "__main__":
    main()
