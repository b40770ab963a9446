"""The device check: build GPU engines, check exactness and measure speed on an NVIDIA GPU.

    bash bench/gpu_check.sh                      # on the GPU machine (sets up onnxruntime-gpu)
    .venv/bin/python bench/gpu_check.py --dry-run   # anywhere: tiny shapes, the CPU twin

For the shipped demo pair and a random-weight pair at real shapes (a Llama-3.2-1B-shaped target,
a ~0.1B draft, vocabulary 128256), through the project's own export path (float16 cuda engines,
no portable graph: the GPU machine has no optimum). Both pairs are built first (the demo pair
twice: its batched graph and the one-row GroupQueryAttention graph), before any clock starts.
Then each pair gets its own measuring budget (``--demo-budget-s``, ``--llama-budget-s``): first
batches (``--batch-sizes``: B rows per engine call through `run`, as `specrt batch` runs them,
the target alone and speculative: total tokens/s, and how many rows equal the one-row
target-only output; no new batch size past BATCH_SHARE of the budget); then one row:
speculative greedy output must equal target-only output; target-only tokens/s, K = 1..8 and
adaptive (no new contender past CONTENDER_SHARE), the draft/target step cost c and the verify
cost v_K (greedy steps: each row's argmax comes back, not its logits), the time outside
onnxruntime, the bytes each round brings back to the host; then, while the budget lasts, the
one-row target alone with host inputs re-bound each call and with device twins
(`specrt.backends.host_inputs.TRANSFER` "rebind" / "update"), a prompt that copies its
beginning from a finished row's kept cache (copied on the device) against the target alone,
the demo pair's one-row
GroupQueryAttention graph beside the batched one (`cuda_attention`), the draft step with CUDA
graphs, and transformers assisted generation on the same GPU. Whether the CUDA provider takes
every node of each engine is asked first. Writes one JSON report (after every phase), prints a
table. ``--dry-run`` shrinks the random pair and runs the CUDA path on the CPU under CUDA's rule
for host inputs (`tests/cuda_rule.py`: needs the dev extra's pytest); its numbers mean nothing,
only that every step runs.

Time on the GPU machine (16 cores, H200), which gpu_check.sh stops at 480 s: building the
1B-shaped pair took ~150 s on our 2-core machine (46 s for the random checkpoints, 107 s for the
engines, 14.7 GB RSS), so ~60-90 s there for both pairs (an estimate: not yet run on it); then
60 + 180 s of measuring and ~30 s of loading and of phases that finish past their budget: ~5-6
minutes, leaving room for a second run within the machine's 15 minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specrt.backends import host_inputs  # noqa: E402
from specrt.bench.costs import step_seconds  # noqa: E402
from specrt.bench.runner import predicted_speedup  # noqa: E402
from specrt.prompts import read_prompt_file  # noqa: E402
from specrt.runtime import GenerationConfig, SpeculativeGenerator  # noqa: E402
from specrt.runtime.batching import Request  # noqa: E402
from specrt.runtime.loading import load_pair  # noqa: E402

CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
BATCH_SHARE = 0.45  # of a pair's budget: no new batch size after it
CONTENDER_SHARE = 0.8  # no new one-row contender after it; the rest for the probes after them
LLAMA_1B = dict(  # Llama-3.2-1B's shape
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
DRAFT_01B = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
REAL_VOCAB = 128256
DEMO_HEAD = REPO / "models" / "demo" / "head"  # the demo target's EAGLE-3 head
TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=True,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, on the CPU")
    parser.add_argument("--work", type=Path, default=REPO / "build" / "gpu")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "gpu_report.json")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--demo-budget-s", type=float, default=60.0, help="measuring, demo pair")
    parser.add_argument(
        "--llama-budget-s", type=float, default=180.0, help="measuring, the 1B-shaped pair"
    )
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 4, 16, 64])
    parser.add_argument("--batch-prompts", type=int, default=64)
    args = parser.parse_args()
    started = time.monotonic()
    if args.dry_run:  # the CUDA path on the CPU, under CUDA's rule for host inputs
        from pytest import MonkeyPatch

        from tests.cuda_rule import cuda_on_cpu

        cuda_on_cpu(MonkeyPatch()).__enter__()
    report: dict = {"dry_run": args.dry_run, "machine": machine(), "pairs": {}}
    args.work.mkdir(parents=True, exist_ok=True)

    demo = (REPO / "models" / "demo" / "target", REPO / "models" / "demo" / "draft")
    sources = {"demo": demo, "llama-1b-shaped": (random_pair, args.work / "random", args.dry_run)}
    budgets = {"demo": args.demo_budget_s, "llama-1b-shaped": args.llama_budget_s}
    built = {}
    for name, source in sources.items():  # both built before any clock starts
        entry = report["pairs"][name] = {}
        built[name] = build_pair(name, source, phases(name, entry, report, args), args)
    report["build_s"] = round(time.monotonic() - started, 1)
    for name, pair in built.items():
        if pair is not None:
            entry = report["pairs"][name]
            check_pair(name, pair, entry, phases(name, entry, report, args), args, budgets[name])
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    write(report, args.out)
    print(table(report))


class Clock:
    """A pair's measuring budget, started when its measuring starts."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.started = seconds, time.monotonic()

    def within(self, share: float = 1.0) -> bool:
        """Whether less than ``share`` of the budget is spent."""
        return time.monotonic() - self.started < share * self.seconds


