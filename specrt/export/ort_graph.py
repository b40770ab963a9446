"""The onnxruntime engine: a lean decoder graph built from the model's weights with ORT's fused
contrib ops (GroupQueryAttention with rotary, SkipSimplifiedLayerNormalization).

On CPU with small models the portable graph's cost is per-node overhead: about 100 nodes per layer,
most of them shape arithmetic. This graph has ~10 per layer. Its KV cache is one preallocated
buffer per layer that the graph reads as ``past`` and writes as ``present`` in place (the runtime
binds both to the same memory); the valid length is an input, so rolling back rejected tokens is a
length change with nothing copied.

Llama-family decoders (llama, qwen2/3, mistral, phi3, gemma 1/2/3): pre-norm RMSNorm, rotary
positions, grouped-query attention, gated MLP (Gemma 2/3 add norms after each block,
soft-capping and local layers with a window); GPT-2: LayerNorm, learned positions (computed
in the graph from the lengths), multi-head attention, tanh GELU. Inputs
``input_ids [1, S]``, ``seqlens_k [1]``
(int32: past + S - 1), ``total_sequence_length []`` (int32: past + S), ``logits_start [1]``
(int64 -n: logits for the last n positions only),
``past_key_values.{i}.key/value``; outputs ``logits [1, n, vocab]``, ``probabilities`` (their
softmax: the draft's confidence and temperature-1 sampling read it instead of a NumPy pass over
the vocabulary, which runs cold right after a model call) and ``present.{i}.*``.
The lengths are GroupQueryAttention's own inputs, fed as numbers rather than derived from a mask
whose shape changes every call: every input but ``input_ids`` keeps its shape, so the runtime
binds them once and only writes new values into their memory.
This module needs onnx and numpy only: the exporter hands it the weights as arrays.

Here: what a checkpoint's config allows the engine, and the two decoders (llama family, GPT-2).
The graph's input and output names, `DecoderShape`, the builder, the head and the saving are in
`specrt.export.ort_builder`; each layer's attention (and rotary) in `specrt.export.ort_attention`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from specrt.export.draft_vocab import columns_of
from specrt.export.options import ENGINE_MODEL_TYPES
from specrt.export.ort_attention import _attention, _normed_qkv
from specrt.export.ort_builder import (
    _MS,
    FEATURES,
    POSITION_IDS,
    TOTAL_LENGTH,
    DecoderShape,
    _GraphBuilder,
    _lm_head,
    _save,
)


@dataclass(frozen=True)
class EagleFeatures:
    """What a target computes for an EAGLE-3 head: the residual stream entering each of
    ``layers`` (the hidden states HF's ``output_hidden_states`` lists at those indices),
    concatenated and multiplied by ``fc`` ``[len(layers) * hidden, head hidden]`` (the head's
    ``fc.weight``, transposed)."""

    layers: tuple[int, ...]
    fc: np.ndarray


WINDOWED_TYPES = ("mistral", "phi3")  # one sliding window for every layer, whenever it is set
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def sliding_window(config, max_positions: int) -> tuple[int | None, tuple[int, ...]]:
    """The window of the model's local layers, where it is narrower than the model's positions,
    and which layers those are: the config's ``layer_types`` where it has them (Gemma 2/3, Qwen
    with ``max_window_layers``), else every layer (Mistral, Phi-3). ``(None, ())``: none."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:  # the config names each layer's kind
        local = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    elif config.model_type in WINDOWED_TYPES or getattr(config, "use_sliding_window", False):
        local = tuple(range(config.num_hidden_layers))
    else:
        local = ()
    if window and window < max_positions and local:
        return int(window), local
    return None, ()


