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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specrt.export.options import ENGINE_MODEL_TYPES

OPSET = 21
WINDOWED_TYPES = ("mistral", "phi3")  # one sliding window for every layer, whenever it is set
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
BATCHED_OPSET = 23  # the Attention op
IR_VERSIONS = {OPSET: 10, BATCHED_OPSET: 11}
SEQLENS_K = "seqlens_k"  # int32 [batch]: valid positions after this call, minus one
TOTAL_LENGTH = "total_sequence_length"  # int32 scalar: valid positions after this call
PROBABILITIES = "probabilities"  # softmax of the logits, computed where onnxruntime's code is hot
ARGMAX = "argmax"  # int64 [1, n]: each kept row's best token (greedy_outputs)
MAX_LOGIT = "max_logit"  # float32 [1, n]: its logit, so the host can refuse NaN/inf
MAX_PROBABILITY = "max_probability"  # float32 [1, n]: its probability (the draft's confidence)
# int64 [1]: -n, logits for the last n positions fed (prefill: -1). The Slice that keeps them
# reads its start on the host on CUDA: fed as it is, no node computes it on the device (a
# MemcpyToHost in every call, which also bars CUDA graphs).
LOGITS_START = "logits_start"
# The batched engine's inputs, computed by the host from each row's length:
POSITION_IDS = "position_ids"  # int64 [B, S]: each new token's position
CACHE_INDICES = "cache_indices"  # int64 [B, S, 2]: (row, position) its k and v are written at
ATTENTION_MASK = "attention_mask"  # bool [B, 1, S, L]: which cache slots each new token sees
# Models whose local (sliding-window) and global layers alternate: the local layers' mask.
LOCAL_ATTENTION_MASK = "attention_mask_local"
_MS = "com.microsoft"


@dataclass(frozen=True)
class DecoderShape:
    """What the builder needs from the HF config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    vocab_size: int  # logits width written (the tokenizer's vocabulary)
    # "float16" for GPU engines: weights, activations and KV cache; logits and their softmax
    # stay float32 (the sampler's precision, and fp16 would round close logits together).
    dtype: str = "float32"
    # Also output each kept row's argmax and max logit: a device backend copies back those few
    # numbers for greedy decoding instead of the logits.
    greedy_outputs: bool = False
    # "batched": attention from standard ops over a cache indexed per row, so a call feeds
    # several tokens to each of several rows (GroupQueryAttention refuses batch > 1 when more
    # than one token follows a cached prefix).
    attention: str = "group_query"
    # Qwen3: each head's q and k RMS-normalised (weights ``self_attn.q_norm`` / ``k_norm``,
    # over head_dim) before the rotation.
    qk_norm: bool = False
    # Gemma: the embedding is scaled by sqrt(hidden) and the MLP's gate uses the tanh GELU.
    embedding_scale: float = 1.0
    activation: str = "silu"  # or "gelu_tanh"
    # Gemma 2/3: scores scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5),
    # cap * tanh(x / cap) on attention scores and on the logits (0: none), and norms after the
    # attention and the MLP as well as before them.
    attention_scale: float | None = None
    attention_softcap: float = 0.0
    logit_softcap: float = 0.0
    sandwich_norms: bool = False
    # Layers attending to the last ``window`` positions only (the others see all of them), and
    # layers rotating with tables of their own (Gemma 3's local layers: their own rope base,
    # whatever the window).
    local_layers: tuple[int, ...] = ()
    window: int | None = None
    local_rope_layers: tuple[int, ...] = ()
    # Partial rotary (Phi-4-mini): only the first ``rotary_dim`` of each head's dimensions
    # rotate (0: all of them).
    rotary_dim: int = 0

    @property
    def scale(self) -> float:
        return float(self.attention_scale or self.head_dim**-0.5)

    @property
    def two_masks(self) -> bool:
        """Local and global layers both: the batched graph takes a mask for each kind."""
        return 0 < len(self.local_layers) < self.num_layers


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
) -> Path:
    """Llama-family graph: write it (and its weights as external data) to ``out_path``.

    ``weights`` uses the HF state-dict names (``model.layers.0.self_attn.q_proj.weight`` …, each
    ``[out, in]``); ``cos``/``sin`` are ``[positions, rotary_dim / 2]`` (rotary, scaled);
    ``local_rope``: the (cos, sin) of ``shape.local_rope_layers``.
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
        mlp = f"{prefix}.mlp"
        gate = b.linear(f"mlp_in.{i}", [f"{mlp}.gate_proj"], f"gate.{i}")
        up = b.linear(f"mlp_in.{i}", [f"{mlp}.up_proj"], f"up.{i}")
        if shape.activation == "gelu_tanh":
            b.node("FastGelu", [gate], [f"gate_act.{i}"], domain=_MS)
        else:  # SiLU
            b.node("Sigmoid", [gate], [f"gate_sigmoid.{i}"])
            b.node("Mul", [gate, f"gate_sigmoid.{i}"], [f"gate_act.{i}"])
        b.node("Mul", [f"gate_act.{i}", up], [f"gated.{i}"])
        down = b.linear(f"gated.{i}", [f"{mlp}.down_proj"], f"mlp_out.{i}")
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
    _lm_head(b, normed, weights[head][: shape.vocab_size].T, shape)
    return _save(b, shape, out_path)