def phases(name: str, entry: dict, report: dict, args):
    """A runner of one pair's phases, each on its own: a failure is recorded in the report
    (written after every phase) and the next phases still run: a GPU's first run may fail
    anywhere, and minutes there are scarce."""

    def step(label: str, work, *inputs) -> object:
        try:
            return work(*inputs)
        except Exception as exc:  # noqa: BLE001 - recorded in the report, the run goes on
            entry[f"{label}_failed"] = f"{type(exc).__name__}: {exc}"
            log(f"{name}: {label} failed: {exc!r}")
            return None
        finally:
            write(report, args.out)

    return step


def build_pair(name: str, source, step, args) -> tuple | None:
    """The pair's checkpoints and cuda bundles (the demo pair's GroupQueryAttention one and its
    EAGLE head's too): (target, draft, bundle, group-query bundle or None, head bundle or
    None), or None where a build failed."""
    started = time.monotonic()
    log(f"{name}: building cuda engines")
    pair = step("source", *source) if callable(source[0]) else source
    bundle = pair and step("build", build, *pair, args.work / f"{name}-bundle")
    if bundle is None:
        return None
    target, draft = pair
    one_row = head = None
    if name == "demo":
        one_row_dir = args.work / "demo-group-query-bundle"
        one_row = step("group_query_build", build, target, draft, one_row_dir, "group_query")
        head = step("eagle_build", build, target, DEMO_HEAD, args.work / "demo-eagle-bundle")
    log(f"{name}: built in {time.monotonic() - started:.1f} s")
    return target, draft, bundle, one_row, head


def check_pair(name: str, built: tuple, entry: dict, step, args, budget_s: float) -> None:
    """Every measuring phase for one built pair, within its budget (the phases after the
    one-row contenders start only while it lasts)."""
    target, draft, bundle, one_row, head = built
    clock = Clock(budget_s)
    entry["budget_s"] = budget_s
    if not args.dry_run:
        entry["every_node_on_cuda"] = step("placement", placement, bundle)
        log(f"{name}: every node on CUDA: {entry['every_node_on_cuda']}")
    entry["batches"] = step("batches", batches, bundle, name, args, clock) or {}
    step("measure", measure, bundle, name, entry, args, clock)
    probes = []  # (report key, work, inputs)
    if head is not None and "prompt_ids" in entry:
        probes.append(("eagle_head", eagle_head, head, entry, args))
    probes.append(("host_inputs", host_transfer, bundle, name, args))
    probes.append(("kept_rows", kept_rows, bundle, name, args))
    probes.append(("processors", processors, bundle, name, args))
    if one_row is not None and "prompt_ids" in entry:
        probes.append(("group_query_one_row", group_query_one_row, one_row, entry, args))
    if not args.dry_run:
        probes.append(("cuda_graph_draft_step", cuda_graph_probe, bundle))
        probes.append(("cuda_graph_target_step", cuda_graph_probe, bundle, 64, "target"))
        if "prompt_ids" in entry:
            probes.append(("transformers", transformers_assisted, target, draft, entry, args))
    for key, work, *inputs in probes:
        within = clock.within()
        entry[key] = step(key, work, *inputs) if within else {"skipped": "out of time"}
    entry["measure_s"] = round(time.monotonic() - clock.started, 1)
    entry.pop("prompt_ids", None)


