"""onnxruntime-genai on the demo pair, on the same held-out prompts as `specrt bench`.

Run with the environment made by bench/genai_env.sh:
    build/genai-venv/bin/python bench/genai_bench.py --models build/genai --threads 2

Measures the median over prompts of tokens/s (batch 1, --max-new-tokens new tokens, prefill
included, EOS held off by min_length so every run makes exactly that many, after a warm-up) of:
- "onnxruntime-genai target only": the target alone, greedy and at --temperature;
- "onnxruntime-genai speculative K=k": genai's own draft-model speculative decoding, greedy and
  at --temperature, for each K in --num-draft-tokens (drafted per round). The two built folders are
  composed in memory with Config.overlay: model.type "speculative", the draft's decoder block as
  model.draft, and speculative.max_draft_tokens; GeneratorParams.set_speculative_options sets K
  too. Acceptance counts from Generator.get_speculative_stats() are summed over the prompts.
Sampling draws from the full distribution (top_k 0, top_p 1), seeded per prompt. Speculative
greedy output is compared token for token with target-only greedy ("identical_output"). --threads
goes into the session options of both models. One JSON object per contender is printed;
--json-out also writes them all to a file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import onnxruntime_genai as og
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # specrt is not installed in this environment; its reader is plain
from specrt.prompts import read_prompt_file  # noqa: E402

# Counters of get_speculative_stats() that add up over prompts.
STAT_COUNTS = (
    "rounds",
    "draft_tokens_proposed",
    "draft_tokens_evaluated",
    "draft_tokens_accepted",
    "correction_tokens",
    "bonus_tokens",
    "tokens_emitted",
    "tokens_discarded",
    "full_accept_rounds",
    "partial_accept_rounds",
    "zero_accept_rounds",
    "draft_forward_passes",
    "target_forward_passes",
    "total_draft_ms",
    "total_target_ms",
)


def session_options(threads: int) -> dict:
    return {"session_options": {"intra_op_num_threads": threads}}


def load_target(models: Path, threads: int, folder: str = "target") -> og.Model:
    """The model in ``models/folder`` (``folder`` "": ``models`` itself)."""
    config = og.Config(str(models / folder))
    config.overlay(json.dumps({"model": {"decoder": session_options(threads)}}))
    return og.Model(config)


def load_speculative(models: Path, threads: int, k: int) -> og.Model:
    """The target's config, plus the draft's decoder block as model.draft (paths are relative
    to the target folder, where the composed config is rooted)."""
    draft = json.loads((models / "draft" / "genai_config.json").read_text())["model"]["decoder"]
    draft["filename"] = str(Path("..") / "draft" / draft["filename"])
    draft.setdefault("session_options", {})["intra_op_num_threads"] = threads
    overlay = {
        "model": {"type": "speculative", "decoder": session_options(threads), "draft": draft},
        "speculative": {"max_draft_tokens": k},
    }
    config = og.Config(str(models / "target"))
    config.overlay(json.dumps(overlay))
    return og.Model(config)


def generate(
    model: og.Model, ids: list[int], new_tokens: int, temperature: float, seed: int, k: int
) -> tuple[float, list[int], dict]:
    """One run: (tokens/s, new token ids, speculative stats or {})."""
    params = og.GeneratorParams(model)
    total = len(ids) + new_tokens
    search: dict = dict(max_length=total, min_length=total, do_sample=temperature > 0)
    if temperature > 0:
        search.update(temperature=temperature, top_k=0, top_p=1.0, random_seed=seed)
    params.set_search_options(**search)
    if k:
        params.set_speculative_options(max_draft_tokens=k)
    generator = og.Generator(model, params)
    started = time.perf_counter()
    generator.append_tokens(ids)
    while not generator.is_done():
        generator.generate_next_token()
    seconds = time.perf_counter() - started
    out = [int(t) for t in generator.get_sequence(0)[len(ids) :]]
    if len(out) != new_tokens:
        raise RuntimeError(f"generated {len(out)} tokens, expected {new_tokens}")
    return len(out) / seconds, out, generator.get_speculative_stats() if k else {}


def measure(
    model: og.Model, prompts: list[list[int]], args: argparse.Namespace, temperature: float, k: int
) -> tuple[dict, list[list[int]]]:
    generate(model, prompts[0], 8, temperature, args.seed, k)  # warm-up
    rates, outputs, totals = [], [], dict.fromkeys(STAT_COUNTS, 0.0)
    for i, ids in enumerate(prompts):
        rate, out, stats = generate(model, ids, args.max_new_tokens, temperature, args.seed + i, k)
        rates.append(rate)
        outputs.append(out)
        for key in STAT_COUNTS:
            totals[key] += stats.get(key, 0)
    report = {
        "contender": "onnxruntime-genai " + (f"speculative K={k}" if k else "target only"),
        "temperature": temperature,
        "tokens_per_second": statistics.median(rates),
        "tokens_per_second_per_prompt": [round(rate, 2) for rate in rates],
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
    }
    if k:
        evaluated, rounds = totals["draft_tokens_evaluated"], totals["rounds"]
        report["num_draft_tokens"] = k
        report["acceptance_rate"] = totals["draft_tokens_accepted"] / evaluated if evaluated else 0
        report["tokens_per_round"] = totals["tokens_emitted"] / rounds if rounds else 0
        report["speculative_stats"] = {key: round(value, 3) for key, value in totals.items()}
    return report, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=REPO / "build" / "genai")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--num-draft-tokens", default="4", help="K in [1, 16], or a comma list: 2,4,6"
    )
    parser.add_argument(
        "--prompt-file",
        type=Path,
        default=REPO / "models" / "demo" / "heldout_prompts.jsonl",
        help='JSON lines, {"prompt": ...} each',
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy runs only")
    parser.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i")
    parser.add_argument("--json-out", type=Path, help="also write the summary here")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_file(str(REPO / "models" / "demo" / "tokenizer" / "tokenizer.json"))
    texts = read_prompt_file(args.prompt_file)[: args.num_prompts]
    prompts = [tokenizer.encode(text).ids for text in texts]
    temperatures = [0.0] + ([args.temperature] if args.temperature > 0 else [])

    reports, greedy = [], []
    model = load_target(args.models, args.threads)
    for temperature in temperatures:
        report, outputs = measure(model, prompts, args, temperature, 0)
        reports.append(report)
        greedy = greedy or outputs
    del model  # time the speculative pair without a second target session alive
    for k in [int(k) for k in str(args.num_draft_tokens).split(",")]:
        model = load_speculative(args.models, args.threads, k)
        for temperature in temperatures:
            report, outputs = measure(model, prompts, args, temperature, k)
            if temperature == 0:
                same = [a == b for a, b in zip(outputs, greedy, strict=True)]
                report["identical_output"] = all(same)
                report["identical_prompts"] = sum(same)
            reports.append(report)
        del model

    for report in reports:
        print(json.dumps(report))
    if args.json_out:
        args.json_out.write_text(json.dumps({"contenders": reports}, indent=1) + "\n")


if __name__ == "__main__":
    main()
