"""Proposers side by side on text the demo pair never saw: the target alone, the draft model
(fixed K, adaptive), prompt lookup, the suffix cache (as in a batch job), the hybrid, and the
demo target's EAGLE-3 head (`engines/demo-eagle`, where it is built).

    .venv/bin/python bench/proposers.py [--bundle engines/demo] [--prompts 24] [--repeats 3]

Workloads, both built from the source of click (a dependency of specrt, so installed wherever
specrt is; the pair was trained on the standard library only):

* held-out: a ``def`` line and the 8 lines before it, from every click module in turn;
* the pair's own held-out prompts (`models/demo/heldout_prompts.jsonl`: standard library files
  kept out of its training), for comparison;
* repetitive: the first 30 lines of a click module, a blank line, then its first 3 lines again
  (the file continued after a copy of its beginning).

Every contender runs every prompt (greedy unless --temperature, 128 new tokens, EOS ignored),
interleaved prompt by prompt, ``--repeats`` times; a contender's time on a prompt is its median
over the repeats and its speed-up is the target alone's time over it. Every greedy output is
checked against the target alone's. Where the bundle changes (the head's), an untimed pass of
16 tokens runs first: one bundle's weights push the other's out of the CPU caches, which made
the first contender after a switch up to a quarter slower. Each contender learns (its
schedules, the hybrid's rates) from its own rounds only, as alone in a process; the suffix
cache starts empty in each repeat and learns from the rows before (a batch job's order).
Prints a table per workload and writes JSON (--out). Then the held-out set once more,
``--batch-size`` rows per model call (`specrt batch`'s path): each contender's tokens/s over
two runs against the target alone batched the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 128

MODEL = dict(proposer="model", draft_schedule="fixed")  # the draft model, K every round
LOOKUP = dict(proposer="lookup", draft_schedule="fixed")
CONTENDERS = {
    "target alone": dict(num_draft_tokens=0),
    "model K=2": dict(num_draft_tokens=2, **MODEL),
    "model K=4": dict(num_draft_tokens=4, **MODEL),
    "model K=6": dict(num_draft_tokens=6, **MODEL),
    "model adaptive K<=4": dict(num_draft_tokens=4, draft_schedule="adaptive", proposer="model"),
    "lookup K=4": dict(num_draft_tokens=4, **LOOKUP),
    "lookup K=8": dict(num_draft_tokens=8, **LOOKUP),
    "suffix+lookup K=4 (batch)": dict(num_draft_tokens=4, **LOOKUP, suffix=True),
    "hybrid adaptive K<=4 (default)": dict(
        num_draft_tokens=4, draft_schedule="adaptive", proposer="hybrid"
    ),
    "hybrid adaptive K<=8": dict(num_draft_tokens=8, draft_schedule="adaptive", proposer="hybrid"),
    "hybrid+suffix (batch)": dict(
        num_draft_tokens=4, draft_schedule="adaptive", proposer="hybrid", suffix=True
    ),
}
# The same target with an EAGLE-3 head as its draft (--eagle-bundle): the head drafts where the
# draft model does above ("model" is the bundle's drafter).
EAGLE_CONTENDERS = {
    "eagle: target alone": dict(num_draft_tokens=0),
    "eagle K=4": dict(num_draft_tokens=4, **MODEL),
    "eagle K=6": dict(num_draft_tokens=6, **MODEL),
    "eagle adaptive K<=6": dict(num_draft_tokens=6, draft_schedule="adaptive", proposer="model"),
    "eagle+lookup hybrid K<=6": dict(
        num_draft_tokens=6, draft_schedule="adaptive", proposer="hybrid"
    ),
}


def click_sources() -> list[Path]:
    return sorted(Path(click.__file__).parent.glob("*.py"))


def heldout_prompts(count: int) -> list[str]:
    """A ``def`` line and the 8 lines before it, evenly spread over click's modules."""
    found = []
    for path in click_sources():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and i >= 8:
                found.append("\n".join(lines[i - 8 : i + 1]) + "\n")
    step = max(1, len(found) // count)
    return found[::step][:count]


def repetitive_prompts(count: int) -> list[str]:
    """A module's first 30 lines, then its first 3 lines again."""
    found = []
    for path in click_sources():
        lines = path.read_text().splitlines()
        if len(lines) >= 60:
            found.append("\n".join(lines[:30]) + "\n\n" + "\n".join(lines[:3]) + "\n")
    return found[:count]


def learning_apart(generator, suffix_cache=None):
    """A generator over ``generator``'s loaded models that has learned nothing yet: each
    contender learns its schedules and the hybrid's rates from its own rounds, as it would
    alone in a process (contenders that share one generator share what it learns: the
    draft-only contender's rounds would steer the hybrid's model rounds)."""
    from specrt.runtime import SpeculativeGenerator

    return SpeculativeGenerator(
        generator.target,
        generator.draft,
        generator.tokenizer,
        generator.eos_token_ids,
        suffix_cache=suffix_cache,
    )


def run_workload(
    generator, prompts: list[str], repeats: int, log, temperature: float = 0.0, eagle=None
) -> dict:
    """``eagle``: a generator of the same target with an EAGLE-3 head (`EAGLE_CONTENDERS`)."""
    from specrt.runtime import GenerationConfig
    from specrt.runtime.lookup import SuffixCache

    contenders = {**CONTENDERS, **(EAGLE_CONTENDERS if eagle is not None else {})}
    loaded = {name: eagle if name in EAGLE_CONTENDERS else generator for name in contenders}
    ids = generator.encode_prompts(prompts)
    seconds = {name: [[] for _ in ids] for name in contenders}
    proposers: dict[str, dict] = {name: {} for name in contenders}
    runners = {name: learning_apart(loaded[name]) for name in contenders}
    previous = None  # the generator that ran last
    for repeat in range(repeats):
        # Each suffix contender learns from its own earlier rows only.
        for name, options in contenders.items():
            if options.get("suffix"):
                runners[name] = learning_apart(loaded[name], SuffixCache())
        for row, prompt in enumerate(ids):
            reference = None
            for name, options in contenders.items():
                options = dict(options)
                options.pop("suffix", None)
                runner = runners[name]
                if loaded[name] is not previous:  # another bundle's weights: out of the caches
                    previous = loaded[name]
                    warm = GenerationConfig(max_new_tokens=16, num_draft_tokens=0, ignore_eos=True)
                    previous.generate([prompt], warm)
                config = GenerationConfig(
                    max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=temperature, **options
                )
                runner.forget_kept_rows()  # each contender reads the prompt itself
                started = time.perf_counter()
                [result] = runner.generate([prompt], config)
                seconds[name][row].append(time.perf_counter() - started)
                if reference is None or temperature > 0:  # sampled outputs differ
                    reference = result.token_ids
                elif result.token_ids != reference:
                    raise SystemExit(f"{name} changed the output of prompt {row}")
                if repeat == 0:
                    for source, entry in result.stats.proposers.items():
                        total = proposers[name].setdefault(source, {"proposed": 0, "accepted": 0})
                        total["proposed"] += entry["proposed"]
                        total["accepted"] += entry["accepted"]
        log(f"  repeat {repeat + 1}/{repeats} done")
    baseline = [statistics.median(times) for times in seconds["target alone"]]
    table = {}
    for name in contenders:
        own = [statistics.median(times) for times in seconds[name]]
        speedups = [b / s for b, s in zip(baseline, own)]
        table[name] = {
            "median_speedup": statistics.median(speedups),
            "min_speedup": min(speedups),
            "max_speedup": max(speedups),
            "total_speedup": sum(baseline) / sum(own),
            "tokens_per_s": len(ids) * NEW_TOKENS / sum(own),
            "proposers": {
                source: {**entry, "acceptance": entry["accepted"] / max(1, entry["proposed"])}
                for source, entry in proposers[name].items()
            },
        }
    return table


BATCH_CONTENDERS = {
    "target alone": dict(num_draft_tokens=0),
    "model adaptive K<=4": dict(draft_schedule="adaptive", proposer="model"),
    "lookup K=4": LOOKUP,
    "hybrid adaptive K<=4 (default)": dict(proposer="hybrid", draft_schedule="adaptive"),
    "hybrid+suffix": dict(proposer="hybrid", draft_schedule="adaptive", suffix=True),
}


def run_batched(bundle: str, prompts: list[str], batch_size: int, repeats: int) -> dict:
    """`specrt batch`'s path: every contender runs all prompts ``batch_size`` rows per call,
    in turn, ``repeats`` times (the order reversed every other time); tokens/s over all runs.
    The suffix cache starts empty in each run."""
    from specrt.runtime import GenerationConfig, SpeculativeGenerator
    from specrt.runtime.lookup import SuffixCache

    loaded = SpeculativeGenerator.from_bundle(bundle, max_batch=batch_size)
    seconds = {name: 0.0 for name in BATCH_CONTENDERS}
    reference = None
    for repeat in range(repeats):
        names = list(BATCH_CONTENDERS)
        for name in names if repeat % 2 == 0 else names[::-1]:
            options = dict(BATCH_CONTENDERS[name])
            cache = SuffixCache() if options.pop("suffix", False) else None
            generator = learning_apart(loaded, cache)  # a batch job's process, from scratch
            config = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, **options)
            generator.forget_kept_rows()  # each contender reads the prompts itself
            started = time.perf_counter()
            results = generator.generate(prompts, config)
            seconds[name] += time.perf_counter() - started
            tokens = [r.token_ids for r in results]
            if reference is None:
                reference = tokens
            elif tokens != reference:
                raise SystemExit(f"{name} changed the output (batched)")
    base = seconds["target alone"]
    return {name: {"speedup": base / value} for name, value in seconds.items()}