def machine() -> dict:
    import onnxruntime as ort

    info = {"onnxruntime": ort.__version__, "providers": ort.get_available_providers()}
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def random_pair(root: Path, dry_run: bool, target_layers: int | None = None) -> tuple[Path, Path]:
    """Random-weight Llama checkpoints at real shapes (tiny ones in a dry run); the target with
    ``target_layers`` layers where given (Llama-3.2-1B has 16)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specrt.export.tiny import make_tokenizer

    if (root / "target" / "config.json").is_file():
        return root / "target", root / "draft"
    base = make_tokenizer()
    vocab = 4096 if dry_run else REAL_VOCAB
    tokenizer = make_tokenizer(extra_tokens=max(0, vocab - len(base)))
    target = {**LLAMA_1B, "num_hidden_layers": target_layers or LLAMA_1B["num_hidden_layers"]}
    for role, shape in (("target", target), ("draft", DRAFT_01B)):
        shape = TINY if dry_run else shape
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            max_position_embeddings=2048,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **shape,
        )
        torch.manual_seed(0 if role == "target" else 1)
        model = LlamaForCausalLM(config).eval()
        model.save_pretrained(root / role)
        tokenizer.save_pretrained(root / role)
    return root / "target", root / "draft"


def build(target: Path, draft: Path, out: Path, cuda_attention: str = "batched") -> Path:
    from specrt.export import export_bundle

    export_bundle(
        target,
        draft,
        out,
        force=True,
        portable=False,
        devices=("cuda",),
        cuda_attention=cuda_attention,
        log=log,
    )
    return out


def placement(bundle: Path) -> dict:
    """Whether the CUDA provider takes every node of each cuda engine: a session not allowed
    to fall back to the CPU either opens, or says what it could not place."""
    import onnxruntime as ort

    from specrt.bundle import read_manifest

    out = {}
    for role, spec in read_manifest(bundle).models.items():
        options = ort.SessionOptions()
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        path = str(bundle / spec.engines["cuda"].path)
        try:
            ort.InferenceSession(path, options, providers=["CUDAExecutionProvider"])
            out[role] = True
        except Exception as exc:  # noqa: BLE001 - the probe reports whatever happens
            out[role] = f"{type(exc).__name__}: {str(exc)[:400]}"
    return out


def group_query_one_row(bundle: Path, entry: dict, args) -> dict:
    """One row on the cuda engine built as GroupQueryAttention (`cuda_attention`; what Gemma 2
    gets), the same prompts: target alone and K = 4, median tokens/s, to set beside the
    batched graph's `results`."""
    generator = SpeculativeGenerator.from_pair(generator_for(bundle, args.dry_run))
    out = {}
    for label, k in (("target only", 0), ("K=4", 4)):
        config = GenerationConfig(
            max_new_tokens=args.new_tokens, num_draft_tokens=k, ignore_eos=True,
            proposer="model", draft_schedule="fixed",
        )  # fmt: skip
        generator.generate(entry["prompt_ids"][:1], config)  # warm-up
        rates = []
        for prompt in entry["prompt_ids"]:
            generator.forget_kept_rows()  # each mode reads its prompts itself
            t0 = time.perf_counter()
            [result] = generator.generate([prompt], config)
            rates.append(len(result.token_ids) / (time.perf_counter() - t0))
        out[label] = statistics.median(rates)
    return out


