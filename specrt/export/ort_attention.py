"""Each layer's attention in the onnxruntime engine graphs, on the packed q/k/v projection:
GroupQueryAttention (one row, its cache updated in place and rotary applied inside the op) or,
for the batched cache, standard ops (rotate, scatter the new k and v into the cache at each row's
positions, attend under the host's mask); the rotary tables each layer reads, and Qwen3's
per-head q/k norms, applied before either.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from specrt.export.ort_builder import (
    _MS,
    ATTENTION_MASK,
    CACHE_INDICES,
    KV_LENGTHS,
    LOCAL_ATTENTION_MASK,
    POSITION_IDS,
    SEQLENS_K,
    TOTAL_LENGTH,
    DecoderShape,
    _GraphBuilder,
)


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
    mask = LOCAL_ATTENTION_MASK if local else ATTENTION_MASK
    attention = dict(q_num_heads=h, kv_num_heads=kvh, scale=shape.scale)
    if shape.attention_softcap:
        attention["softcap"] = shape.attention_softcap
    if shape.two_query_rows:
        return _two_query_rows_attention(b, i, q, mask, attention)
    if shape.attend_by_length:  # row r's query j sees keys 0 .. kv_lengths[r] - S + j
        keys = [f"present.{i}.key", f"present.{i}.value", "", "", "", KV_LENGTHS]
        return b.node("Attention", [q, *keys], [f"attn.{i}"], is_causal=1, **attention)
    b.node(
        "Attention",
        [q, f"present.{i}.key", f"present.{i}.value", mask],
        [f"attn.{i}"],
        **attention,
    )


def _two_query_rows_attention(b: _GraphBuilder, i: int, q: str, mask: str, attention: dict):
    """The Attention op on at least two query rows: a call of one position gets a copy of its
    query (and of its mask row), whose output is dropped. The op multiplies a single query row
    with a kernel of its own that rounds differently from the one for several rows; with two
    or more every position gets the same bits however many came with it (checked bit for bit
    at export: `step_vs_one_at_a_time_max_abs_diff`)."""
    if "one_query_row" not in {name for node in b.nodes for name in node.output}:
        b.initializer("query_rows.two", np.array([2], dtype=np.int64))
        b.initializer("query_rows.zeros", np.zeros(4, dtype=np.int64))
        b.initializer("query_rows.axis", np.array([1], dtype=np.int64))
        b.initializer("query_rows.start", np.array([0], dtype=np.int64))
        b.node("Shape", [q], ["query_rows"], start=1, end=2)  # [1]: S
        b.node("Less", ["query_rows", "query_rows.two"], ["one_query_row.bool"])
        b.node("Cast", ["one_query_row.bool"], ["one_query_row"], to=TensorProto.INT64)
        # q [B, S, h * hd]: one row more at the end of axis 1 where S is 1
        b.node(
            "Concat",
            ["query_rows.zeros", "one_query_row", "query_rows.start"],
            ["query_rows.pads"],
            axis=0,
        )
        # masks [B, 1, S, L]: the same on axis 2
        b.node(
            "Concat",
            [
                "query_rows.zeros",
                "query_rows.start",
                "query_rows.start",
                "one_query_row",
                "query_rows.start",
            ],
            ["mask_rows.pads"],
            axis=0,
        )
    padded_mask = f"{mask}.two_rows"  # once for the layers that read it
    if not any(padded_mask in node.output for node in b.nodes):
        b.node("Pad", [mask, "mask_rows.pads"], [padded_mask], mode="edge")
    b.node("Pad", [q, "query_rows.pads"], [f"{q}.two_rows"], mode="edge")
    b.node(
        "Attention",
        [f"{q}.two_rows", f"present.{i}.key", f"present.{i}.value", padded_mask],
        [f"attn.{i}.two_rows"],
        **attention,
    )
    b.node(
        "Slice",
        [f"attn.{i}.two_rows", "query_rows.start", "query_rows", "query_rows.axis"],
        [f"attn.{i}"],
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
