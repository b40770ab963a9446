"""A fresh generator's first calls of rows sharing calls: what the load schedule costs while
it learns the batch's costs (the widths of prompt lookup's matches, K).

Loads the bundle once per mode (``--modes``): free text (``--max-new-tokens`` 48, EOS ignored)
and JSON held to `bench/structured.py`'s schema (``--json-max-new-tokens`` 64), and runs
``--calls`` consecutive `generate` calls of ``--rows`` rows (its 4 prompts over and over, as
chat), each call the target alone and the default configuration in turns (A B, then B A),
fresh caches for every run (`forget_kept_rows`) while the default's schedules learn on from
call to call, as a service's do. Prints each call's speed-up (outputs compared) and rounds.

    .venv/bin/python bench/first_calls.py --bundle engines/smollm2-poor-int4
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specrt.runtime import GenerationConfig, SpeculativeGenerator, StructuredOutput  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured import PROMPTS, SCHEMA, chat  # noqa: E402


def timed(generator: SpeculativeGenerator, prompts: list[str], config: GenerationConfig):
    generator.forget_kept_rows()
    started = time.perf_counter()
    results = generator.generate(prompts, config)
    return results, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default="engines/smollm2-poor-int4")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json-max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["free", "json"], choices=["free", "json"])
    args = parser.parse_args()
    prompts = [chat(PROMPTS[i % len(PROMPTS)]) for i in range(args.rows)]
    modes = {
        "free": GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True),
        "json": GenerationConfig(
            max_new_tokens=args.json_max_new_tokens,
            structured_output=StructuredOutput(json=SCHEMA),
        ),
    }
    for mode in args.modes:
        default = modes[mode]
        generator = SpeculativeGenerator.from_bundle(
            args.bundle, threads=args.threads, max_batch=args.rows
        )
        alone = replace(default, num_draft_tokens=0)
        timed(generator, prompts[:2], alone)  # the sessions' first calls
        for call in range(args.calls):
            order = ("alone", "default") if call % 2 == 0 else ("default", "alone")
            runs = {key: timed(generator, prompts, alone if key == "alone" else default)
                    for key in order}  # fmt: skip
            (plain, plain_s), (spec, spec_s) = runs["alone"], runs["default"]
            same = [r.token_ids for r in plain] == [r.token_ids for r in spec]
            proposers: dict[str, list[int]] = {}
            for result in spec:
                for name, entry in result.stats.proposers.items():
                    totals = proposers.setdefault(name, [0, 0])
                    totals[0] += entry["proposed"]
                    totals[1] += entry["accepted"]
            rounds = max(r.stats.rounds for r in spec), max(r.stats.rounds for r in plain)
            kept = ", ".join(f"{name} {a}/{p}" for name, (p, a) in sorted(proposers.items()))
            print(f"{mode}, call {call + 1}: default {plain_s / spec_s:.2f}x the target alone "
                  f"(same output: {same}); rounds {rounds[0]} against {rounds[1]}; "
                  f"kept/proposed: {kept or 'none'}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