def build_gpt2_graph(
    shape: DecoderShape, weights: Mapping[str, np.ndarray], out_path: Path
) -> Path:
    """GPT-2 graph: learned absolute positions, LayerNorm with bias, packed attention, tanh GELU.

    ``weights`` uses the HF state-dict names (``transformer.h.0.attn.c_attn.weight`` …; GPT-2's
    Conv1D weights are already ``[in, out]``)."""
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
    _lm_head(b, normed, weights[head][: shape.vocab_size].T, shape)
    return _save(b, shape, out_path)


def _lm_head(b: _GraphBuilder, normed: str, matrix: np.ndarray, shape: DecoderShape) -> None:
    """Logits ``[1, n, vocab]`` of the last n = ``-logits_start`` positions (``matrix``:
    ``[hidden, vocab]``) and their softmax, in float32. A prompt needs none of its logits, and
    on a large vocabulary the head is a good part of a prefill's work."""
    b.constant("positions_end", np.array([2**62], dtype=np.int64))
    b.constant("positions_axis", np.array([1], dtype=np.int64))
    b.node("Slice", [normed, LOGITS_START, "positions_end", "positions_axis"], ["head_in"])
    b.initializer("lm_head.MatMul", matrix)
    logits = "logits_uncapped" if shape.logit_softcap else "logits"
    if shape.dtype == "float32":
        b.node("MatMul", ["head_in", "lm_head.MatMul"], [logits])
    else:
        b.node("MatMul", ["head_in", "lm_head.MatMul"], ["logits_half"])
        b.node("Cast", ["logits_half"], [logits], to=TensorProto.FLOAT)
    if shape.logit_softcap:  # Gemma 2: cap * tanh(logits / cap)
        b.constant("logit_softcap", np.array(shape.logit_softcap, dtype=np.float32))
        b.node("Div", [logits, "logit_softcap"], ["logits_scaled"])
        b.node("Tanh", ["logits_scaled"], ["logits_tanh"])
        b.node("Mul", ["logits_tanh", "logit_softcap"], ["logits"])
    b.node("Softmax", ["logits"], [PROBABILITIES], axis=-1)
    if shape.greedy_outputs:
        b.node("ArgMax", ["logits"], [ARGMAX], axis=-1, keepdims=0)
        b.constant("vocab_axis", np.array([-1], dtype=np.int64))
        b.node("ReduceMax", ["logits", "vocab_axis"], [MAX_LOGIT], keepdims=0)
        b.node("ReduceMax", [PROBABILITIES, "vocab_axis"], [MAX_PROBABILITY], keepdims=0)


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


def _normed_qkv(b: _GraphBuilder, shape: DecoderShape, i: int, qkv: str, attn: str) -> str:
    """Packed q/k/v with each head of q and k RMS-normalised over head_dim (Qwen3), packed
    again, so that either attention reads it as it reads a plain projection."""
    h, kvh, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
    b.initializer("qkv_split", np.array([h * hd, kvh * hd, kvh * hd], dtype=np.int64))
    parts = [f"qn_in.{i}", f"kn_in.{i}", f"vn.{i}"]
    b.node("Split", [qkv, "qkv_split"], parts, axis=-1)
    normed = []
    for part, name, heads in ((parts[0], "q_norm", h), (parts[1], "k_norm", kvh)):
        b.initializer(f"heads_shape.{heads}", np.array([0, 0, heads, hd], dtype=np.int64))
        b.node("Reshape", [part, f"heads_shape.{heads}"], [f"{part}.heads"])
        b.node(
            "SimplifiedLayerNormalization",
            [f"{part}.heads", b.weight(f"{attn}.{name}.weight")],
            [f"{part}.normed"],
            epsilon=float(shape.norm_eps),
            axis=-1,
            stash_type=1,
        )
        b.initializer(f"flat_shape.{heads}", np.array([0, 0, heads * hd], dtype=np.int64))
        b.node("Reshape", [f"{part}.normed", f"flat_shape.{heads}"], [f"{part}.flat"])
        normed.append(f"{part}.flat")
    b.node("Concat", [*normed, parts[2]], [f"qkv_normed.{i}"], axis=-1)
    return f"qkv_normed.{i}"


