"""The onnxruntime engine of one model, built from the loaded PyTorch model and checked against it
like the portable graph (see `specrt.export.ort_graph` for what the graph is)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specrt.bundle import CUDA_ENGINE, ONNXRUNTIME_ENGINE, EngineSpec, ModelIO, ModelSpec
from specrt.checksums import sha256_file
from specrt.export.numeric_check import max_logit_difference
from specrt.export.options import DEFAULT_TARGET_BLOCK_SIZE
from specrt.export.ort_builder import (
    ARGMAX,
    ATTENTION_MASK,
    CACHE_INDICES,
    FEATURES,
    KV_LENGTHS,
    LOCAL_ATTENTION_MASK,
    LOGITS_START,
    MAX_LOGIT,
    MAX_PROBABILITY,
    POSITION_IDS,
    PROBABILITIES,
    SEQLENS_K,
    TOTAL_LENGTH,
    UNPROPOSED,
    DecoderShape,
)
from specrt.export.ort_graph import (
    ACTIVATIONS,
    EagleFeatures,
    activation,
    build_decoder_graph,
    build_gpt2_graph,
    rope_positions,
    sliding_window,
)
from specrt.export.quantize import BLOCK_SIZE, quantize_weights


def build_ort_engine(
    model: torch.nn.Module,
    spec: ModelSpec,
    bundle_root: Path,
    role: str,
    vocab: int,
    precision: str = "float32",
    device: str = "cpu",
    cuda_attention: str = "batched",
    cuda_reductions: str = "chunked",
    features: EagleFeatures | None = None,
    block_size: int = DEFAULT_TARGET_BLOCK_SIZE,
    proposed: np.ndarray | None = None,
) -> EngineSpec:
    """Write ``ROLE/onnxruntime/model.onnx`` (``device`` "cpu") or ``ROLE/cuda/model.onnx``
    (``device`` "cuda": float16, with the argmax outputs a device backend copies back) into the
    bundle and return its entry with the check against PyTorch, run on this machine's CPU.

    ``precision`` int8/int4 quantises a CPU engine's weights (see `specrt.export.quantize`);
    the check then reports the difference without a bound.
    ``cuda_attention``, ``cuda_reductions``: see `ExportOptions`. ``features``: what an EAGLE
    head reads of the target (the CPU engine's output `FEATURES`). ``block_size``: a quantised
    target's (`specrt.export.quantize.TARGET_BLOCK_SIZES`). ``proposed``: a draft's
    reduced vocabulary (`specrt.export.draft_vocab`)."""
    config = model.config
    weights = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}
    key = CUDA_ENGINE if device == "cuda" else ONNXRUNTIME_ENGINE
    gemma = config.model_type in GEMMA_TYPES
    dtype = "float16" if device == "cuda" else "float32"
    out = bundle_root / role / key / "model.onnx"
    window, local_layers = sliding_window(config, spec.max_positions)
    positions = rope_positions(config, spec.max_positions)  # where its rotary table is exact
    scalar = getattr(config, "query_pre_attn_scalar", None) if gemma else None
    softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
    one_row = device == "cuda" and (softcap or cuda_attention == "group_query")
    # by each row's length: no window to mask (the host's mask carries sliding windows)
    by_length = device == "cuda" and cuda_attention == "batched_lengths" and not window
    # a target verifies bit for bit where its attention computes two query rows or more, and a
    # quantised one where its weights' kernels give a row alone the same bits, else where every
    # call computes an even count (`pair_rows`, chosen at load by measuring)
    even_rows = device == "cpu" and role == "target" and precision != "float32"
    two_query_rows = device == "cpu" and role == "target"
    shape = DecoderShape(  # GPT-2's config answers to these names too
        num_layers=spec.num_layers,
        num_heads=int(config.num_attention_heads),
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        norm_eps=float(getattr(config, "rms_norm_eps", None) or config.layer_norm_epsilon),
        vocab_size=vocab,
        dtype=dtype,
        greedy_outputs=device == "cuda",
        greedy_reductions=cuda_reductions,
        # Any rows and tokens per call (the Attention op); attention soft-capping (Gemma 2)
        # keeps GroupQueryAttention on CUDA (one row per call) until a GPU has run the batched
        # graph with it: CUDA's Attention kernels take softcap, but none has checked it yet.
        attention="group_query" if one_row else "batched",
        attend_by_length=by_length and not one_row,
        even_rows=even_rows,
        two_query_rows=two_query_rows,
        qk_norm=config.model_type in ("qwen3", "gemma3_text"),
        embedding_scale=float(config.hidden_size) ** 0.5 if gemma else 1.0,
        activation=ACTIVATIONS.get(activation(config), "silu"),
        attention_scale=float(scalar) ** -0.5 if scalar else None,
        attention_softcap=softcap,
        logit_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
        sandwich_norms=config.model_type in ("gemma2", "gemma3_text"),
        local_layers=local_layers,
        window=window,
        local_rope_layers=_local_rope_layers(model),
        rotary_dim=_partial_rotary_dim(config, spec.head_dim),
    )
    if config.model_type == "phi3":
        weights = unpacked_phi3(weights, shape, int(config.intermediate_size))
    if gemma:  # its RMSNorm scales by (1 + w)
        weights = {n: w + 1 if n.endswith("norm.weight") else w for n, w in weights.items()}
    if config.model_type == "gpt2":
        graph = build_gpt2_graph(shape, weights, out, proposed, features)
    else:
        local = None
        if shape.local_rope_layers:
            local = rope_tables(model.model.rotary_emb_local, positions)
        cos, sin = rope_tables(model.model.rotary_emb, positions)
        graph = build_decoder_graph(
            shape, weights, cos, sin, out, local_rope=local, features=features, proposed=proposed
        )
    if device == "cpu":
        target = role == "target"
        quantize_weights(graph, precision, block_size if target else BLOCK_SIZE, not target)
    layers = range(spec.num_layers)
    batched = shape.attention == "batched"
    engine = EngineSpec(
        path=str(graph.relative_to(bundle_root)),
        files={
            str(f.relative_to(bundle_root)): sha256_file(f) for f in sorted(graph.parent.iterdir())
        },
        io=ModelIO(
            input_ids="input_ids",
            attention_mask=ATTENTION_MASK if batched else None,
            local_attention_mask=LOCAL_ATTENTION_MASK if batched and shape.two_masks else None,
            position_ids=POSITION_IDS if batched else None,
            past_keys=[f"past_key_values.{i}.key" for i in layers],
            past_values=[f"past_key_values.{i}.value" for i in layers],
            logits="logits",
            present_keys=[f"present.{i}.key" for i in layers],
            present_values=[f"present.{i}.value" for i in layers],
            seqlens_k=None if batched else SEQLENS_K,
            total_length=None if batched else TOTAL_LENGTH,
            cache_indices=CACHE_INDICES if batched else None,
            kv_lengths=KV_LENGTHS if shape.attend_by_length else None,
            probabilities=PROBABILITIES,
            logits_start=LOGITS_START,
            argmax=ARGMAX if shape.greedy_outputs else None,
            max_logit=MAX_LOGIT if shape.greedy_outputs else None,
            max_probability=MAX_PROBABILITY if shape.greedy_outputs else None,
            features=FEATURES if features is not None else None,
        ),
        vocab_size=vocab,
        cache="batched" if batched else "in_place",
        # The cuda graph carries its windows itself (GroupQueryAttention's attribute).
        sliding_window=window if batched else None,
        max_positions=positions if positions < spec.max_positions else None,
        precision=dtype if device == "cuda" else precision,
        # a target's, which the user chose (a draft's are always `BLOCK_SIZE`)
        block_size=block_size if shape.even_rows else None,
        even_rows=shape.even_rows,
        provider="CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider",
        dtype=dtype,
    )
    spec.engines[key] = engine
    check = max_logit_difference(model, graph, spec.engine_view(key), vocab, proposed=proposed)
    if proposed is not None:
        check["proposed_tokens"], check["unproposed_logit"] = len(proposed), float(UNPROPOSED)
    engine.export_check = check
    return engine


GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")


def _local_rope_layers(model: torch.nn.Module) -> tuple[int, ...]:
    """The layers that rotate with the model's second table (Gemma 3's sliding layers)."""
    if not hasattr(getattr(model, "model", None), "rotary_emb_local"):
        return ()
    types = model.config.layer_types
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


def _partial_rotary_dim(config, head_dim: int) -> int:
    """The rotated dimensions of each head where they are fewer than head_dim, else 0."""
    rotary_dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    return rotary_dim if rotary_dim < head_dim else 0


def rope_tables(rotary: torch.nn.Module, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """``rotary``'s cos and sin at positions 0 .. ``positions`` - 1, ``[positions, rotary_dim
    / 2]``: the model's own tables, so any rope scaling is applied (its table for a sequence
    of that length).

    Where the module is the usual one (angles ``position * inv_freq`` in float32, times
    ``attention_scaling``), the cos and sin of its angles are taken in float64: torch's float32
    CPU cosine has erred in a process's first call now and then, enough to fail the export's
    logit check (CHANGELOG.md, 2026-12-04), and the table is built once and kept."""
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    half = cos.shape[-1] // 2
    cos, sin = cos[0, :, :half].numpy(), sin[0, :, :half].numpy()
    inv_freq = getattr(rotary, "inv_freq", None)  # read after the call: dynamic rope sets it
    if inv_freq is not None and inv_freq.shape[-1] == half:
        angles = np.arange(positions, dtype=np.float32)[:, None] * inv_freq.float().numpy()
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        exact_cos = (np.cos(angles.astype(np.float64)) * scaling).astype(np.float32)
        exact_sin = (np.sin(angles.astype(np.float64)) * scaling).astype(np.float32)
        # the module's own table within float32 error: the formula is its formula
        if np.abs(exact_sin - sin).max() < 1e-5 and np.abs(exact_cos - cos).max() < 1e-3:
            return exact_cos, exact_sin
    return cos.astype(np.float32), sin.astype(np.float32)


def unpacked_phi3(weights: dict, shape: DecoderShape, intermediate: int) -> dict:
    """Phi-3's packed ``qkv_proj`` and ``gate_up_proj`` as the q/k/v and gate/up weights the
    builder reads (it packs q/k/v again; rows of a Linear weight are its outputs)."""
    out = dict(weights)
    q_rows = shape.num_heads * shape.head_dim
    k_rows = shape.num_kv_heads * shape.head_dim
    for i in range(shape.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        q, k, v = np.split(out.pop(f"{attn}.qkv_proj.weight"), [q_rows, q_rows + k_rows])
        out.update({f"{attn}.q_proj.weight": q, f"{attn}.k_proj.weight": k})
        out[f"{attn}.v_proj.weight"] = v
        gate, up = np.split(out.pop(f"{mlp}.gate_up_proj.weight"), [intermediate])
        out.update({f"{mlp}.gate_proj.weight": gate, f"{mlp}.up_proj.weight": up})
    return out
