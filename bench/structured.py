"""What structured output costs and what speculation gives under it: JSON answers to chat
prompts held to a schema.

Prints the host's time for the grammar's masks (one position, and five after a proposal of
four, as a verification pass asks), then, prompt by prompt, tokens/s of the target alone with
the schema and the default configuration's speed-up over it (the same answer, checked), the
two taking turns A B B A on each prompt (fresh caches for every run: `forget_kept_rows`).

    .venv/bin/python bench/structured.py --bundle engines/smollm2-poor-int4
"""

from __future__ import annotations

import statistics
import sys
import time
import timeit
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specrt.runtime import GenerationConfig, SpeculativeGenerator, StructuredOutput  # noqa: E402
from specrt.runtime.grammar import row_grammar  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from request_options import loaded  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "colors": {"type": "array", "items": {"type": "string"}},
        "indoor": {"type": "boolean"},
    },
    "required": ["name", "age", "colors", "indoor"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a cat as JSON with its name, age, colors and whether it lives indoors.",
    "Give me a JSON record of a dog: name, age, fur colors, indoor or not.",
    "JSON for a parrot called Kiwi, 3 years old, green and yellow, lives indoors.",
    "Make up a hamster and describe it in JSON: name, age, colors, indoor.",
]


def chat(prompt: str) -> str:
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def mask_costs(generator: SpeculativeGenerator, config: GenerationConfig) -> None:
    vocab = generator.target.vocab_size
    args = (config, generator.tokenizer, generator.eos_token_ids, vocab)
    state = row_grammar(*args)
    text = '{"name":"Maine Coon","age":4,"colors":["grey","white"],"indoor":true}'
    ids = generator.tokenizer.encode(text, add_special_tokens=False)
    logits = np.zeros((5, vocab), np.float32)
    for at in (2, 8, 16):
        before, proposal = ids[:at], ids[at : at + 4]
        one = timeit.timeit(partial(_masked, state, logits[:1], before, []), number=50)
        five = timeit.timeit(partial(_masked, state, logits, before, proposal), number=50)
        print(f"masks after {at} tokens: 1 position {one / 50 * 1e6:.0f} us, "
              f"5 positions {five / 50 * 1e6:.0f} us")  # fmt: skip


def _masked(state, logits: np.ndarray, before: list[int], proposal: list[int]) -> None:
    state.apply(logits.copy(), before, proposal)


def run(generator: SpeculativeGenerator, config: GenerationConfig, prompt: str) -> tuple:
    generator.forget_kept_rows()
    started = time.perf_counter()
    [result] = generator.generate([chat(prompt)], config)
    return result, time.perf_counter() - started


def main() -> None:
    generator, args = loaded(__doc__)
    structured = StructuredOutput(json=SCHEMA)
    default = GenerationConfig(max_new_tokens=args.max_new_tokens, structured_output=structured)
    alone = replace(default, num_draft_tokens=0)
    mask_costs(generator, default)
    run(generator, default, PROMPTS[0])  # warm: llguidance's tokenizer, the sessions
    ratios = []
    for prompt in PROMPTS:
        seconds = {"alone": 0.0, "default": 0.0}
        answers = {}
        for key in ("alone", "default", "default", "alone"):  # A B B A
            result, took = run(generator, alone if key == "alone" else default, prompt)
            seconds[key] += took
            answers.setdefault(key, result)
        same = answers["alone"].token_ids == answers["default"].token_ids
        tokens = len(answers["alone"].token_ids)
        ratios.append(seconds["alone"] / seconds["default"])
        rate = 2 * tokens / seconds["alone"]
        text = answers["alone"].text[:60]
        print(f"{tokens} tokens, target alone {rate:.1f} tokens/s, default {ratios[-1]:.2f}x "
              f"(same answer: {same}): {text!r}")  # fmt: skip
    print(f"default over the target alone, median: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