def eagle_head(bundle: Path, entry: dict, args) -> dict:
    """The demo target drafted for by its EAGLE-3 head (`models/demo/head`), both on their
    cuda engines, one row, the same prompts: median tokens/s and drafts kept of the target
    alone, the head at K = 2 and 4 and adaptive; whether every output equals the target's."""
    generator = SpeculativeGenerator.from_pair(generator_for(bundle, args.dry_run))
    out: dict = {}
    alone = None
    for label, k, schedule in (
        ("target only", 0, "fixed"),
        ("head K=2", 2, "fixed"),
        ("head K=4", 4, "fixed"),
        ("head adaptive", 6, "adaptive"),
    ):
        config = GenerationConfig(
            max_new_tokens=args.new_tokens, num_draft_tokens=k, ignore_eos=True,
            proposer="model", draft_schedule=schedule,
        )  # fmt: skip
        generator.generate(entry["prompt_ids"][:1], config)  # warm-up
        rates, tokens, kept, drafted = [], [], 0, 0
        for prompt in entry["prompt_ids"]:
            generator.forget_kept_rows()  # each mode reads its prompts itself
            t0 = time.perf_counter()
            [result] = generator.generate([prompt], config)
            rates.append(len(result.token_ids) / (time.perf_counter() - t0))
            tokens.append(result.token_ids)
            kept += result.stats.accepted_tokens
            drafted += result.stats.drafted_tokens
        alone = alone or tokens
        out[label] = {
            "tokens_per_second": statistics.median(rates),
            "acceptance_rate": kept / drafted if drafted else None,
            "equals_target_only": tokens == alone,
        }
    base = out["target only"]["tokens_per_second"]
    for result in out.values():
        result["speedup"] = result["tokens_per_second"] / base
    return out


def generator_for(bundle: Path, dry_run: bool, max_batch: int = 1):
    """The pair on CUDA (a dry run: on the CPU, as `tests/cuda_rule.py` emulates CUDA)."""
    return load_pair(bundle, engine="cuda", providers=CUDA, max_batch=max_batch)


def prompts_for(name: str, generator, count: int) -> list[list[int]]:
    if name == "demo":
        texts = read_prompt_file(REPO / "models" / "demo" / "heldout_prompts.jsonl")
        return generator.encode_prompts([texts[i % len(texts)] for i in range(count)])
    rng = np.random.default_rng(0)
    return [rng.integers(100, generator.target.vocab_size, 64).tolist() for _ in range(count)]


def batches(bundle: Path, name: str, args, clock: Clock) -> dict:
    """Rows through `run` (what `specrt batch` runs) at each batch size, the target alone
    (K = 0) and speculative (the load schedule, K <= 4, model draft): total new tokens over
    wall time, and how many rows equal the one-row target-only output (float16 kernels may
    round a near tie differently at other batch shapes: a count, not a verdict)."""
    from specrt.runtime.batching import Request

    out: dict = {}
    reference = None
    for batch in args.batch_sizes:
        if not clock.within(BATCH_SHARE):
            out[str(batch)] = {"skipped": "out of time"}
            continue
        generator = SpeculativeGenerator.from_pair(generator_for(bundle, args.dry_run, batch))
        prompts = prompts_for(name, generator, args.batch_prompts)
        entry = out[str(batch)] = {
            "max_batch": generator.max_batch,
            "device": generator.target.device,
        }
        for label, k in (("target only", 0), ("speculative", 4)):
            config = GenerationConfig(
                max_new_tokens=args.new_tokens,
                num_draft_tokens=k,
                draft_schedule="adaptive",
                proposer="model",
                ignore_eos=True,
            )
            warm = [Request(0, prompts[0], config, np.random.default_rng(0))]
            list(generator.run(warm))
            requests = [
                Request(i, p, config, np.random.default_rng(i)) for i, p in enumerate(prompts)
            ]
            generator.forget_kept_rows()  # each mode reads its prompts itself
            t0 = time.perf_counter()
            results = dict(generator.run(requests))
            seconds = time.perf_counter() - t0
            tokens = [results[i].token_ids for i in range(len(prompts))]
            if reference is None:  # batch size 1, target alone: the one-row reference
                reference = tokens
            drafted = sum(r.stats.drafted_tokens for r in results.values())
            entry[label] = {
                "tokens_per_s": sum(map(len, tokens)) / seconds,
                "rows_equal_one_row_target_only": sum(a == b for a, b in zip(tokens, reference)),
                "rows": len(tokens),
                "acceptance": sum(r.stats.accepted_tokens for r in results.values()) / drafted
                if drafted
                else None,
            }
        entry["speedup"] = (
            entry["speculative"]["tokens_per_s"] / entry["target only"]["tokens_per_s"]
        )
        log(f"{name}: batch {batch}: {entry}")
    return out


