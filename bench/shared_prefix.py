"""Rows that share a system prompt: the target copying the shared positions from a running row,
or from a finished one kept in a free slot (`specrt.runtime.prefixes`), against reading every
prompt whole, side by side.

    .venv/bin/python bench/shared_prefix.py [--bundle engines/smollm2-int4] [--batch-size 8]
        [--max-new-tokens 32] [--system-repeats 4] [--system-words N] [--repeats 2]
        [--one-at-a-time [--turns T]]

The held-out chat prompts (models/smollm2/heldout_prompts.jsonl, or ``--prompt-file``), each
after one long system message (a paragraph of instructions, ``--system-repeats`` times),
through the bundle's chat template (without one: the message, a blank line, the prompt),
greedy, EOS ignored, run by `SpeculativeGenerator.run` at ``--batch-size`` rows with the
default config; with ``--one-at-a-time``, each prompt admitted alone once the one before has
finished, as a service's one client sends them (the time to its first token printed too), and
with ``--turns T`` each prompt a chat of T turns, every turn the conversation so far (its
answers as the model gave them) and a follow-up question, as a chat client sends it. The
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
FOLLOW_UP = {"role": "user", "content": "Tell me more about that, with an example."}
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
    parser.add_argument("--turns", type=int, default=1, help="with --one-at-a-time: a chat's")
    parser.add_argument(
        "--prompt-file", default=str(REPO / "models" / "smollm2" / "heldout_prompts.jsonl")
    )
    args = parser.parse_args()

    generator = SpeculativeGenerator.from_bundle(args.bundle, max_batch=args.batch_size)
    tokenizer = generator.tokenizer
    template = ChatTemplate.from_directory(tokenizer.directory)
    lines = Path(args.prompt_file).read_text().splitlines()
    system = " ".join((SYSTEM * args.system_repeats).split()[: args.system_words])

    if args.turns > 1 and (template is None or not args.one_at_a_time):
        raise SystemExit("--turns needs --one-at-a-time and a bundle with a chat template")

    def prompt(question: str, answers: tuple[str, ...] = ()) -> list[int]:
        if template is None:  # a model that completes text: the message, then the question
            return tokenizer.encode(f"{system}\n\n{question}")
        chat = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        for answer in answers:  # a chat's next turn: what was said, then a follow-up
            chat += [{"role": "assistant", "content": answer}, FOLLOW_UP]
        return tokenizer.encode(template.prompt(chat), add_special_tokens=False)

    questions = [json.loads(line)["prompt"] for line in lines if line.strip()]
    prompts = [prompt(question) for question in questions]
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
        for i, question in enumerate(questions):
            answers: tuple[str, ...] = ()
            for turn in range(args.turns):
                admitted = time.perf_counter()
                finished = runner.add([Request(i, prompt(question, answers), config)])
                first_token[share].append((turn, time.perf_counter() - admitted))
                while runner.rows:
                    finished += runner.step()
                [(_, result)] = finished
                outputs[i, turn] = result.token_ids
                answers += (result.text,)
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
    tokens = args.repeats * 2 * len(prompts) * args.turns * args.max_new_tokens
    for share, name in ((False, "every prompt read whole"), (True, "shared positions copied")):
        line = f"{name:26s} {tokens / seconds[share]:7.1f} tokens/s"
        if args.one_at_a_time:
            for turns, label in (((0,), "first turns"), (range(1, args.turns), "later turns")):
                waits = [wait for turn, wait in first_token[share] if turn in turns]
                if waits:
                    line += f", first token after {1000 * statistics.median(waits):.0f} ms"
                    line += f" ({label})" if args.turns > 1 else ""
        print(line)
    print(f"ratio (copied / read whole): {seconds[False] / seconds[True]:.2f}x")
    print("outputs identical:", outputs[True] == outputs[False])


if __name__ == "__main__":
    main()