def activation(config) -> str:
    """The MLP's activation (Gemma 2/3 name it ``hidden_activation``)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")


def unsupported_reason(config, max_positions: int, device: str = "cpu") -> str | None:
    """Why this checkpoint cannot get the onnxruntime engine for ``device`` (None when it
    can). Sliding windows: the CPU engine's host writes them into a mask per kind of layer;
    the cuda engine's GroupQueryAttention takes each layer's window as an attribute."""
    if config.model_type not in ENGINE_MODEL_TYPES:
        return f"model type {config.model_type!r} has no onnxruntime engine builder yet"
    if config.model_type == "gpt2":
        return _gpt2_unsupported_reason(config)
    if activation(config) not in ACTIVATIONS:
        return f"activation {activation(config)!r} (only {', '.join(ACTIVATIONS)})"
    types = set(getattr(config, "layer_types", None) or ())
    if types - {"sliding_attention", "full_attention"}:
        return f"layer types {sorted(types)} (only sliding_attention and full_attention)"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if _head_dim_reason(head_dim):
        return _head_dim_reason(head_dim)
    rotary_dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    if rotary_dim % (16 if device == "cuda" else 2):
        return f"rotary dimension {rotary_dim} (GroupQueryAttention needs a multiple of 16)"
    return None


def rope_positions(config, max_positions: int) -> int:
    """Positions below which the model's rotary table does not change with the sequence
    length, so that a table built once is exact: longrope switches to its long factors past
    ``original_max_position_embeddings`` (the engine stops there); dynamic NTK rescales only
    past ``max_position_embeddings``, which no sequence reaches."""
    rope = getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) not in ("longrope", "su"):
        return max_positions
    original = getattr(config, "original_max_position_embeddings", None) or rope.get(
        "original_max_position_embeddings"
    )
    return min(max_positions, int(original or max_positions))


def _gpt2_unsupported_reason(config) -> str | None:
    if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        return f"activation {config.activation_function!r} (only the tanh GELU)"
    if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
        return "non-standard attention scaling"
    if getattr(config, "add_cross_attention", False):
        return "cross-attention"
    return _head_dim_reason(config.n_embd // config.n_head)


def _head_dim_reason(head_dim: int) -> str | None:
    if head_dim % 16:
        return f"head dim {head_dim} (GroupQueryAttention on CPU needs a multiple of 16)"
    return None


def build_decoder_graph(
    shape: DecoderShape,
    weights: Mapping[str, np.ndarray],
    cos: np.ndarray,
    sin: np.ndarray,
    out_path: Path,
    local_rope: tuple[np.ndarray, np.ndarray] | None = None,
    features: EagleFeatures | None = None,
    proposed: np.ndarray | None = None,
) -> Path:
    """Llama-family graph: write it (and its weights as external data) to ``out_path``.

    ``weights`` uses the HF state-dict names (``model.layers.0.self_attn.q_proj.weight`` …, each
    ``[out, in]``); ``cos``/``sin`` are ``[positions, rotary_dim / 2]`` (rotary, scaled);
    ``local_rope``: the (cos, sin) of ``shape.local_rope_layers``; ``features``: an EAGLE
    head's input, computed here at every position fed (`FEATURES`); ``proposed``: a draft's
    reduced vocabulary (`specrt.export.draft_vocab`).
    """
    b = _GraphBuilder(weights, shape.dtype)
    b.initializer("cos_cache", cos)
    b.initializer("sin_cache", sin)
    if shape.local_rope_layers:
        b.initializer("cos_cache_local", local_rope[0])
        b.initializer("sin_cache_local", local_rope[1])

    scaled = shape.embedding_scale != 1.0
    embedding = "unscaled" if scaled else "embedded"
    b.node("Gather", [b.weight("model.embed_tokens.weight"), "input_ids"], [embedding])
    if scaled:
        b.initializer("embedding_scale", np.array(shape.embedding_scale))
        b.node("Mul", [embedding, "embedding_scale"], ["embedded"])
    eps = float(shape.norm_eps)
    residual = "embedded"
    b.node(
        "SimplifiedLayerNormalization",
        [residual, b.weight("model.layers.0.input_layernorm.weight")],
        ["normed.0"],
        epsilon=eps,
        axis=-1,
        stash_type=1,
    )
    normed = "normed.0"
    for i in range(shape.num_layers):
        prefix = f"model.layers.{i}"
        attn = f"{prefix}.self_attn"
        qkv = b.linear(normed, [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"], f"qkv.{i}")
        if shape.qk_norm:
            qkv = _normed_qkv(b, shape, i, qkv, attn)
        _attention(b, shape, i, qkv, rotary=True)
        attn_out = b.linear(f"attn.{i}", [f"{attn}.o_proj"], f"attn_out.{i}")
        mid_norm = "post_attention_layernorm"
        if shape.sandwich_norms:  # Gemma 2/3: the block's output is normed before the sum
            attn_out = _rms_norm(b, attn_out, f"{prefix}.post_attention_layernorm", eps)
            mid_norm = "pre_feedforward_layernorm"
        b.node(
            "SkipSimplifiedLayerNormalization",
            [residual, attn_out, b.weight(f"{prefix}.{mid_norm}.weight")],
            [f"mlp_in.{i}", "", "", f"residual_mid.{i}"],
            domain=_MS,
            epsilon=eps,
        )
        down = gated_mlp(b, f"mlp_in.{i}", f"{prefix}.mlp", i, shape.activation)
        if shape.sandwich_norms:
            down = _rms_norm(b, down, f"{prefix}.post_feedforward_layernorm", eps)
        last = i == shape.num_layers - 1
        next_norm = "model.norm.weight" if last else f"model.layers.{i + 1}.input_layernorm.weight"
        b.node(
            "SkipSimplifiedLayerNormalization",
            [f"residual_mid.{i}", down, b.weight(next_norm)],
            [f"normed.{i + 1}", "", "", f"residual.{i + 1}"],
            domain=_MS,
            epsilon=eps,
        )
        residual, normed = f"residual.{i + 1}", f"normed.{i + 1}"

    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    _output_layer(b, normed, weights[head], shape, proposed)
    outputs = () if features is None else (_features(b, features, shape.dtype),)
    return _save(b, shape, out_path, extra_outputs=outputs)


def _features(b: _GraphBuilder, features: EagleFeatures, dtype: str) -> onnx.ValueInfoProto:
    """The head's features: the residual stream entering each of ``features.layers``, side by
    side, through the head's ``fc`` (EAGLE-3), in float32 whatever the graph's precision (only
    ``hidden`` numbers a position leave the target, not three times that)."""
    states = ["embedded" if i == 0 else f"residual.{i}" for i in features.layers]
    b.node("Concat", states, ["eagle_states"], axis=-1)
    b.initializer("eagle.fc.MatMul", features.fc)
    projected = FEATURES if dtype == "float32" else "eagle_features_half"
    b.node("MatMul", ["eagle_states", "eagle.fc.MatMul"], [projected])
    if dtype != "float32":
        b.node("Cast", [projected], [FEATURES], to=TensorProto.FLOAT)
    width = features.fc.shape[1]
    return helper.make_tensor_value_info(FEATURES, TensorProto.FLOAT, ["batch", "sequence", width])


def build_gpt2_graph(
    shape: DecoderShape,
    weights: Mapping[str, np.ndarray],
    out_path: Path,
    proposed: np.ndarray | None = None,
    features: EagleFeatures | None = None,
) -> Path:
    """GPT-2 graph: learned absolute positions, LayerNorm with bias, packed attention, tanh GELU.

    ``weights`` uses the HF state-dict names (``transformer.h.0.attn.c_attn.weight`` …; GPT-2's
    Conv1D weights are already ``[in, out]``); ``features``: as `build_decoder_graph`'s."""
    b = _GraphBuilder(weights, shape.dtype)
    positions = POSITION_IDS
    if shape.attention != "batched":  # past .. past+S-1, from the total and new lengths
        positions = "positions"
        b.node("Cast", [TOTAL_LENGTH], ["total_len64"], to=TensorProto.INT64)
        b.node("Shape", ["input_ids"], ["ids_shape"], start=1, end=2)
        b.node("Squeeze", ["ids_shape"], ["new_len64"])
        b.node("Sub", ["total_len64", "new_len64"], ["past_len64"])
        b.constant("step", np.array(1, dtype=np.int64))
        b.node("Range", ["past_len64", "total_len64", "step"], [positions])
    b.node("Gather", [b.weight("transformer.wte.weight"), "input_ids"], ["token_embedded"])
    b.node("Gather", [b.weight("transformer.wpe.weight"), positions], ["position_embedded"])
    b.node("Add", ["token_embedded", "position_embedded"], ["embedded"])
    eps = float(shape.norm_eps)
    b.node(
        "LayerNormalization",
        [
            "embedded",
            b.weight("transformer.h.0.ln_1.weight"),
            b.weight("transformer.h.0.ln_1.bias"),
        ],
        ["normed.0"],
        epsilon=eps,
        axis=-1,
    )
    residual, normed = "embedded", "normed.0"
    for i in range(shape.num_layers):
        prefix = f"transformer.h.{i}"
        qkv = b.conv1d(normed, f"{prefix}.attn.c_attn", f"qkv.{i}")
        _attention(b, shape, i, qkv, rotary=False)
        attn_out = b.conv1d(f"attn.{i}", f"{prefix}.attn.c_proj", f"attn_out.{i}")
        b.node(
            "SkipLayerNormalization",
            [
                residual,
                attn_out,
                b.weight(f"{prefix}.ln_2.weight"),
                b.weight(f"{prefix}.ln_2.bias"),
            ],
            [f"mlp_in.{i}", "", "", f"residual_mid.{i}"],
            domain=_MS,
            epsilon=eps,
        )
        b.node(
            "MatMul",
            [f"mlp_in.{i}", b.weight(f"{prefix}.mlp.c_fc.weight")],
            [f"fc.{i}"],
        )
        b.node(  # gelu_new, GPT-2's tanh approximation, with the c_fc bias folded in
            "FastGelu",
            [f"fc.{i}", b.weight(f"{prefix}.mlp.c_fc.bias")],
            [f"fc_act.{i}"],
            domain=_MS,
        )
        down = b.conv1d(f"fc_act.{i}", f"{prefix}.mlp.c_proj", f"mlp_out.{i}")
        last = i == shape.num_layers - 1
        norm = "transformer.ln_f" if last else f"transformer.h.{i + 1}.ln_1"
        b.node(
            "SkipLayerNormalization",
            [f"residual_mid.{i}", down, b.weight(f"{norm}.weight"), b.weight(f"{norm}.bias")],
            [f"normed.{i + 1}", "", "", f"residual.{i + 1}"],
            domain=_MS,
            epsilon=eps,
        )
        residual, normed = f"residual.{i + 1}", f"normed.{i + 1}"

    head = "lm_head.weight" if "lm_head.weight" in weights else "transformer.wte.weight"
    _output_layer(b, normed, weights[head], shape, proposed)
    outputs = () if features is None else (_features(b, features, shape.dtype),)
    return _save(b, shape, out_path, extra_outputs=outputs)


