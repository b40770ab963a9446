"""What one call of an engine graph costs, several graphs side by side: S positions fed after
``past`` cached ones, one row, the cache bound in place as the runtime binds it.

    .venv/bin/python bench/engine_step.py GRAPH [GRAPH ...] [--positions 1 5] [--cached 100 400]

A GRAPH is a ``model.onnx``: a bundle's engine (``engines/B/target/onnxruntime/model.onnx``,
batched cache: fed positions, cache indices and a mask over the row's view, as wide as
`specrt.backends.batched.VIEW_STEP` rounds it), an in-place GroupQueryAttention engine (fed the
lengths), or onnxruntime-genai's decoder (``build/genai-smollm2/int4/model.onnx``: fed an
attention mask of ones; `bench/genai_env.sh smollm2` builds it). The graphs take turns, blocks of
``--calls`` calls each, ``--blocks`` times, so the host's drift falls on all of them alike; each
graph's time is the median of its blocks, printed with its ratio to the first graph's. The
tokens and the cache's contents are arbitrary: a call's cost does not depend on them. A
quantised target's graph computes the copy that makes an odd count even (``pair_rows``), as
loading chooses on AVX2 for int4, unless its index is in ``--unpaired``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specrt.backends.batched import VIEW_STEP

TOKEN = 1  # inside every vocabulary


def session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def feeds(
    names: list[str], count: int, past: int, pair_rows: int = 1
) -> tuple[dict[str, np.ndarray], int]:
    """The host inputs of a call of ``count`` positions after ``past``, and the cache length
    the call reads (the batched graph's view; in-place graphs take their whole buffer).
    ``pair_rows``: what a quantised target's graph is told (1: compute the copy that makes an
    odd count even, as loading chooses where a row alone gets other bits)."""
    ids = np.full((1, count), TOKEN, dtype=np.int64)
    positions = np.arange(past, past + count)
    if "position_ids" in names:  # a batched-cache engine: its row's view, in steps
        width = -(-(past + count) // VIEW_STEP) * VIEW_STEP
        mask = np.arange(width)[None, :] <= positions[:, None]
        return {
            "input_ids": ids,
            "position_ids": positions[None],
            "cache_indices": np.stack([np.zeros(count, np.int64), positions], -1)[None],
            "attention_mask": mask[None, None],
            "logits_start": np.array([-count], dtype=np.int64),
            **({"pair_rows": np.full(1, pair_rows, np.int64)} if "pair_rows" in names else {}),
        }, width
    if "seqlens_k" in names:  # an in-place GroupQueryAttention engine
        return {
            "input_ids": ids,
            "seqlens_k": np.array([past + count - 1], dtype=np.int32),
            "total_sequence_length": np.array(past + count, dtype=np.int32),
            "logits_start": np.array([-count], dtype=np.int64),
        }, 0
    return {"input_ids": ids, "attention_mask": np.ones((1, past + count), np.int64)}, 0


def binding(
    graph: ort.InferenceSession, count: int, past: int, capacity: int, head_dim: int, pair_rows: int
):
    """The graph's IO binding for such a call: each past buffer bound as its present too
    (``head_dim``: where the graph leaves it unnamed, as onnxruntime-genai's does)."""
    names = [node.name for node in graph.get_inputs()]
    host, width = feeds(names, count, past, pair_rows)
    bound = graph.io_binding()
    for name, value in host.items():
        bound.bind_cpu_input(name, value)
    buffers = []
    for node in graph.get_inputs():
        if not node.name.startswith("past_key_values"):
            continue
        shape = list(node.shape)
        if len(shape) == 3:  # batched: [rows, positions, kv heads x head dim]
            shape = [1, width, shape[2]]
        else:  # [rows, kv heads, positions, head dim]
            shape = [1, shape[1], capacity, shape[3] if isinstance(shape[3], int) else head_dim]
        buffer = ort.OrtValue.ortvalue_from_numpy(np.random.rand(*shape).astype(np.float32))
        buffers.append(buffer)
        bound.bind_ortvalue_input(node.name, buffer)
        bound.bind_ortvalue_output(node.name.replace("past_key_values", "present"), buffer)
    for node in graph.get_outputs():
        if not node.name.startswith("present"):
            bound.bind_output(node.name)
    return bound, buffers


def genai_head_size(path: Path) -> int:
    """onnxruntime-genai's head size, from the config beside its graph (0: none there)."""
    config = path.with_name("genai_config.json")
    if not config.is_file():
        return 0
    return int(json.loads(config.read_text())["model"]["decoder"]["head_size"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graphs", nargs="+", type=Path)
    parser.add_argument("--positions", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--cached", type=int, nargs="+", default=[100, 400])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--capacity", type=int, default=1024, help="in-place graphs' buffer")
    parser.add_argument(
        "--unpaired",
        type=int,
        nargs="*",
        default=[],
        help="indices of quantised targets' graphs run without the copy of an odd count's last"
        " position (`pair_rows` 0: where loading finds a row alone exact)",
    )
    args = parser.parse_args()
    for path in args.graphs:
        if not path.is_file():
            raise SystemExit(f"no graph at {path}")
    graphs = [session(path, args.threads) for path in args.graphs]
    head_dims = [genai_head_size(path) for path in args.graphs]
    print("graphs: " + ", ".join(f"[{i}] {path}" for i, path in enumerate(args.graphs)))
    for past in args.cached:
        for count in args.positions:
            bound = [
                binding(g, count, past, args.capacity, d, int(i not in args.unpaired))
                for i, (g, d) in enumerate(zip(graphs, head_dims))
            ]
            times: list[list[float]] = [[] for _ in graphs]
            for _ in range(args.blocks):
                for graph, (call, _), spent in zip(graphs, bound, times):
                    for _ in range(3):  # its caches warm again after the other graphs ran
                        graph.run_with_iobinding(call)
                    started = time.perf_counter()
                    for _ in range(args.calls):
                        graph.run_with_iobinding(call)
                    spent.append((time.perf_counter() - started) / args.calls)
            medians = [statistics.median(spent) for spent in times]
            cells = [
                f"[{i}] {1000 * m:.2f} ms ({m / medians[0]:.3f})" for i, m in enumerate(medians)
            ]
            print(f"{count} positions after {past}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