def _batched_attention(b: _GraphBuilder, shape: DecoderShape, i: int, qkv: str, rotary: bool):
    """Layer ``i``'s attention for a batch of rows of different lengths: rotate q and k at each
    row's positions, write k and v into the layer's cache ``[B, L, kv_heads * head_dim]`` at
    ``(row, position)`` (ScatterND; past and present are bound to one buffer, so in place), then
    attend over the cache under the mask (the Attention op groups query heads itself)."""
    h, kvh, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
    b.initializer("qkv_split", np.array([h * hd, kvh * hd, kvh * hd], dtype=np.int64))
    b.node("Split", [qkv, "qkv_split"], [f"q.{i}", f"k.{i}", f"v.{i}"], axis=-1)
    q, k = f"q.{i}", f"k.{i}"
    if rotary:
        cos, sin = _rope_tables(shape, i)
        partial = {"rotary_embedding_dim": shape.rotary_dim} if shape.rotary_dim else {}
        for name, heads in ((q, h), (k, kvh)):
            b.node(
                "RotaryEmbedding",
                [name, POSITION_IDS, cos, sin],
                [f"{name}.rot"],
                domain=_MS,
                interleaved=0,
                num_heads=heads,
                **partial,
            )
        q, k = f"{q}.rot", f"{k}.rot"
    for kind, new in (("key", k), ("value", f"v.{i}")):
        b.node(  # the cache is [B, L, kv_heads * head_dim]: new rows go in as they come
            "ScatterND",
            [f"past_key_values.{i}.{kind}", CACHE_INDICES, new],
            [f"present.{i}.{kind}"],
        )
    local = shape.two_masks and i in shape.local_layers
    softcap = {"softcap": shape.attention_softcap} if shape.attention_softcap else {}
    b.node(
        "Attention",
        [
            q,
            f"present.{i}.key",
            f"present.{i}.value",
            LOCAL_ATTENTION_MASK if local else ATTENTION_MASK,
        ],
        [f"attn.{i}"],
        q_num_heads=h,
        kv_num_heads=kvh,
        scale=shape.scale,
        **softcap,
    )


def _rope_tables(shape: DecoderShape, i: int) -> tuple[str, str]:
    if i in shape.local_rope_layers:
        return "cos_cache_local", "sin_cache_local"
    return "cos_cache", "sin_cache"


def _attention(b: _GraphBuilder, shape: DecoderShape, i: int, qkv: str, rotary: bool) -> None:
    """Layer ``i``'s GroupQueryAttention on packed q/k/v; reads and writes the layer's cache."""
    if shape.attention == "batched":
        return _batched_attention(b, shape, i, qkv, rotary)
    inputs = [
        qkv,
        "",
        "",
        f"past_key_values.{i}.key",
        f"past_key_values.{i}.value",
        SEQLENS_K,
        TOTAL_LENGTH,
    ]
    # Same count as HF's sliding_window (the token's own position included): checked
    # against PyTorch past the window at export.
    window = shape.window if shape.window and i in shape.local_layers else -1
    b.node(
        "GroupQueryAttention",
        inputs + (list(_rope_tables(shape, i)) if rotary else []),
        [f"attn.{i}", f"present.{i}.key", f"present.{i}.value"],
        domain=_MS,
        num_heads=shape.num_heads,
        kv_num_heads=shape.num_kv_heads,
        scale=shape.scale,
        softcap=float(shape.attention_softcap),
        do_rotary=int(rotary),
        rotary_interleaved=0,
        local_window_size=window,
    )