def kept_rows(bundle: Path, name: str, args) -> dict:
    """A prompt that begins as a finished row did, on the device backend: the second of two
    prompts sharing all but the first's last tokens copies that beginning from the first's
    kept cache (copied on the device into a free slot, and back) and must be the target
    alone's."""
    generator = SpeculativeGenerator.from_pair(generator_for(bundle, args.dry_run, 3))
    first, other = prompts_for(name, generator, 2)
    second = first[:-2] + other[:4]
    config = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True, proposer="model")
    generator.generate([first], config)
    [copied] = generator.generate([second], config)
    generator.forget_kept_rows()
    [alone] = generator.generate([second], replace(config, num_draft_tokens=0))
    equal = copied.token_ids == alone.token_ids
    log(f"{name}: kept rows: {copied.stats.cached_tokens} tokens copied, equal: {equal}")
    return {"cached_tokens": copied.stats.cached_tokens, "equals_target_only": equal}


def processors(bundle: Path, name: str, args) -> dict:
    """The logits processors and log-probabilities on the device backend (its logits brought
    back for them): rows with a bias and the penalties, greedy and seeded, sharing calls with a
    row without them, each against the target alone; the log-probabilities of the prompt and
    of the new tokens the same either way; rows under a grammar (structured output) too.
    (The float16 engines may part at a near-tie, as their greedy output may: the report says
    where.)"""
    generator = SpeculativeGenerator.from_pair(generator_for(bundle, args.dry_run, 3))
    prompts = prompts_for(name, generator, 3)
    processed = dict(repetition_penalty=1.2, frequency_penalty=0.5, logit_bias={5: -2.0})
    out = {}
    for label, sampling in (("greedy", {}), ("seeded", dict(temperature=0.8, seed=3))):
        config = GenerationConfig(
            max_new_tokens=args.new_tokens, ignore_eos=True, proposer="model", logprobs=1,
            prompt_logprobs=1, **sampling,
        )  # fmt: skip
        configs = [replace(config, **processed)] * 2 + [config]
        requests = [Request(i, p, c) for i, (p, c) in enumerate(zip(prompts, configs))]
        ran = dict(generator.run(requests))
        generator.forget_kept_rows()
        equal, close = [], []
        for i, (prompt, own) in enumerate(zip(prompts, configs)):
            [alone] = generator.generate([prompt], replace(own, num_draft_tokens=0))
            equal.append(ran[i].token_ids == alone.token_ids)
            pairs = zip(ran[i].prompt_logprobs[1:], alone.prompt_logprobs[1:])
            close.append(max(abs(a.logprob - b.logprob) for a, b in pairs) < 1e-3)
        out[label] = {"equals_target_only": equal, "prompt_logprobs_agree": close}
        log(f"{name}: processors, {label}: equal {equal}, prompt log-probabilities {close}")
    # structured output: a grammar's masks (EOS then ends a row, so it is not ignored)
    regex = {"regex": "[a-z ,.]{1,400}"}
    grammar = GenerationConfig(max_new_tokens=args.new_tokens, structured_output=regex)
    seeded = replace(grammar, temperature=0.8, seed=3)
    configs = [grammar, seeded, replace(grammar, structured_output=None)]
    ran = dict(generator.run(Request(i, p, c) for i, (p, c) in enumerate(zip(prompts, configs))))
    generator.forget_kept_rows()
    equal = []
    for i, (prompt, own) in enumerate(zip(prompts, configs)):
        [alone] = generator.generate([prompt], replace(own, num_draft_tokens=0))
        equal.append(ran[i].token_ids == alone.token_ids)
    out["structured"] = {"equals_target_only": equal}
    log(f"{name}: processors, structured output (greedy, seeded, none): equal {equal}")
    return out