def print_table(title: str, table: dict) -> None:
    print(f"\n{title}")
    print(f"{'contender':32} {'median':>7} {'min':>6} {'max':>6} {'total':>6}  acceptance")
    for name, row in table.items():
        acceptance = ", ".join(
            f"{source} {entry['acceptance']:.2f}" for source, entry in row["proposers"].items()
        )
        print(
            f"{name:32} {row['median_speedup']:6.2f}x {row['min_speedup']:5.2f}x "
            f"{row['max_speedup']:5.2f}x {row['total_speedup']:5.2f}x  {acceptance}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default=str(REPO / "engines" / "demo"))
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--repetitive-prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8, help="0 skips the batched runs")
    parser.add_argument("--batched-only", action="store_true", help="Only the batched runs.")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="Sample (unseeded) instead of greedy."
    )
    parser.add_argument(
        "--held-out-only", action="store_true", help="Only the click held-out workload."
    )
    parser.add_argument(
        "--eagle-bundle",
        default=str(REPO / "engines" / "demo-eagle"),
        help="The same target with an EAGLE-3 head (skipped where it is not built).",
    )
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "proposers.json"))
    args = parser.parse_args()

    from specrt.runtime import SpeculativeGenerator

    generator = SpeculativeGenerator.from_bundle(args.bundle)
    eagle = None
    if (Path(args.eagle_bundle) / "manifest.json").is_file():
        eagle = SpeculativeGenerator.from_bundle(args.eagle_bundle)
    results = {"bundle": args.bundle, "new_tokens": NEW_TOKENS, "repeats": args.repeats}
    from specrt.prompts import read_prompt_file

    own = read_prompt_file(REPO / "models" / "demo" / "heldout_prompts.jsonl")
    workloads = {
        "held-out (click source)": heldout_prompts(args.prompts),
        "the pair's own held-out files (standard library)": own[: args.prompts],
        "repetitive (a click module continued after a copy of its beginning)": (
            repetitive_prompts(args.repetitive_prompts)
        ),
    }
    for title, prompts in workloads.items():
        if args.batched_only or (args.held_out_only and not title.startswith("held-out")):
            continue
        print(f"{title}: {len(prompts)} prompts", flush=True)
        log = lambda m: print(m, flush=True)  # noqa: E731
        table = run_workload(generator, prompts, args.repeats, log, args.temperature, eagle)
        results[title] = table
        print_table(title, table)
    if args.batch_size:
        title = f"held-out (click source), {args.batch_size} rows per model call"
        table = run_batched(args.bundle, workloads["held-out (click source)"], args.batch_size, 2)
        results[title] = table
        print(f"\n{title}")
        for name, row in table.items():
            print(f"{name:32} {row['speedup']:6.2f}x")
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
