"""Run every contender on every prompt, interleaved, and summarise side by side."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from specrt.bench.contenders import HFContender, Run, SpecrtContender
from specrt.bench.costs import step_seconds
from specrt.bench.defaults import BENCH_MAX_DRAFT_TOKENS, BENCH_NEW_TOKENS
from specrt.bench.genai import check_genai_environment, run_genai
from specrt.bundle import read_manifest
from specrt.runtime import SpeculativeGenerator
from specrt.runtime.loading import load_pair

BASELINE = "specrt target only"
SCHEDULES = ("adaptive", "heuristic")
PROPOSER_K = 4  # of the prompt-lookup and hybrid contenders (the CLI's default K)


def predicted_speedup(
    alpha: float, k: int, cost_ratio: float, verify_cost_ratio: float = 1.0
) -> float:
    """Leviathan et al.: expected tokens per round over the round's cost in target steps.

    The formula takes a verification pass of K+1 tokens to cost one target step
    (``verify_cost_ratio`` 1); the measured ratio gives the prediction for this machine."""
    tokens = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (verify_cost_ratio + k * cost_ratio)


def run_benchmark(
    bundle: str | Path,
    prompts: Sequence[str],
    max_new_tokens: int = BENCH_NEW_TOKENS,
    threads: int | None = None,
    ks: Sequence[int] = tuple(range(1, BENCH_MAX_DRAFT_TOKENS + 1)),
    temperatures: Sequence[float] = (0.0, 1.0),
    with_transformers: bool = True,
    seed: int = 0,
    engine: str = "auto",
    chat: bool = False,
    genai: tuple[Path, Path] | None = None,
    genai_ks: Sequence[int] = (2, 4, 6),
    log: Callable[[str], None] = lambda message: None,
) -> dict:
    """``chat``: the prompts are rendered chats (their special tokens written out: none
    added, as `specrt serve` feeds them). ``genai``: (python of the onnxruntime-genai
    environment, its built models dir)."""
    threads = threads or os.cpu_count() or 1
    if genai is not None:
        check_genai_environment(*genai)
    pair = load_pair(bundle, threads=threads, engine=engine)
    generator = SpeculativeGenerator.from_pair(pair)
    inputs = list(prompts)
    if chat:
        tokenizer = generator.tokenizer
        inputs = [tokenizer.encode(text, add_special_tokens=False) for text in inputs]
    prompt_ids = generator.encode_prompts(inputs)
    contenders: list = [SpecrtContender(generator, 0)]
    contenders += [SpecrtContender(generator, k) for k in ks]
    contenders += [SpecrtContender(generator, max(ks), schedule) for schedule in SCHEDULES]
    lookup_k = min(PROPOSER_K, max(ks))  # drafters without a model (issue 15's defaults)
    contenders.append(SpecrtContender(generator, lookup_k, "fixed", "lookup"))
    contenders.append(SpecrtContender(generator, lookup_k, "adaptive", "hybrid"))
    skipped = {}
    if with_transformers:
        manifest = read_manifest(bundle)
        sources = {role: Path(spec.source) for role, spec in manifest.models.items()}
        try:
            contenders.append(HFContender(sources["target"], None, threads))
            contenders.append(HFContender(sources["target"], sources["draft"], threads))
            contenders.append(HFContender(sources["target"], None, threads, lookup_k))
        except (ImportError, OSError) as exc:
            skipped["transformers"] = f"{type(exc).__name__}: {exc}"
            log(f"skipping transformers contenders: {skipped['transformers']}")

    target_step = step_seconds(pair.target)
    costs = {
        "target_step_s": target_step,
        "draft_step_s": step_seconds(pair.draft),
        "verify_cost_ratio": {
            str(k): step_seconds(pair.target, tokens=k + 1) / target_step for k in ks
        },
    }
    costs["cost_ratio"] = costs["draft_step_s"] / target_step
    log(f"cost ratio c = draft step / target step = {costs['cost_ratio']:.3f}")

    for contender in contenders:  # warm-up: first calls allocate and compile
        contender.run(prompt_ids[0][:32], 0.0, 8, seed)
    runs: dict[float, dict[str, list[Run]]] = {
        t: {c.name: [] for c in contenders} for t in temperatures
    }
    passes = len(temperatures) * len(prompt_ids)
    log(
        f"{len(contenders)} contenders x {len(prompt_ids)} prompts x {len(temperatures)} "
        f"temperatures, {max_new_tokens} new tokens each: a line per prompt, with the time left"
    )
    started, done = time.perf_counter(), 0
    for temperature in temperatures:
        for index, prompt in enumerate(prompt_ids):
            for contender in contenders:
                run = contender.run(prompt, temperature, max_new_tokens, seed + index)
                runs[temperature][contender.name].append(run)
            done += 1
            left = (time.perf_counter() - started) / done * (passes - done)
            log(
                f"temperature {temperature}: prompt {index + 1}/{len(prompt_ids)} done "
                f"(about {left / 60:.1f} minutes left)"
            )

    results = {_label(t): _summarise(runs[t], costs, contenders) for t in temperatures}
    if genai is not None:
        log("running onnxruntime-genai in its own environment")
        sampled = [t for t in temperatures if t > 0]
        for report in run_genai(
            genai[0], genai[1], prompts, max_new_tokens, threads, genai_ks, max(sampled or [0])
        ):
            label = _label(report["temperature"])
            if label not in results:
                continue
            baseline = results[label][BASELINE]["tokens_per_second"]
            entry = {
                "tokens_per_second": report["tokens_per_second"],
                "speedup": report["tokens_per_second"] / baseline,
            }
            for key in ("acceptance_rate", "tokens_per_round", "identical_output"):
                if key in report:
                    entry[key] = report[key]
            results[label][report["contender"]] = entry
    return {
        "bundle": str(bundle),
        "prompts": len(prompt_ids),
        "max_new_tokens": max_new_tokens,
        "threads": threads,
        "engine": engine,
        "costs": costs,
        "results": results,
        "skipped": skipped,
    }


def _label(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"temperature {temperature:g}"


def _summarise(runs: dict[str, list[Run]], costs: dict, contenders) -> dict:
    baseline = statistics.median(r.tokens_per_second for r in runs[BASELINE])
    summary = {}
    for contender in contenders:
        name, rows = contender.name, runs[contender.name]
        tps = statistics.median(r.tokens_per_second for r in rows)
        entry = {"tokens_per_second": tps, "speedup": tps / baseline}
        if rows[0].model_seconds is not None:
            total = sum(r.seconds for r in rows)
            entry["overhead_fraction"] = (total - sum(r.model_seconds for r in rows)) / total
        if isinstance(contender, SpecrtContender) and contender.k:
            entry.update(_acceptance(rows, contender.k, contender.proposer == "model"))
            if contender.schedule == "fixed" and contender.proposer == "model":
                alpha, k, c = entry["alpha"], contender.k, costs["cost_ratio"]
                entry["predicted_speedup"] = predicted_speedup(alpha, k, c)
                verify = costs["verify_cost_ratio"][str(k)]
                entry["predicted_speedup_measured_verify"] = predicted_speedup(alpha, k, c, verify)
        summary[name] = entry
    return summary


def _acceptance(rows: list[Run], k: int, capped: bool) -> dict:
    """``capped``: every round proposes K tokens at most (the draft model); then alpha, the
    per-token acceptance of the i.i.d. model behind the predicted speedup, is its MLE. Matches
    (lookup rounds shorter than K, the hybrid's up to 24) have no such K: no alpha for them."""
    drafted = sum(r.stats["drafted_tokens"] for r in rows)
    accepted = sum(r.stats["accepted_tokens"] for r in rows)
    rounds = sum(r.stats["rounds"] for r in rows)
    per_position = [0] * max(len(r.stats["accepted_per_position"]) for r in rows)
    for run in rows:
        for i, count in enumerate(run.stats["accepted_per_position"]):
            per_position[i] += count
    entry = {
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_round": sum(r.new_tokens for r in rows) / rounds,
        "accepted_per_position_rate": [count / rounds for count in per_position],
    }
    if capped:
        rejections = rounds - (per_position[k - 1] if k <= len(per_position) else 0)
        total = accepted + rejections
        entry["alpha"] = accepted / total if total else 0.0
    return entry