def measure(bundle: Path, name: str, entry: dict, args, clock: Clock) -> None:
    pair = generator_for(bundle, args.dry_run)
    generator = SpeculativeGenerator.from_pair(pair)
    entry["device"] = pair.target.device
    prompts = prompts_for(name, generator, args.prompts)
    entry["prompt_ids"] = prompts

    def config(k: int, schedule: str = "fixed", new: int = args.new_tokens) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=new, num_draft_tokens=k, draft_schedule=schedule, ignore_eos=True,
            proposer="model",
        )  # fmt: skip

    for k in (0, 4):  # warm-up
        generator.generate(prompts[:1], config(k, new=8))
    baseline = [r.token_ids for r in generator.generate(prompts, config(0))]
    same = [r.token_ids for r in generator.generate(prompts, config(4))] == baseline
    entry["greedy_equals_target_only"] = same
    log(f"{name}: speculative greedy == target-only: {same}")

    target_step = step_seconds(pair.target, context=256)
    entry["target_step_ms"] = target_step * 1e3
    entry["cost_ratio"] = step_seconds(pair.draft, context=256) / target_step
    entry["verify_cost_ratio"] = {
        str(k): step_seconds(pair.target, context=256, tokens=k + 1) / target_step
        for k in range(1, args.max_k + 1)
    }
    contenders = [("target only", config(0))]
    contenders += [(f"K={k}", config(k)) for k in range(1, args.max_k + 1)]
    contenders += [(f"adaptive K<={args.max_k}", config(args.max_k, "adaptive"))]
    results: dict[str, dict] = {}
    for label, cfg in contenders:
        if results and not clock.within(CONTENDER_SHARE):  # the target alone always: the base
            results[label] = {"skipped": "out of time"}
            continue
        rates, outside, rounds, accepted, drafted = [], 0.0, 0, 0, 0
        bytes_before = pair.target.bytes_to_host + pair.draft.bytes_to_host
        wall_total = 0.0
        for prompt in prompts:
            generator.forget_kept_rows()  # each mode reads its prompts itself
            model_before, t0 = generator.model_time_s, time.perf_counter()
            [result] = generator.generate([prompt], cfg)
            wall = time.perf_counter() - t0
            wall_total += wall
            outside += wall - (generator.model_time_s - model_before)
            rates.append(len(result.token_ids) / wall)
            rounds += result.stats.rounds
            accepted += result.stats.accepted_tokens
            drafted += result.stats.drafted_tokens
        copied = pair.target.bytes_to_host + pair.draft.bytes_to_host - bytes_before
        results[label] = {
            "tokens_per_second": statistics.median(rates),
            "outside_onnxruntime": outside / wall_total,
            "bytes_to_host_per_round": copied / max(rounds, 1),
            "acceptance_rate": accepted / drafted if drafted else None,
            "tokens_per_round": (accepted + rounds) / max(rounds, 1),
        }
    base = results["target only"]["tokens_per_second"]
    for result in results.values():
        if "tokens_per_second" in result:
            result["speedup"] = result["tokens_per_second"] / base
    entry["results"] = results
    entry["predicted_at_alpha_0.7"] = {
        str(k): predicted_speedup(0.7, k, entry["cost_ratio"]) for k in range(1, args.max_k + 1)
    }


def host_transfer(bundle: Path, name: str, args) -> dict:
    """One row, the target alone, greedy, with each way host inputs reach the device
    (`specrt.backends.host_inputs.TRANSFER`: "rebind", bound again after each write; "update",
    device twins bound once and refreshed in place): median tokens/s of each, and whether both
    chose the same tokens."""
    before, out, tokens = host_inputs.TRANSFER, {}, {}
    config = GenerationConfig(max_new_tokens=args.new_tokens, num_draft_tokens=0, ignore_eos=True)
    try:
        for mode in ("rebind", "update"):
            host_inputs.TRANSFER = mode  # read when the decoders are opened
            generator = SpeculativeGenerator.from_pair(generator_for(bundle, args.dry_run))
            prompts = prompts_for(name, generator, args.prompts)
            generator.generate(prompts[:1], config)  # warm-up
            rates, tokens[mode] = [], []
            for prompt in prompts:
                generator.forget_kept_rows()  # each mode reads its prompts itself
                t0 = time.perf_counter()
                [result] = generator.generate([prompt], config)
                rates.append(len(result.token_ids) / (time.perf_counter() - t0))
                tokens[mode].append(result.token_ids)
            out[mode] = statistics.median(rates)
    finally:
        host_inputs.TRANSFER = before
    out["same_tokens"] = tokens["rebind"] == tokens["update"]
    log(f"{name}: host inputs: {out}")
    return out