def _save(b: _GraphBuilder, shape: DecoderShape, out_path: Path) -> Path:
    cache_type = TENSOR_TYPES[shape.dtype]
    kv_dims = ["batch", shape.num_kv_heads, "past_sequence_length", shape.head_dim]
    present_dims = ["batch", shape.num_kv_heads, "total_sequence_length", shape.head_dim]
    if shape.attention == "batched":
        kv_dims = present_dims = ["batch", "max_length", shape.num_kv_heads * shape.head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
        helper.make_tensor_value_info(SEQLENS_K, TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info(TOTAL_LENGTH, TensorProto.INT32, []),
        helper.make_tensor_value_info(LOGITS_START, TensorProto.INT64, [1]),
    ]
    if shape.attention == "batched":
        inputs[1:3] = [
            helper.make_tensor_value_info(POSITION_IDS, TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info(
                CACHE_INDICES, TensorProto.INT64, ["batch", "sequence", 2]
            ),
            helper.make_tensor_value_info(
                ATTENTION_MASK, TensorProto.BOOL, ["batch", 1, "sequence", "max_length"]
            ),
        ]
        if shape.two_masks:
            inputs.append(
                helper.make_tensor_value_info(
                    LOCAL_ATTENTION_MASK, TensorProto.BOOL, ["batch", 1, "sequence", "max_length"]
                )
            )
    outputs = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "kept", shape.vocab_size])
        for name in ("logits", PROBABILITIES)
    ]
    if shape.greedy_outputs:
        outputs.append(helper.make_tensor_value_info(ARGMAX, TensorProto.INT64, ["batch", "kept"]))
        for name in (MAX_LOGIT, MAX_PROBABILITY):
            outputs.append(
                helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "kept"])
            )
    for i in range(shape.num_layers):
        for kind in ("key", "value"):
            inputs.append(
                helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", cache_type, kv_dims)
            )
            outputs.append(
                helper.make_tensor_value_info(f"present.{i}.{kind}", cache_type, present_dims)
            )
    graph = helper.make_graph(b.nodes, "specrt_decoder", inputs, outputs, b.initializers)
    opset = BATCHED_OPSET if shape.attention == "batched" else OPSET
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(_MS, 1)],
        producer_name="specrt",
        # The oldest IR version with this opset, not the onnx package's newest: an older
        # onnxruntime refuses a newer IR version whatever ops the graph uses.
        ir_version=IR_VERSIONS[opset],
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(
        model,
        str(out_path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=out_path.name + ".data",
        size_threshold=1024,
    )
    return out_path


TENSOR_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


class _GraphBuilder:
    def __init__(self, weights: Mapping[str, np.ndarray], dtype: str = "float32") -> None:
        self.weights = weights
        self.float_type = np.dtype(dtype)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set()

    def node(self, op: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs):
        name = f"{op}.{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))

    def initializer(self, name: str, array: np.ndarray) -> str:
        if name not in self._names:
            array = np.ascontiguousarray(
                array, dtype=self.float_type if array.dtype.kind == "f" else None
            )
            self.initializers.append(numpy_helper.from_array(array, name))
            self._names.add(name)
        return name

    def constant(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(array, name))
        self._names.add(name)
        return name

    def weight(self, name: str) -> str:
        if name not in self.weights:
            raise KeyError(f"the checkpoint has no weight {name!r}")
        return self.initializer(name, self.weights[name])

    def conv1d(self, x: str, module: str, out: str) -> str:
        """GPT-2's Conv1D: x @ weight + bias, weight already ``[in, out]``."""
        self.node("MatMul", [x, self.weight(f"{module}.weight")], [f"{out}.matmul"])
        self.node("Add", [f"{out}.matmul", self.weight(f"{module}.bias")], [out])
        return out

    def linear(self, x: str, modules: list[str], out: str) -> str:
        """One MatMul for one or more Linear layers side by side (packed q/k/v), plus bias."""
        matrix = np.concatenate([self.weights[f"{m}.weight"] for m in modules], axis=0).T
        self.initializer(f"{out}.MatMul.weight", matrix)
        has_bias = [f"{m}.bias" in self.weights for m in modules]
        if not any(has_bias):
            self.node("MatMul", [x, f"{out}.MatMul.weight"], [out])
            return out
        bias = np.concatenate(
            [
                self.weights.get(f"{m}.bias", np.zeros(self.weights[f"{m}.weight"].shape[0]))
                for m in modules
            ]
        )
        self.initializer(f"{out}.bias", bias)
        self.node("MatMul", [x, f"{out}.MatMul.weight"], [f"{out}.matmul"])
        self.node("Add", [f"{out}.matmul", f"{out}.bias"], [out])
        return out
