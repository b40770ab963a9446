"""Where a verification pass's time goes on the CUDA provider, and what each attention form costs.

    SPECRT_GPU_SCRIPT=bench/gpu_attention.py bash bench/gpu_check.sh --out DIR   # a GPU
    .venv/bin/python bench/gpu_attention.py --dry-run --out DIR   # anywhere: tiny shapes, the CPU

The first device check (docs/gpu.md) found a pass over 2 new positions costing 5.8 times a pass
over 1 on a Llama-3.2-1B-shaped target's batched cuda engine (1.4 times on the demo target), flat
from 2 to 9 positions. This probe answers why, in one short run:

1. ``steps``: the engine (a 1B-shaped target of ``--layers`` layers, float16, through the export
   path) timed per call at 1, 2, 3, 5 and 9 new positions on a warm cache of 256, as
   `specrt.bench.costs.step_seconds` times it; again with onnxruntime's memory-efficient and
   flash attention kernels turned off by their environment switches (each in its own process:
   onnxruntime reads them once); and the engine whose greedy outputs reduce the vocabulary in
   two stages (`ExportOptions.cuda_reductions` "chunked", the default), and that one attending
   by each row's length (`cuda_attention` "batched_lengths").
2. ``kernels``: the GPU kernels of 20 such calls at 1 and at 2 new positions, by GPU time, on
   each engine of part 1
   (torch's profiler, which records every CUDA kernel of the process through CUPTI).
3. ``ops``: each attention form alone at the 1B shape (32 query heads, 8 kv heads, head 64, a
   cache of 512 positions, 256 of them filled), 1 and 8 rows, 1, 2 and 5 new positions: the
   Attention op under a boolean mask (the engine's form), under an additive float16 mask, with
   opset 24's ``nonpad_kv_seqlen`` and ``is_causal`` (no mask), contrib GroupQueryAttention;
   and the cache writes, ScatterND (the engine's) and opset 24's TensorScatter. Each form's
   output is compared with the boolean-mask form's.
4. ``tail``: the greedy outputs' reductions over a 128256-wide vocabulary alone, by form and
   number of rows: the engine's, each op alone, TopK(1), the two-stage argmax; whether each
   index form gives numpy's argmax on rows holding ties.

Writes DIR/gpu_attention.json after each part; prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STEP_TOKENS = (1, 2, 3, 5, 9)
# The engine variants part 1 times: the greedy outputs in one stage and in two (the default);
# attention by each row's length (flash attention's form) with the two-stage outputs.
VARIANTS = {
    "direct": dict(cuda_reductions="direct"),
    "chunked": dict(cuda_reductions="chunked"),
    "by length": dict(cuda_reductions="chunked", cuda_attention="batched_lengths"),
}
SWITCHES = {
    "default": {},
    "no memory-efficient attention": {"ORT_DISABLE_MEMORY_EFFICIENT_ATTENTION": "1"},
    "no flash attention": {"ORT_DISABLE_FLASH_ATTENTION": "1"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, on the CPU")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "gpu_attention")
    parser.add_argument("--work", type=Path, default=REPO / "build" / "gpu_attention_work")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps-only", type=Path, help=argparse.SUPPRESS)  # a bundle: part 1
    args = parser.parse_args()
    if args.steps_only:
        print(json.dumps(step_costs(args.steps_only, args.dry_run)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"dry_run": args.dry_run}
    started = time.monotonic()
    bundles = build_engines(args.work, args.layers, args.dry_run)  # not under --out: its
    # files come back from a GPU machine, and engines are hundreds of MB
    report["build_s"] = round(time.monotonic() - started, 1)
    report["steps"] = {}
    for label, env in SWITCHES.items():
        report["steps"][f"direct, {label}"] = steps_in_process(bundles["direct"], env, args.dry_run)
        save(report, args.out)
    for name in ("chunked", "by length"):
        report["steps"][f"{name}, default"] = steps_in_process(bundles[name], {}, args.dry_run)
        save(report, args.out)
    report["ops"] = attention_ops(args.dry_run)
    save(report, args.out)
    report["tail"] = tail_ops(args.dry_run)
    save(report, args.out)
    report["kernels"] = {}
    for name in VARIANTS:
        try:
            report["kernels"][name] = kernel_profile(bundles[name], args.dry_run)
        except Exception as exc:  # noqa: BLE001 - the probe reports whatever happens
            report["kernels"][name] = {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
        save(report, args.out)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    save(report, args.out)
    print(summary(report))


def save(report: dict, out: Path) -> None:
    (out / "gpu_attention.json").write_text(json.dumps(report, indent=2, default=str) + "\n")


def build_engines(work: Path, layers: int, dry_run: bool) -> dict[str, Path]:
    """A random 1B-shaped target of ``layers`` layers and its draft (`gpu_check.random_pair`);
    their cuda engines in each of `VARIANTS`."""
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_check import random_pair

    from specrt.export import export_bundle

    target, draft = random_pair(work, dry_run, target_layers=layers)
    bundles = {}
    for name, options in VARIANTS.items():
        bundles[name] = work / f"bundle-{name}"
        export_bundle(target, draft, bundles[name], force=True,
                      portable=False, devices=("cuda",), **options)  # fmt: skip
    return bundles


def open_target(bundle: Path, dry_run: bool):
    from specrt.runtime.loading import load_pair

    if dry_run:  # the CUDA path on the CPU, as bench/gpu_check.py --dry-run runs it
        from pytest import MonkeyPatch

        from tests.cuda_rule import cuda_on_cpu

        cuda_on_cpu(MonkeyPatch()).__enter__()
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return load_pair(bundle, engine="cuda", providers=providers).target


def step_costs(bundle: Path, dry_run: bool) -> dict:
    from specrt.bench.costs import step_seconds

    target = open_target(bundle, dry_run)
    return {str(n): step_seconds(target, context=256, tokens=n, repeats=60) * 1e3
            for n in STEP_TOKENS}  # fmt: skip


def steps_in_process(bundle: Path, env: dict, dry_run: bool) -> dict:
    """Part 1 in a process of its own with ``env`` set: ms per call by new positions."""
    command = [sys.executable, __file__, "--steps-only", str(bundle)]
    command += ["--dry-run"] if dry_run else []
    done = subprocess.run(
        command, env={**os.environ, **env}, capture_output=True, text=True, timeout=240
    )
    if done.returncode:
        return {"failed": done.stderr[-1500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def kernel_profile(bundle: Path, dry_run: bool, calls: int = 20) -> dict:
    """The GPU kernels of ``calls`` calls at 1 and at 2 new positions: per call, by GPU time."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError as exc:
        return {"skipped": str(exc)}
    if dry_run or not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    from specrt.backends.base import NEED_ARGMAX

    target = open_target(bundle, dry_run)
    rng = np.random.default_rng(0)
    history = rng.integers(0, target.vocab_size, 256).tolist()
    out = {}
    for n in (1, 2):
        step = rng.integers(0, target.vocab_size, n).tolist()
        target.reset()
        target.prefill(history)
        for _ in range(3):  # warm: this shape's arrays and kernels
            target.forward(step, need=NEED_ARGMAX)
            target.rollback(256)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                target.forward(step, need=NEED_ARGMAX)
                target.rollback(256)
            torch.cuda.synchronize()
        rows = []
        for event in prof.key_averages():
            device_us = getattr(event, "device_time_total", None)
            if device_us is None:
                device_us = getattr(event, "cuda_time_total", 0)
            if device_us:
                rows.append((device_us / calls, event.count / calls, event.key[:120]))
        rows.sort(reverse=True)
        out[str(n)] = {
            "gpu_us_per_call": round(sum(r[0] for r in rows), 1),
            "top": [
                {"us": round(us, 1), "per_call": per, "kernel": key} for us, per, key in rows[:14]
            ],  # fmt: skip
        }
    return out