def cuda_graph_probe(bundle: Path, steps: int = 64, role: str = "draft") -> dict:
    """``role``'s one-token step with onnxruntime's CUDA graphs off and on: everything bound
    once on the device (a captured graph replays the same addresses), the lengths advanced
    between replays. Reports the median step time of each and whether they chose the same
    tokens (a replay that ignored the new lengths would not)."""
    out = {}
    for label, enabled in (("off", False), ("on", True)):
        try:
            out[label] = _one_token_steps(bundle, enabled, steps, role)
        except Exception as exc:  # noqa: BLE001 - the probe reports whatever happens
            out[label] = {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if "tokens" in out.get("off", {}) and "tokens" in out.get("on", {}):
        out["same_tokens"] = out["off"].pop("tokens") == out["on"].pop("tokens")
    return out


def _one_token_steps(bundle: Path, cuda_graph: bool, steps: int, role: str) -> dict:
    """The batched cuda engine of ``role``, one row, one token a step, everything on the
    device."""
    import onnxruntime as ort

    from specrt.bundle import read_manifest

    spec = read_manifest(bundle).models[role].engine_view("cuda")
    io = spec.io
    provider = ("CUDAExecutionProvider", {"enable_cuda_graph": "1" if cuda_graph else "0"})
    session = ort.InferenceSession(str(bundle / spec.path), providers=[provider])
    binding = session.io_binding()
    capacity = min(spec.max_positions, 1024)
    shape = (1, capacity, spec.num_kv_heads * spec.head_dim)
    for past, present in zip(
        [*io.past_keys, *io.past_values], [*io.present_keys, *io.present_values]
    ):
        value = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float16), "cuda", 0)
        binding.bind_ortvalue_input(past, value)
        binding.bind_ortvalue_output(present, value)

    def on_device(array: np.ndarray) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0)

    mask = np.zeros((1, 1, 1, capacity), dtype=bool)
    inputs = {
        io.input_ids: on_device(np.array([[5]], np.int64)),
        io.position_ids: on_device(np.array([[0]], np.int64)),
        io.cache_indices: on_device(np.zeros((1, 1, 2), np.int64)),
        io.attention_mask: on_device(mask),
    }
    # The last row's logits: engines now take the slice's start (-1), earlier ones the count
    if getattr(io, "logits_start", None):
        inputs[io.logits_start] = on_device(np.array([-1], np.int64))
    else:
        inputs[io.logits_to_keep] = on_device(np.array([1], np.int64))
    for name, value in inputs.items():
        binding.bind_ortvalue_input(name, value)
    best = ort.OrtValue.ortvalue_from_shape_and_type((1, 1), np.int64, "cuda", 0)
    binding.bind_ortvalue_output(io.argmax, best)
    kept = {io.logits: (1, 1, spec.vocab_size), io.probabilities: (1, 1, spec.vocab_size)}
    kept.update({io.max_logit: (1, 1), io.max_probability: (1, 1)})
    for name, dims in kept.items():  # fixed addresses for every output too
        value = ort.OrtValue.ortvalue_from_shape_and_type(dims, np.float32, "cuda", 0)
        binding.bind_ortvalue_output(name, value)
    tokens, times, token = [], [], 5
    for step in range(steps):
        mask[..., step] = True
        inputs[io.input_ids].update_inplace(np.array([[token]], np.int64))
        inputs[io.position_ids].update_inplace(np.array([[step]], np.int64))
        inputs[io.cache_indices].update_inplace(np.array([[[0, step]]], np.int64))
        inputs[io.attention_mask].update_inplace(mask)
        started = time.perf_counter()
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append(time.perf_counter() - started)
        token = int(best.numpy()[0, 0])
        tokens.append(token)
    return {"step_ms": statistics.median(times[2:]) * 1e3, "tokens": tokens}


