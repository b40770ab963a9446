"""EAGLE-3 heads in the layout their authors publish, and a PyTorch reference of what they compute.

A head directory holds ``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``, a Llama
config of one layer with ``draft_vocab_size`` and ``target_hidden_size``; optionally
``eagle_config.eagle_aux_hidden_state_layer_ids``) and its weights (``model.safetensors`` or
``pytorch_model.bin``): ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` (and
``embed_tokens`` where the head has its own; published heads use the target's).

`Eagle3Head` is the reference the exported graph is checked against (`specrt.export.eagle_check`),
written from the EAGLE-3 paper's and its authors' description of the layer; `target_features` is
what the head reads from the target.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from specrt.errors import ExportError

HEAD_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", "d2t")
AUX_LAYERS = "eagle_aux_hidden_state_layer_ids"


@dataclass
class HeadCheckpoint:
    config: LlamaConfig
    weights: dict[str, torch.Tensor]
    layers: tuple[int, ...]  # the target layers whose input states the head reads
    # The residual stream starts from the normed features (some trainers' variant), not the
    # features as they come.
    norm_before_residual: bool = False


def read_head(path: Path, target_config) -> HeadCheckpoint:
    """The head at ``path``, checked against the target it drafts for."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    config = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    weights = _read_weights(path)
    missing = [name for name in REQUIRED if name not in weights]
    missing += [] if any(k.startswith("midlayer.") for k in weights) else ["midlayer.*"]
    if missing:
        raise ExportError(
            f"EAGLE head {str(path)!r} lacks {', '.join(missing)}: pass a head in the layout "
            "its authors publish (fc, midlayer.*, norm, lm_head, d2t, t2d)"
        )
    target_layers = int(target_config.num_hidden_layers)
    # Each id names the target layer whose input the head reads (vLLM's convention: HF's
    # hidden_states[id]), at the config's top level or in its eagle_config.
    ids = raw.get(AUX_LAYERS) or (raw.get("eagle_config") or {}).get(AUX_LAYERS)
    if not ids:  # the authors' default: early, middle and late layers
        ids = sorted({2, target_layers // 2, target_layers - 3})
    layers = tuple(int(i) for i in ids)
    target_hidden = int(raw.get("target_hidden_size") or target_config.hidden_size)
    fc_in = int(weights["fc.weight"].shape[1])
    problems = []
    if target_hidden != int(target_config.hidden_size):
        problems.append(f"target_hidden_size {target_hidden}, the target's is ")
        problems[-1] += str(target_config.hidden_size)
    if fc_in != len(layers) * int(target_config.hidden_size):
        problems.append(
            f"fc takes {fc_in} features, not {len(layers)} layers x {target_config.hidden_size}"
        )
    if not all(0 <= i < target_layers for i in layers):
        problems.append(f"layers {list(layers)} outside the target's {target_layers}")
    if int(config.vocab_size) != int(target_config.vocab_size):
        problems.append(f"vocab_size {config.vocab_size}, the target's is ")
        problems[-1] += str(target_config.vocab_size)
    if problems:
        raise ExportError(
            f"EAGLE head {str(path)!r} does not fit this target: {'; '.join(problems)}; pass "
            "the head trained for this target"
        )
    return HeadCheckpoint(config, weights, layers, bool(raw.get("norm_before_residual")))


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    found = next((path / name for name in HEAD_WEIGHTS if (path / name).is_file()), None)
    if found is None:
        raise ExportError(f"EAGLE head {str(path)!r} has no weights ({' or '.join(HEAD_WEIGHTS)})")
    if found.suffix == ".safetensors":
        from safetensors.torch import load_file

        weights = load_file(str(found))
    else:
        weights = torch.load(found, map_location="cpu", weights_only=True)
    # Some trainers save the module under "model."; the names below it are the layout's.
    return {k.removeprefix("model."): v for k, v in weights.items()}


def target_features(model: torch.nn.Module, ids: list[int], head: HeadCheckpoint) -> torch.Tensor:
    """The head's input at each position of ``ids``: the residual stream entering each of the
    head's target layers (HF's ``hidden_states[i]``), side by side, through ``fc``;
    ``[len(ids), hidden]``."""
    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        joined = torch.cat([states[i][0].float() for i in head.layers], dim=-1)
        return joined @ head.weights["fc.weight"].float().T


class Eagle3Head(torch.nn.Module):
    """The head's layer in PyTorch: ``forward(features, ids, positions)`` -> (logits over the
    head's vocabulary, hidden states), causal over the positions given (no cache)."""

    def __init__(self, head: HeadCheckpoint, embedding: torch.Tensor) -> None:
        super().__init__()
        config, w = head.config, {k: v.float() for k, v in head.weights.items()}
        self.config = config
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.embedding = w.get("embed_tokens.weight", embedding.float())
        self.norm_before_residual = head.norm_before_residual
        self.w = w
        eps = float(config.rms_norm_eps)
        self.norms = {}
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            self.norms[name] = _norm(w[f"midlayer.{name}.weight"], eps)
        self.norms["norm"] = _norm(w["norm.weight"], eps)
        self.mlp = LlamaMLP(config)
        self.mlp.load_state_dict(
            {k.removeprefix("midlayer.mlp."): v for k, v in w.items() if ".mlp." in k}
        )
        self.rotary = LlamaRotaryEmbedding(config)

    @torch.no_grad()
    def forward(self, features: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor):
        """``features [S, hidden]``, ``ids [S]``, ``positions [S]``."""
        w, attn = self.w, "midlayer.self_attn"
        embedded = self.norms["input_layernorm"](self.embedding[ids])
        normed = self.norms["hidden_norm"](features)
        x = torch.cat([embedded, normed], dim=-1)[None]
        s = x.shape[1]
        q = (x @ w[f"{attn}.q_proj.weight"].T).view(1, s, self.heads, -1).transpose(1, 2)
        k = (x @ w[f"{attn}.k_proj.weight"].T).view(1, s, self.kv_heads, -1).transpose(1, 2)
        v = (x @ w[f"{attn}.v_proj.weight"].T).view(1, s, self.kv_heads, -1).transpose(1, 2)
        cos, sin = self.rotary(x, positions[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, s, -1)
        start = normed if self.norm_before_residual else features
        residual = start[None] + attended @ w[f"{attn}.o_proj.weight"].T
        hidden = residual + self.mlp(self.norms["post_attention_layernorm"](residual))
        logits = self.norms["norm"](hidden) @ w["lm_head.weight"].T
        return logits[0], hidden[0]


def _norm(weight: torch.Tensor, eps: float) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(weight.shape[0], eps=eps)
    norm.weight.data = weight.clone()
    return norm


def head_weights_numpy(head: HeadCheckpoint) -> dict[str, np.ndarray]:
    """The head's float weights as arrays (the graph builder's input)."""
    return {k: v.float().numpy() for k, v in head.weights.items() if v.is_floating_point()}


def head_features(head: HeadCheckpoint):
    """What the target's engine computes for ``head`` (`ort_graph.EagleFeatures`)."""
    from specrt.export.ort_graph import EagleFeatures

    return EagleFeatures(head.layers, head.weights["fc.weight"].float().numpy().T)