# ---------------------------------------------------------------------------------------------
# Part 3: each attention form alone


def attention_ops(dry_run: bool) -> dict:
    import onnxruntime as ort

    heads, kv_heads, head = (4, 2, 32) if dry_run else (32, 8, 64)
    capacity, context = 512, 256
    providers = ["CPUExecutionProvider"] if dry_run else ["CUDAExecutionProvider"]
    device = "cpu" if dry_run else "cuda"
    out: dict = {}
    for rows in (1, 8):
        for n in (1, 2, 5):
            shape = dict(rows=rows, n=n, heads=heads, kv_heads=kv_heads, head=head,
                         capacity=capacity, context=context)  # fmt: skip
            feeds = _feeds(**shape)
            results, reference = {}, None
            for label, graph in _forms(**shape).items():
                try:
                    session = ort.InferenceSession(graph, providers=providers)
                    ms, value = _time(session, feeds, device)
                    entry = {"ms": round(ms, 4)}
                    if reference is None and label == "mask23":
                        reference = value
                    if reference is not None and value.shape == reference.shape:
                        diff = np.abs(value.astype(np.float32) - reference.astype(np.float32))
                        entry["max_diff_vs_mask23"] = float(diff.max())
                    results[label] = entry
                except Exception as exc:  # noqa: BLE001 - the probe reports whatever happens
                    results[label] = {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
            out[f"rows={rows} n={n}"] = results
    return out


def _feeds(rows, n, heads, kv_heads, head, capacity, context) -> dict:
    rng = np.random.default_rng(0)

    def f16(*shape):
        return (rng.standard_normal(shape) * 0.5).astype(np.float16)

    cache_k, cache_v = f16(rows, capacity, kv_heads * head), f16(rows, capacity, kv_heads * head)
    k_new, v_new = f16(rows, n, kv_heads * head), f16(rows, n, kv_heads * head)
    total = context + n  # the new k and v already written, as the engine attends after writing
    cache_k[:, context:total], cache_v[:, context:total] = k_new, v_new
    mask = np.zeros((rows, 1, n, capacity), dtype=bool)
    for i in range(n):
        mask[:, :, i, : context + i + 1] = True
    indices = np.zeros((rows, n, 2), dtype=np.int64)
    indices[..., 0] = np.arange(rows)[:, None]
    indices[..., 1] = context + np.arange(n)
    bnsh = (rows, kv_heads, capacity, head)
    return {
        "q": f16(rows, n, heads * head),
        "k_new": k_new,
        "v_new": v_new,
        "cache_k": cache_k,
        "cache_v": cache_v,
        "mask": mask,
        "bias": np.where(mask, 0.0, -10000.0).astype(np.float16),
        "nonpad": np.full((rows,), total, dtype=np.int64),
        "indices": indices,
        "write_at": np.full((rows,), context, dtype=np.int64),
        "past_k": np.ascontiguousarray(
            cache_k.reshape(rows, capacity, kv_heads, head).transpose(0, 2, 1, 3)
        ).reshape(bnsh),  # noqa: E501
        "past_v": np.ascontiguousarray(
            cache_v.reshape(rows, capacity, kv_heads, head).transpose(0, 2, 1, 3)
        ).reshape(bnsh),  # noqa: E501
        "seqlens_k": np.full((rows,), total - 1, dtype=np.int32),
        "total_length": np.array(capacity, dtype=np.int32),
    }


def _forms(rows, n, heads, kv_heads, head, capacity, context) -> dict:
    """Each form as model bytes; every one reads some of `_feeds`' names and writes "y"."""
    from onnx import TensorProto, helper

    f16, i64 = TensorProto.FLOAT16, TensorProto.INT64
    types = {
        "q": (f16, [rows, n, heads * head]),
        "k_new": (f16, [rows, n, kv_heads * head]),
        "v_new": (f16, [rows, n, kv_heads * head]),
        "cache_k": (f16, [rows, capacity, kv_heads * head]),
        "cache_v": (f16, [rows, capacity, kv_heads * head]),
        "mask": (TensorProto.BOOL, [rows, 1, n, capacity]),
        "bias": (f16, [rows, 1, n, capacity]),
        "nonpad": (i64, [rows]),
        "indices": (i64, [rows, n, 2]),
        "write_at": (i64, [rows]),
        "past_k": (f16, [rows, kv_heads, capacity, head]),
        "past_v": (f16, [rows, kv_heads, capacity, head]),
        "seqlens_k": (TensorProto.INT32, [rows]),
        "total_length": (TensorProto.INT32, []),
    }
    scale = 1.0 / head**0.5
    attention = dict(q_num_heads=heads, kv_num_heads=kv_heads, scale=scale)

    def model(nodes, inputs, opset, y_shape, domain_ms=False):
        graph = helper.make_graph(
            nodes, "form", [helper.make_tensor_value_info(i, *types[i]) for i in inputs],
            [helper.make_tensor_value_info("y", f16, y_shape)],
        )  # fmt: skip
        opsets = [helper.make_opsetid("", opset)]
        if domain_ms:
            opsets.append(helper.make_opsetid("com.microsoft", 1))
        built = helper.make_model(graph, opset_imports=opsets)
        built.ir_version = 10
        return built.SerializeToString()

    y = [rows, n, heads * head]
    forms = {
        "mask23": model(
            [helper.make_node("Attention", ["q", "cache_k", "cache_v", "mask"], ["y"],
                              **attention)], ["q", "cache_k", "cache_v", "mask"], 23, y),
        "bias23": model(
            [helper.make_node("Attention", ["q", "cache_k", "cache_v", "bias"], ["y"],
                              **attention)], ["q", "cache_k", "cache_v", "bias"], 23, y),
        "nonpad24": model(
            [helper.make_node("Attention", ["q", "cache_k", "cache_v", "", "", "", "nonpad"],
                              ["y"], is_causal=1, **attention)],
            ["q", "cache_k", "cache_v", "nonpad"], 24, y),
        "group_query": model(
            [helper.make_node(
                "GroupQueryAttention",
                ["q", "k_new", "v_new", "past_k", "past_v", "seqlens_k", "total_length"],
                ["y", "present_k", "present_v"], domain="com.microsoft", num_heads=heads,
                kv_num_heads=kv_heads, scale=scale)],
            ["q", "k_new", "v_new", "past_k", "past_v", "seqlens_k", "total_length"], 21, y,
            domain_ms=True),
        "scatter_nd_write": model(
            [helper.make_node("ScatterND", ["cache_k", "indices", "k_new"], ["y"])],
            ["cache_k", "indices", "k_new"], 21, [rows, capacity, kv_heads * head]),
        "tensor_scatter_write": model(
            [helper.make_node("TensorScatter", ["cache_k", "k_new", "write_at"], ["y"],
                              axis=1)],
            ["cache_k", "k_new", "write_at"], 24, [rows, capacity, kv_heads * head]),
    }  # fmt: skip
    return forms


def tail_ops(dry_run: bool) -> dict:
    """The greedy outputs' reductions over the vocabulary alone (``[rows, 1, V]`` float32 logits,
    V = 128256), by form: ms per run, and whether the index forms give numpy's argmax (the
    first of equal maxima: each row holds a planted tie)."""
    import onnxruntime as ort

    vocab = 4096 if dry_run else 128256
    providers = ["CPUExecutionProvider"] if dry_run else ["CUDAExecutionProvider"]
    device = "cpu" if dry_run else "cuda"
    out: dict = {}
    for rows, positions in ((1, 1), (2, 1), (1, 2), (9, 1), (1, 9), (64, 1)):
        rng = np.random.default_rng(0)
        logits = rng.standard_normal((rows, positions, vocab)).astype(np.float32)
        top = logits.max(axis=-1, keepdims=True) + 1.0
        logits[..., 100], logits[..., vocab - 7] = top[..., 0], top[..., 0]  # a tie: 100 wins
        expected = logits.argmax(axis=-1)
        results = {}
        for label, graph in _tail_forms(rows, positions, vocab).items():
            try:
                session = ort.InferenceSession(graph, providers=providers)
                ms, value = _time(session, {"logits": logits}, device)
                entry: dict = {"ms": round(ms, 4)}
                if value.dtype == np.int64:
                    entry["equals_numpy_argmax"] = bool(
                        np.array_equal(value.reshape(expected.shape), expected)
                    )
                results[label] = entry
            except Exception as exc:  # noqa: BLE001 - the probe reports whatever happens
                results[label] = {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
        out[f"rows={rows} positions={positions}"] = results
    return out


def _tail_forms(rows: int, positions: int, vocab: int, chunk: int = 256) -> dict:
    """The engine's tail (Softmax, ArgMax, ReduceMax of logits and of probabilities) and each
    reduction alone; TopK(1); and a two-stage argmax (the first maximum of each chunk of
    ``chunk`` columns, then the first chunk holding the row's maximum)."""
    from onnx import TensorProto, helper, numpy_helper

    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    x = helper.make_tensor_value_info("logits", f32, [rows, positions, vocab])
    lead = [rows, positions]

    def model(nodes, y_type, y_shape, initializers=()):
        graph = helper.make_graph(
            nodes, "tail", [x], [helper.make_tensor_value_info("y", y_type, y_shape)],
            initializer=list(initializers),
        )  # fmt: skip
        built = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
        built.ir_version = 10
        return built.SerializeToString()

    def const(name, values):
        return numpy_helper.from_array(np.array(values, dtype=np.int64), name)

    padded = -(-vocab // chunk) * chunk
    two_stage = [
        helper.make_node("Pad", ["logits", "pads", "lowest"], ["padded"]),
        helper.make_node("Reshape", ["padded", "chunked_shape"], ["chunked"]),
        helper.make_node("ArgMax", ["chunked"], ["local"], axis=-1, keepdims=1),
        helper.make_node("ReduceMax", ["chunked", "last"], ["chunk_max"], keepdims=0),
        helper.make_node("ArgMax", ["chunk_max"], ["best_chunk"], axis=-1, keepdims=1),
        helper.make_node("Squeeze", ["local", "last"], ["local_flat"]),
        helper.make_node("GatherElements", ["local_flat", "best_chunk"], ["in_chunk"], axis=-1),
        helper.make_node("Mul", ["best_chunk", "chunk"], ["chunk_start"]),
        helper.make_node("Add", ["chunk_start", "in_chunk"], ["index"]),
        helper.make_node("Squeeze", ["index", "last"], ["y"]),
    ]
    two_stage_init = [
        const("pads", [0, 0, 0, 0, 0, padded - vocab]),
        numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "lowest"),
        const("chunked_shape", [rows, positions, padded // chunk, chunk]),
        const("last", [-1]),
        const("chunk", [chunk]),
    ]
    engine_tail = [
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1),
        helper.make_node("ArgMax", ["logits"], ["y"], axis=-1, keepdims=0),
        helper.make_node("ReduceMax", ["logits", "last"], ["max_logit"], keepdims=0),
        helper.make_node("ReduceMax", ["probabilities", "last"], ["max_probability"], keepdims=0),
    ]
    topk = [
        helper.make_node("TopK", ["logits", "one"], ["values", "indices"], axis=-1),
        helper.make_node("Squeeze", ["indices", "last"], ["y"]),
    ]
    return {
        "engine_tail": model(engine_tail, i64, lead, [const("last", [-1])]),
        "argmax": model([helper.make_node("ArgMax", ["logits"], ["y"], axis=-1, keepdims=0)],
                        i64, lead),
        "reduce_max": model([helper.make_node("ReduceMax", ["logits", "last"], ["y"],
                                              keepdims=0)], f32, lead, [const("last", [-1])]),
        "softmax": model([helper.make_node("Softmax", ["logits"], ["y"], axis=-1)], f32,
                         [*lead, vocab]),
        "topk1": model(topk, i64, lead, [const("one", [1]), const("last", [-1])]),
        "argmax_two_stage": model(two_stage, i64, lead, two_stage_init),
    }  # fmt: skip


def _time(session, feeds: dict, device: str, runs: int = 50) -> tuple[float, np.ndarray]:
    """Median ms of a run with every input on ``device`` (bound once) and "y" there too; the
    cache writes write in place, as the engine's do."""
    import onnxruntime as ort

    binding = session.io_binding()
    values = {}
    for meta in session.get_inputs():
        array = feeds[meta.name]
        host_only = meta.name == "total_length"  # read on the host by the kernel
        value = ort.OrtValue.ortvalue_from_numpy(array, "cpu" if host_only else device, 0)
        values[meta.name] = value
        binding.bind_ortvalue_input(meta.name, value)
    if session.get_inputs()[0].name == "cache_k":  # a cache write: in place
        binding.bind_ortvalue_output("y", values["cache_k"])
    else:
        binding.bind_output("y", device)
    for name in ("present_k", "present_v"):
        if name in [o.name for o in session.get_outputs()]:
            binding.bind_ortvalue_output(name, values["past_" + name[-1]])
    times = []
    for _ in range(runs + 5):
        t0 = time.perf_counter()
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append(time.perf_counter() - t0)
    result = binding.get_outputs()[0].numpy()
    return statistics.median(times[5:]) * 1e3, result


def summary(report: dict) -> str:
    lines = [f"built in {report['build_s']} s, all in {report.get('elapsed_s')} s"]
    for label, steps in report["steps"].items():
        if "failed" in steps:
            lines.append(f"steps, {label}: failed: {steps['failed'][-300:]}")
            continue
        one = steps["1"]
        costs = ", ".join(f"{n}: {ms:.2f} ms ({ms / one:.2f}x)" for n, ms in steps.items())
        lines.append(f"steps, {label}: {costs}")
    for name, profile in (report.get("kernels") or {}).items():
        for n, entry in profile.items():
            if not isinstance(entry, dict) or "top" not in entry:
                lines.append(f"kernels, {name}: {n}: {entry}")
                continue
            lines.append(f"kernels, {name}, {n} new: {entry['gpu_us_per_call']} us GPU a call")
            for row in entry["top"][:10]:
                lines.append(f"  {row['us']:9.1f} us  x{row['per_call']:<5} {row['kernel']}")
    for case, forms in [*report["ops"].items(), *report.get("tail", {}).items()]:
        cells = []
        for label, entry in forms.items():
            if "ms" in entry:
                diff = entry.get("max_diff_vs_mask23")
                cells.append(f"{label} {entry['ms']:.3f}" + (f" (d {diff:.1e})" if diff else ""))
                if entry.get("equals_numpy_argmax") is False:
                    cells[-1] += " (NOT numpy's argmax)"
            else:
                cells.append(f"{label} FAILED {entry['failed'][:120]}")
        lines.append(f"ops {case}: " + "; ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
