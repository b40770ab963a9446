"""An EAGLE-3 head's onnxruntime engine: one decoder layer that drafts from the target's features.

A head reads, at position p, the features of position p (the target's, through the head's fc,
which the target graph computes: `ort_graph.EagleFeatures`; or, chaining, the head's own hidden
state of the position before) and the embedding of the token after it, and predicts the token
after that. Its one layer attends over its own cache, like a draft model's: the batched cache,
so the runtime runs it as it runs a draft model's engine (`specrt.backends.eagle`).

The layer (EAGLE-3's ``midlayer``): the embedding and the features are RMS-normed apart
(``input_layernorm``, ``hidden_norm``) and side by side ``[2 * hidden]`` give q, k and v; the
features are the residual stream. Its logits cover the head's reduced vocabulary, mapped to the
target's by ``d2t`` (a head token ``d`` is the target's ``d + d2t[d]``); the graph writes them at
the target's ids (`UNPROPOSED` elsewhere), so the sampler and the verifier see a distribution
over the target's vocabulary like any draft's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from specrt.export.ort_attention import _attention
from specrt.export.ort_builder import (
    _MS,
    HIDDEN_OUT,
    HIDDEN_STATES,
    LOGITS_START,
    DecoderShape,
    _GraphBuilder,
    _lm_head,
    _save,
)
from specrt.export.ort_graph import gated_mlp

LAYER = "midlayer"  # the head's one layer, as its published checkpoints name it


def vocab_map(d2t: np.ndarray, vocab: int) -> np.ndarray:
    """``[vocab]``: each target token's column among the head's logits, or the head's
    vocabulary size where the head never proposes it (ids the head maps past ``vocab`` are
    left out: the tokenizer has no such token)."""
    head_vocab = len(d2t)
    columns = np.full(vocab, head_vocab, dtype=np.int64)
    targets = np.arange(head_vocab, dtype=np.int64) + d2t.astype(np.int64)
    inside = (targets >= 0) & (targets < vocab)
    columns[targets[inside]] = np.arange(head_vocab)[inside]
    return columns


def build_head_graph(
    shape: DecoderShape,
    weights: Mapping[str, np.ndarray],
    embedding: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    columns: np.ndarray,
    out_path: Path,
    norm_before_residual: bool = False,
) -> Path:
    """Write the head's graph (batched cache, ``shape.num_layers`` 1) to ``out_path``.

    ``weights``: the head checkpoint's names (``midlayer.self_attn.q_proj.weight`` …, ``norm``,
    ``lm_head``); ``embedding``: the target's ``[vocab, hidden]`` (published heads share it);
    ``cos``/``sin``: the head's rotary tables; ``columns``: `vocab_map`;
    ``norm_before_residual``: the residual stream starts from the normed features."""
    b = _GraphBuilder(weights, shape.dtype)
    b.initializer("cos_cache", cos)
    b.initializer("sin_cache", sin)
    b.initializer("embed_tokens", embedding)
    b.node("Gather", ["embed_tokens", "input_ids"], ["embedded"])
    features = HIDDEN_STATES  # float32 in and out, whatever the graph computes in
    if shape.dtype != "float32":
        features = f"{HIDDEN_STATES}.half"
        b.node("Cast", [HIDDEN_STATES], [features], to=TensorProto.FLOAT16)
    eps = float(shape.norm_eps)
    for x, norm in (("embedded", "input_layernorm"), (features, "hidden_norm")):
        b.node(
            "SimplifiedLayerNormalization",
            [x, b.weight(f"{LAYER}.{norm}.weight")],
            [f"{x}.normed"],
            epsilon=eps,
            axis=-1,
            stash_type=1,
        )
    b.node("Concat", ["embedded.normed", f"{features}.normed"], ["layer_in"], axis=-1)
    residual = f"{features}.normed" if norm_before_residual else features
    attn = f"{LAYER}.self_attn"
    qkv = b.linear("layer_in", [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"], "qkv.0")
    _attention(b, shape, 0, qkv, rotary=True)
    attn_out = b.linear("attn.0", [f"{attn}.o_proj"], "attn_out.0")
    b.node(
        "SkipSimplifiedLayerNormalization",
        [residual, attn_out, b.weight(f"{LAYER}.post_attention_layernorm.weight")],
        ["mlp_in", "", "", "residual_mid"],
        domain=_MS,
        epsilon=eps,
    )
    down = gated_mlp(b, "mlp_in", f"{LAYER}.mlp", 0)
    b.node(  # the head's hidden state (the next step's features), and its norm for the logits
        "SkipSimplifiedLayerNormalization",
        ["residual_mid", down, b.weight("norm.weight")],
        ["normed", "", "", "hidden"],
        domain=_MS,
        epsilon=eps,
    )
    # a head over the whole vocabulary in the target's order needs no mapping (a Gather over the
    # vocabulary costs a good part of a small head's step)
    identity = np.array_equal(columns, np.arange(len(columns)))
    matrix = weights["lm_head.weight"].T
    _lm_head(b, "normed", matrix, shape, vocab_map=None if identity else columns)
    b.node("Slice", ["hidden", LOGITS_START, "positions_end", "positions_axis"], ["hidden_kept"])
    if shape.dtype == "float32":
        b.node("Identity", ["hidden_kept"], [HIDDEN_OUT])
    else:
        b.node("Cast", ["hidden_kept"], [HIDDEN_OUT], to=TensorProto.FLOAT)
    hidden = int(embedding.shape[1])
    inputs = (
        helper.make_tensor_value_info(
            HIDDEN_STATES, TensorProto.FLOAT, ["batch", "sequence", hidden]
        ),
    )
    outputs = (
        helper.make_tensor_value_info(HIDDEN_OUT, TensorProto.FLOAT, ["batch", "kept", hidden]),
    )
    return _save(b, shape, out_path, extra_inputs=inputs, extra_outputs=outputs)