def transformers_assisted(target: Path, draft: Path, entry: dict, args) -> dict:
    """transformers' assisted generation on the same GPU, float16, on the pair's prompts."""
    prompts = entry["prompt_ids"]
    import torch
    from transformers import AutoModelForCausalLM

    load = dict(dtype=torch.float16, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(target, **load).cuda().eval()
    assistant = AutoModelForCausalLM.from_pretrained(draft, **load).cuda().eval()
    out = {}
    for label, helper in (("transformers target only", None), ("transformers assisted", assistant)):
        rates = []
        for prompt in prompts[:4]:
            ids = torch.tensor([prompt], device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                generated = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    assistant_model=helper,
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
            torch.cuda.synchronize()
            rates.append((generated.shape[1] - len(prompt)) / (time.perf_counter() - t0))
        out[label] = statistics.median(rates)
    return out


def table(report: dict) -> str:
    lines = [f"machine: {report['machine']}  dry run: {report['dry_run']}"]
    lines.append(f"built in {report.get('build_s')} s, all in {report.get('elapsed_s')} s")
    for name, entry in report["pairs"].items():
        failed = {key: value for key, value in entry.items() if key.endswith("_failed")}
        if failed:
            lines.append(f"{name}: {failed}")
        if "results" not in entry or "verify_cost_ratio" not in entry:
            lines.append(f"{name}: {entry}")
            continue
        lines.append(
            f"\n{name} on {entry['device']}: greedy == target-only "
            f"{entry['greedy_equals_target_only']}, c = {entry['cost_ratio']:.3f}, target step "
            f"{entry['target_step_ms']:.2f} ms; measured {entry.get('measure_s')} s of "
            f"{entry['budget_s']:.0f}"
        )
        lines.append(
            f"{'contender':<22}{'tokens/s':>10}{'x target':>10}{'outside ort':>13}"
            f"{'B to host/round':>17}"
        )
        for label, result in entry["results"].items():
            if "tokens_per_second" not in result:
                lines.append(f"{label:<22}{'skipped':>10}")
                continue
            lines.append(
                f"{label:<22}{result['tokens_per_second']:>10.1f}{result['speedup']:>9.2f}x"
                f"{result['outside_onnxruntime']:>12.1%}{result['bytes_to_host_per_round']:>17.0f}"
            )
        for label, rate in (entry.get("group_query_one_row") or {}).items():
            if label == "skipped":
                continue
            base = entry["results"]["target only"]["tokens_per_second"]
            lines.append(f"{'GQA graph ' + label:<22}{rate:>10.1f}{rate / base:>9.2f}x")
        for label, result in (entry.get("eagle_head") or {}).items():
            if label == "skipped" or label == "target only":
                continue
            kept = result["acceptance_rate"]  # None: it drafted nothing
            lines.append(
                f"{'EAGLE ' + label:<22}{result['tokens_per_second']:>10.1f}"
                f"{result['speedup']:>9.2f}x  kept {'-' if kept is None else f'{kept:.2f}'}, "
                f"== target {result['equals_target_only']}"
            )
        for label, rate in (entry.get("transformers") or {}).items():
            if label == "skipped":
                continue
            base = entry["results"]["target only"]["tokens_per_second"]
            lines.append(f"{label:<22}{rate:>10.1f}{rate / base:>9.2f}x")
        lines.append(f"host inputs, target alone: {host_line(entry.get('host_inputs'))}")
        for role in ("draft", "target"):
            probe = entry.get(f"cuda_graph_{role}_step") or {}
            steps = {k: v.get("step_ms") for k, v in probe.items() if isinstance(v, dict)}
            if steps:
                lines.append(f"CUDA graphs, {role} step ms: {steps}, same tokens "
                             f"{probe.get('same_tokens')}")  # fmt: skip
        verify = ", ".join(f"K={k} {v:.2f}" for k, v in entry["verify_cost_ratio"].items())
        lines.append(f"v_K: {verify}")
        lines.append(
            f"{'batch size':<12}{'target only':>13}{'speculative':>13}{'ratio':>8}{'rows =':>9}"
        )
        for batch, result in (entry.get("batches") or {}).items():
            if "speedup" not in result:
                lines.append(f"{batch:<12}{'skipped':>13}")
                continue
            alone, spec = result["target only"], result["speculative"]
            lines.append(
                f"{batch:<12}{alone['tokens_per_s']:>13.1f}{spec['tokens_per_s']:>13.1f}"
                f"{result['speedup']:>7.2f}x{spec['rows_equal_one_row_target_only']:>5}/{spec['rows']}"
            )
    return "\n".join(lines)


def host_line(result: dict | None) -> str:
    if not result or "skipped" in result:
        return (result or {}).get("skipped", "not run")
    return (
        f"rebind {result['rebind']:.1f} tokens/s, update {result['update']:.1f} tokens/s, "
        f"same tokens {result['same_tokens']}"
    )


def write(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