def _output_layer(
    b: _GraphBuilder,
    normed: str,
    weight: np.ndarray,
    shape: DecoderShape,
    proposed: np.ndarray | None,
) -> None:
    """The logits over the vocabulary, from the rows of ``weight`` (``[vocab, hidden]``) the
    model proposes: all, or a draft's reduced vocabulary written at the target's ids."""
    if proposed is None:
        return _lm_head(b, normed, weight[: shape.vocab_size].T, shape)
    columns = columns_of(proposed, shape.vocab_size)
    _lm_head(b, normed, weight[proposed].T, shape, vocab_map=columns)


def gated_mlp(b: _GraphBuilder, x: str, mlp: str, tag: object, activation: str = "silu") -> str:
    """The Llama family's MLP on ``x``: down(act(gate(x)) * up(x)), weights ``{mlp}.*_proj``;
    the name of its output (``tag`` tells this MLP's names from the others')."""
    gate = b.linear(x, [f"{mlp}.gate_proj"], f"gate.{tag}")
    up = b.linear(x, [f"{mlp}.up_proj"], f"up.{tag}")
    if activation == "gelu_tanh":
        b.node("FastGelu", [gate], [f"gate_act.{tag}"], domain=_MS)
    else:  # SiLU
        b.node("Sigmoid", [gate], [f"gate_sigmoid.{tag}"])
        b.node("Mul", [gate, f"gate_sigmoid.{tag}"], [f"gate_act.{tag}"])
    b.node("Mul", [f"gate_act.{tag}", up], [f"gated.{tag}"])
    return b.linear(f"gated.{tag}", [f"{mlp}.down_proj"], f"mlp_out.{tag}")


def _rms_norm(b: _GraphBuilder, x: str, module: str, eps: float) -> str:
    b.node(
        "SimplifiedLayerNormalization",
        [x, b.weight(f"{module}.weight")],
        [f"{x}.normed"],
        epsilon=eps,
        axis=-1,
        stash_type=1,
    )
    return f"{x}.normed"
