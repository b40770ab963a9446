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
    try:
        raw = json.loads((path / "config.json").read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        config = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    except (OSError, ValueError, TypeError, RecursionError) as exc:
        raise ExportError(
            f"EAGLE head {str(path)!r}: its config.json cannot be read ({exc}); pass a head in "
            "the layout its authors publish"
        ) from None
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
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise ExportError(
            f"EAGLE head {str(path)!r}: {AUX_LAYERS} is {json.dumps(ids)}, not a list of "
            "integers (the target layers it reads): fix its config.json"
        )
    layers = tuple(ids)
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
    _check_config(path, raw, weights)
    _check_shapes(path, config, weights, layers)
    return HeadCheckpoint(config, weights, layers, bool(raw.get("norm_before_residual")))


def _check_config(path: Path, raw: dict, weights: dict) -> None:
    """What the module is not made from but a head's readers go by: a config that disagrees
    with its weights was saved for another head."""
    layers = raw.get("num_hidden_layers", 1)
    if layers != 1:
        raise ExportError(
            f"EAGLE head {str(path)!r}: num_hidden_layers is {json.dumps(layers)}; an EAGLE-3 "
            "head is one decoder layer (midlayer.*), and specrt drafts with no other: pass a "
            "one-layer head"
        )
    rows = int(weights["lm_head.weight"].shape[0])
    vocab = raw.get("draft_vocab_size", rows)
    if vocab != rows:
        raise ExportError(
            f"EAGLE head {str(path)!r}: draft_vocab_size is {json.dumps(vocab)} and its lm_head "
            f"has {rows} rows: pass the config saved with these weights"
        )


def _check_shapes(path: Path, config: LlamaConfig, weights: dict, layers: tuple[int, ...]) -> None:
    """The weights against the module their config makes (on the meta device: nothing
    allocated), now: the mismatch was found after the target's export, in a traceback."""
    try:
        with torch.device("meta"):
            module = Eagle3Head(config, torch.zeros(0), layers, weights["lm_head.weight"].shape[0],
                                weights["fc.weight"].shape[1] // len(layers))  # fmt: skip
        wanted = {k: tuple(v.shape) for k, v in module.state_dict().items() if k != "t2d"}
    except (ValueError, TypeError, ZeroDivisionError, RuntimeError) as exc:
        raise ExportError(
            f"EAGLE head {str(path)!r}: its config.json does not make a head ({exc}); fix it"
        ) from None
    given = {
        k: tuple(v.shape) for k, v in weights.items() if k not in ("t2d", "embed_tokens.weight")
    }
    wrong = [f"{k} {given.get(k, 'missing')} where its config makes {wanted[k]}"
             for k in wanted if given.get(k) != wanted[k]]  # fmt: skip
    if wrong:
        raise ExportError(
            f"EAGLE head {str(path)!r}: its weights do not match its config.json "
            f"({'; '.join(wrong[:3])}); pass the config saved with these weights"
        )


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    found = next((path / name for name in HEAD_WEIGHTS if (path / name).is_file()), None)
    if found is None:
        raise ExportError(f"EAGLE head {str(path)!r} has no weights ({' or '.join(HEAD_WEIGHTS)})")
    try:
        if found.suffix == ".safetensors":
            from safetensors.torch import load_file

            weights = load_file(str(found))
        else:
            weights = torch.load(found, map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors' and pickle's own errors: a damaged file
        raise ExportError(
            f"EAGLE head {str(path)!r}: {found.name} cannot be read ({type(exc).__name__}: "
            f"{str(exc)[:200]}); download or save it again"
        ) from None
    # Some trainers save the module under "model."; the names below it are the layout's.
    return {k.removeprefix("model."): v for k, v in weights.items()}


def target_states(model: torch.nn.Module, ids: torch.Tensor, layers: tuple[int, ...]):
    """The residual stream entering each of ``layers`` (HF's ``hidden_states[i]``), side by
    side: ``[batch, positions, len(layers) * hidden]`` for ``ids [batch, positions]``."""
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        return torch.cat([states[i].float() for i in layers], dim=-1)


def target_features(model: torch.nn.Module, ids: list[int], head: HeadCheckpoint) -> torch.Tensor:
    """The head's input at each position of ``ids``: `target_states` through the head's
    ``fc``; ``[len(ids), hidden]``."""
    joined = target_states(model, torch.tensor([ids]), head.layers)[0]
    return joined @ head.weights["fc.weight"].float().T


class Eagle3Head(torch.nn.Module):
    """An EAGLE-3 head in PyTorch, its parameters named as the layout names them (``fc``,
    ``midlayer.*``, ``norm``, ``lm_head``; buffers ``d2t``, ``t2d``): the reference the export
    checks against, and what `specrt distill --kind eagle3` trains. The embedding is the
    target's, frozen and not saved."""

    def __init__(
        self,
        config: LlamaConfig,
        embedding: torch.Tensor,
        layers: tuple[int, ...],
        head_vocab: int,
        target_hidden: int,
        norm_before_residual: bool = False,
    ) -> None:
        super().__init__()
        hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)
        self.config, self.layers = config, tuple(layers)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or hidden // self.heads)
        self.norm_before_residual = norm_before_residual
        self.register_buffer("embedding", embedding.detach().float(), persistent=False)
        self.fc = torch.nn.Linear(len(layers) * target_hidden, hidden, bias=False)
        self.midlayer = _Layer(config, self.heads * self.head_dim, self.kv_heads * self.head_dim)
        self.norm = LlamaRMSNorm(hidden, eps=eps)
        self.lm_head = torch.nn.Linear(hidden, head_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(head_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(int(config.vocab_size), dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(config)

    @classmethod
    def from_checkpoint(cls, head: HeadCheckpoint, embedding: torch.Tensor) -> Eagle3Head:
        w = head.weights
        own = w.get("embed_tokens.weight", embedding)
        target_hidden = w["fc.weight"].shape[1] // len(head.layers)
        module = cls(head.config, own, head.layers, w["lm_head.weight"].shape[0], target_hidden,
                     head.norm_before_residual)  # fmt: skip
        state = {k: v.float() if v.is_floating_point() else v for k, v in w.items()}
        state.pop("embed_tokens.weight", None)
        state.setdefault("t2d", module.t2d)
        module.load_state_dict(state)
        return module.eval()

    @torch.no_grad()
    def forward(self, features: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor):
        """``features [S, hidden]`` (after ``fc``), ``ids [S]``, ``positions [S]``: one causal
        pass, as the runtime's slots read them -> (logits over the head's vocabulary, hidden
        states), ``[S, ...]`` each."""
        [hidden] = self.chain(features[None], ids[None], 1, positions[None])
        return self.logits(hidden[0]), hidden[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the head's vocabulary of its hidden states ``[..., hidden]``."""
        return self.lm_head(self.norm(hidden))

    def chain(
        self,
        features: torch.Tensor,
        ids: torch.Tensor,
        steps: int,
        positions: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """The head's first ``steps`` chained drafts from every position at once (EAGLE-3's
        training-time test): step j at base p is slot p + j, reading token ``ids[p + j]`` and
        the head's own hidden state of step j - 1 at p (step 0: ``features[p]``), attending
        to the slots up to p (step 0's, which read the target's features) and to its own
        chain's slots p + 1 .. p + j, as drafting at a round whose last verified slot is p
        does. ``features [B, S, hidden]``, ``ids [B, S]`` (the token after each position);
        the hidden states ``[B, S, hidden]`` of each step (`logits` of them: its drafts), base
        p's row valid while p + j < S."""
        batch, length, _ = features.shape
        if positions is None:
            positions = torch.arange(length).expand(batch, length)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        keys, values, out = [], [], []
        x = features
        for step in range(steps):
            tokens = torch.nn.functional.pad(ids[:, step:], (0, step))
            q, k, v, normed = self.midlayer.qkv(self.embedding[tokens], x)
            cos, sin = self.rotary(x, positions + step)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            groups = self.heads // self.kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            keys.append(k)
            values.append(v)
            scale = 1 / math.sqrt(self.head_dim)
            first = (q @ keys[0].transpose(-1, -2)) * scale  # [B, h, S, S]: step 0's slots
            first = first.masked_fill(~causal, float("-inf"))
            own = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]]  # [B, h, S, 1]
            weights = torch.cat([first, *own], dim=-1).softmax(-1)
            attended = weights[..., :length] @ values[0]
            for i, vv in enumerate(values[1:]):
                attended = attended + weights[..., length + i, None] * vv
            attended = attended.transpose(1, 2).reshape(batch, length, -1)
            start = normed if self.norm_before_residual else x
            hidden = self.midlayer.rest(start, attended)
            out.append(hidden)
            x = hidden
        return out


class _Layer(torch.nn.Module):
    """EAGLE-3's ``midlayer``: attention over the normed embedding and features side by side."""

    def __init__(self, config: LlamaConfig, q_width: int, kv_width: int) -> None:
        super().__init__()
        hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)
        self.self_attn = torch.nn.Module()
        for name, width in (("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width)):
            setattr(self.self_attn, name, torch.nn.Linear(2 * hidden, width, bias=False))
        self.self_attn.o_proj = torch.nn.Linear(q_width, hidden, bias=False)
        self.mlp = LlamaMLP(config)
        for name in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
            setattr(self, name, LlamaRMSNorm(hidden, eps=eps))
        self.head_dim = q_width // int(config.num_attention_heads)

    def qkv(self, embedded: torch.Tensor, features: torch.Tensor):
        """q, k, v ``[B, heads, S, head_dim]`` and the normed features."""
        normed = self.hidden_norm(features)
        x = torch.cat([self.input_layernorm(embedded), normed], dim=-1)
        batch, length, _ = x.shape
        attn = self.self_attn
        q, k, v = (
            proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        return q, k, v, normed

    def rest(self, start: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention and the MLP: the head's hidden state."""
        residual = start + self.self_attn.o_proj(attended)
        return residual + self.mlp(self.post_attention_layernorm(residual))


def head_weights_numpy(head: HeadCheckpoint) -> dict[str, np.ndarray]:
    """The head's float weights as arrays (the graph builder's input)."""
    return {k: v.float().numpy() for k, v in head.weights.items() if v.is_floating_point()}


def head_features(head: HeadCheckpoint):
    """What the target's engine computes for ``head`` (`ort_graph.EagleFeatures`)."""
    from specrt.export.ort_graph import EagleFeatures

    return EagleFeatures(head.layers, head.weights["fc.weight"].float().numpy().T)
