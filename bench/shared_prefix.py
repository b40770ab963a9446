"""Rows that share a system prompt: the target copying the shared positions from a running row,
or from a finished one kept in a free slot (`specrt.runtime.prefixes`), against reading every
prompt whole, side by side.

    .venv/bin/python bench/shared_prefix.py [--bundle engines/smollm2-int4] [--batch-size 8]
        [--max-new-tokens 32] [--system-repeats 4] [--system-words N] [--repeats 2]
        [--one-at-a-time]

The held-out chat prompts (models/smollm2/heldout_prompts.jsonl, or ``--prompt-file``), each
after one long system message (a paragraph of instructions, ``--system-repeats`` times),
through the bundle's chat template (without one: the message, a blank line, the prompt),
greedy, EOS ignored, run by `SpeculativeGenerator.run` at ``--batch-size`` rows with the
default config; with ``--one-at-a-time``, each prompt admitted alone once the one before has
finished, as a service's one client sends them (the time to its first token printed too). The
two modes alternate A B B A (``--repeats`` times) in one process; prints each mode's tokens/s
and the ratio, and checks that both gave the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import specrt.runtime.prefixes as prefixes
from specrt.chat import ChatTemplate
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from specrt.runtime.batching import Request

REPO = Path(__file__).resolve().parents[1]
SYSTEM = (
    "You are a careful assistant for a public library. Answer in plain English, in short "
    "paragraphs, without lists unless the reader asks for one. Say when you are unsure, and "
    "never invent titles, dates or names. Prefer examples a reader can check at home. Keep "
    "a friendly tone, and do not repeat the question back. "
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", default=str(REPO / "engines" / "smollm2-int4"))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--system-repeats", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=None, help="its first N words")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one-at-a-time", action="store_true", help="a service's one client")
    parser.add_argument(
        "--prompt-file", default=str(REPO / "models" / "smollm2" / "heldout_prompts.jsonl")
    )
    args = parser.parse_args()

    generator = SpeculativeGenerator.from_bundle(args.bundle, max_batch=args.batch_size)
    tokenizer = generator.tokenizer
    template = ChatTemplate.from_directory(tokenizer.directory)
    lines = Path(args.prompt_file).read_text().splitlines()
    system = " ".join((SYSTEM * args.system_repeats).split()[: args.system_words])

    def prompt(question: str) -> list[int]:
        if template is None:  # a model that completes text: the message, then the question
            return tokenizer.encode(f"{system}\n\n{question}")
        chat = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return tokenizer.encode(template.prompt(chat), add_special_tokens=False)

    prompts = [prompt(json.loads(line)["prompt"]) for line in lines if line.strip()]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    shared = min(len(p) for p in prompts)
    while any(p[:shared] != prompts[0][:shared] for p in prompts):
        shared -= 1
    print(
        f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"the first {shared} alike; {args.max_new_tokens} new tokens each; batch "
        f"{args.batch_size}; {args.bundle}"
    )

    first_token = {True: [], False: []}  # seconds, with --one-at-a-time

    def run(share: bool) -> tuple[float, dict]:
        prefixes.MIN_SHARED_PREFIX = 16 if share else 1 << 30
        started = time.perf_counter()
        if not args.one_at_a_time:
            results = dict(generator.run(Request(i, p, config) for i, p in enumerate(prompts)))
            return time.perf_counter() - started, {k: r.token_ids for k, r in results.items()}
        runner, outputs = generator.runner(), {}
        for i, ids in enumerate(prompts):
            admitted = time.perf_counter()
            finished = runner.add([Request(i, ids, config)])
            first_token[share].append(time.perf_counter() - admitted)
            while runner.rows:
                finished += runner.step()
            outputs[i] = finished[0][1].token_ids
        return time.perf_counter() - started, outputs

    run(True)  # warm up
    seconds = {True: 0.0, False: 0.0}
    outputs = {}
    for share in first_token:
        first_token[share].clear()
    for _ in range(args.repeats):
        for share in (True, False, False, True):
            elapsed, outputs[share] = run(share)
            seconds[share] += elapsed
    tokens = args.repeats * 2 * len(prompts) * args.max_new_tokens
    for share, name in ((False, "every prompt read whole"), (True, "shared positions copied")):
        line = f"{name:26s} {tokens / seconds[share]:7.1f} tokens/s"
        if args.one_at_a_time:
            line += f", first token after {1000 * statistics.median(first_token[share]):.0f} ms"
        print(line)
    print(f"ratio (copied / read whole): {seconds[False] / seconds[True]:.2f}x")
    print("outputs identical:", outputs[True] == outputs[False])


if __name__ == "__main__":
    main()
