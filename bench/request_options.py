"""What the request options that read the target's logits cost: the logits processors
(penalties) and the log-probabilities.

Prints the host's time for one call of each at the bundle's vocabulary (`LogitsProcessors.apply`
over 400 tokens of context, `token_logprobs` with the top 5), then tokens/s of the target alone
and of the default configuration without and with each option, the settings taking turns A B
B A on each prompt (fresh caches for every run: `forget_kept_rows`).

    .venv/bin/python bench/request_options.py --bundle engines/smollm2-poor-int4
"""

from __future__ import annotations

import argparse
import sys
import time
import timeit
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specrt.runtime import GenerationConfig, SpeculativeGenerator  # noqa: E402
from specrt.runtime.logprobs import token_logprobs  # noqa: E402

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "Give three tips for learning to cook.",
    "What is the capital of France and why is it famous?",
]
PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2)


def host_costs(vocab: int) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, 400).tolist()
    processors = GenerationConfig(**PENALTIES).processors
    for positions in (1, 5):
        logits = rng.normal(size=(positions, vocab)).astype(np.float32)
        call = partial(processors.apply, tokens=tokens, prompt_length=300,
                       proposal=tokens[: positions - 1])  # fmt: skip
        seconds = timeit.timeit(partial(_fresh, call, logits), number=200)
        copy = timeit.timeit(logits.copy, number=200)  # the copy each call works on
        print(f"penalties, {positions} position(s): {(seconds - copy) / 200 * 1e6:.0f} us")
    for count in (1, 4):
        logits = rng.normal(size=(count, vocab)).astype(np.float32) * 3
        call = partial(token_logprobs, logits, list(range(count)), 5)
        seconds = timeit.timeit(call, number=200)
        print(f"logprobs (top 5), {count} token(s): {seconds / 200 * 1e6:.0f} us")


def _fresh(call, logits: np.ndarray) -> None:
    call(logits.copy())


def speed(generator: SpeculativeGenerator, config: GenerationConfig, prompt: str) -> tuple:
    generator.forget_kept_rows()
    started = time.perf_counter()
    [result] = generator.generate([prompt], config)
    return len(result.token_ids), time.perf_counter() - started


def loaded(description: str) -> tuple[SpeculativeGenerator, argparse.Namespace]:
    """The command line of these benchmarks (``--bundle``, ``--max-new-tokens``,
    ``--threads``) and the bundle it names, loaded."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    parser.add_argument("--bundle", default="engines/smollm2-poor-int4")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    return SpeculativeGenerator.from_bundle(args.bundle, threads=args.threads), args


def main() -> None:
    generator, args = loaded(__doc__)
    host_costs(generator.target.vocab_size)
    options = {"penalties": PENALTIES, "logprobs=5": dict(logprobs=5)}
    for label, base in (
        ("target alone", GenerationConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=0)),
        ("default", GenerationConfig(max_new_tokens=args.max_new_tokens)),
    ):
        base = replace(base, ignore_eos=True)
        for name, option in options.items():
            totals = {"without": [0, 0.0], "with": [0, 0.0]}
            for prompt in PROMPTS:
                for key in ("without", "with", "with", "without"):  # A B B A
                    config = base if key == "without" else replace(base, **option)
                    tokens, seconds = speed(generator, config, prompt)
                    totals[key][0] += tokens
                    totals[key][1] += seconds
            rates = {key: tokens / seconds for key, (tokens, seconds) in totals.items()}
            print(
                f"{label}, {name}: {rates['with']:.1f} against {rates['without']:.1f} tokens/s "
                f"without, {rates['with'] / rates['without']:.3f}x"
            )


if __name__ == "__main__":
    main()
