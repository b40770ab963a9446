"""`specrt distill --kind eagle3`: an EAGLE-3 head trained on the target's own answers.

The head reads the target's states at three of its layers (early, middle, late: the authors'
default), so each training step runs the target (no gradient) on the batch, then the head
drafts ``steps`` tokens from every position at once (`Eagle3Head.chain`: EAGLE-3's
training-time test, so the head learns from its own hidden states as it drafts). The loss is
the cross-entropy against the target's top-k probabilities of each token drafted, summed over
the chained steps (later steps weighted less, as the authors do).

The head's vocabulary is the tokens the target's answers use most (``head_vocab`` of them):
its output layer is most of its cost, and a token it never proposes costs nothing but a
draft that could not have been accepted. Its output layer starts as the target's rows for those
tokens, its final norm as the target's; the rest is random. The batch of step ``s`` and its
learning rate depend on ``s`` only, so a killed run resumed from its checkpoint goes on as the
uninterrupted run would have (`specrt.distill.train`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specrt.bundle import EAGLE3_ARCHITECTURE
from specrt.distill.data import Example, most_used
from specrt.distill.draft import decoder
from specrt.distill.train import TrainSettings, batch, checkpointed_steps, soft_cross_entropy
from specrt.distill.train import spans as train_spans

if TYPE_CHECKING:
    import torch

    from specrt.export.eagle import Eagle3Head

CHAIN_STEPS = 3  # drafted tokens each training position chains (the training-time test)
STEP_WEIGHT = 0.8  # the loss of chained step j counts STEP_WEIGHT ** j
DEFAULT_HEAD_VOCAB = 8192


def default_layers(target_layers: int) -> tuple[int, ...]:
    """Low, middle and high target layers (HF's ``hidden_states`` indices): the authors' 2, L/2
    and L-3, the high one at most L/10 below the top, so that a shallow target's is still high
    (6 layers: 5, where L-3 is the middle one)."""
    high = target_layers - min(3, max(1, round(target_layers / 10)))
    return tuple(sorted({min(2, high), target_layers // 2, high}))


def new_head(target: torch.nn.Module, examples: list[Example], head_vocab: int) -> Eagle3Head:
    """A head for ``target``: the most used ``head_vocab`` tokens of the answers (and of their
    top-k) its vocabulary, its output layer and final norm the target's, the rest random."""
    import torch
    from transformers import LlamaConfig

    from specrt.export.eagle import Eagle3Head

    config = target.config
    vocab = int(config.vocab_size)
    kept = most_used(examples, head_vocab, vocab)
    layers = default_layers(int(config.num_hidden_layers))
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    # GPT-2 names its sizes otherwise and has no grouped keys: a Llama layer of its sizes
    head_config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=_first(config, ("intermediate_size", "n_inner"), 4 * hidden),
        num_attention_heads=heads,
        num_key_value_heads=_first(config, ("num_key_value_heads",), heads),
        head_dim=_first(config, ("head_dim",), hidden // heads),
        num_hidden_layers=1,
        rms_norm_eps=_first(config, ("rms_norm_eps", "layer_norm_epsilon"), 1e-6),
        rope_theta=getattr(config, "rope_theta", 10000.0),
        rope_scaling=getattr(config, "rope_scaling", None),
        max_position_embeddings=config.max_position_embeddings,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    embedding = target.get_input_embeddings().weight.detach()
    head = Eagle3Head(head_config, embedding, layers, len(kept), int(config.hidden_size))
    with torch.no_grad():
        kept_t = torch.from_numpy(kept)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[kept_t])
        head.norm.weight.copy_(_final_norm_scale(target))
        head.d2t.copy_(kept_t - torch.arange(len(kept)))
        head.t2d.zero_()
        head.t2d[kept_t] = True
    return head


def _first(config, names: tuple[str, ...], default):
    """The first of ``names`` the config sets (not None), else ``default``."""
    values = (getattr(config, name, None) for name in names)
    return next((value for value in values if value is not None), default)


def _final_norm_scale(target: torch.nn.Module) -> torch.Tensor:
    """What the target's final norm multiplies a normalised state by: its weight, or one plus
    it where the family stores it so (Gemma); a layer norm's weight (GPT-2) without its bias."""
    import torch

    body = decoder(target)
    norm = getattr(body, "norm", None) or body.ln_f
    if isinstance(norm, torch.nn.LayerNorm):
        return norm.weight.detach()
    with torch.no_grad():  # an RMS norm of a state of ones is its scale, whatever its convention
        return norm(torch.ones(1, norm.weight.shape[0])).float()[0]


def head_loss(
    head: Eagle3Head,
    kept: list[np.ndarray],
    examples: list[Example],
    settings: TrainSettings,
    step: int,
):
    """Step ``step``'s loss: the head's chained drafts against the target's soft targets;
    ``kept``: the target's states of every example (`specrt.distill.features.states`)."""
    import torch

    from specrt.distill import features as target_features

    ids, _, (rows, cols), top_ids, top_probs = batch(examples, settings, step)
    spans = train_spans(examples, settings, step)
    features = head.fc(target_features.rows(examples, kept, spans, ids.shape[1]))
    # column c of the batch predicts the token at c + 1 (`batch`); the head at base p reads
    # token p + 1 and drafts token p + 2 (step 0), p + 3 (step 1) ...
    follows = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    index = torch.full((len(head.t2d),), -1, dtype=torch.long)
    index[head.t2d] = torch.arange(int(head.t2d.sum()))
    head_ids = index[top_ids]  # [answers, k]: -1 where the head has no such token
    probs = top_probs * (head_ids >= 0)
    total, weight = 0.0, 1.0
    for j, hidden in enumerate(head.chain(features, follows, CHAIN_STEPS)):
        base = cols - 1 - j  # the position whose step j drafts the answer token at cols + 1
        usable = (base >= 0) & (probs.sum(-1) > 0)
        # the output layer is most of the work: only where a draft is scored
        picked = head.logits(hidden[rows[usable], base[usable]])  # [n, head vocab]
        loss = soft_cross_entropy(picked, head_ids[usable].clamp(0), probs[usable])
        total = total + weight * loss
        weight *= STEP_WEIGHT
    return total


def chained(head: Eagle3Head, target, example: Example, steps: int) -> tuple[np.ndarray, list]:
    """The example's tokens (prompt, then answer) and the head's hidden states of ``steps``
    chained drafts from every position, reading the target's tokens (`Eagle3Head.chain`)."""
    import torch

    tokens = np.concatenate([example.prompt, example.tokens]).astype(np.int64)
    ids = torch.from_numpy(tokens)[None]
    features = head.fc(_states(target, ids, torch.ones_like(ids), head.layers))
    follows = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    return tokens, head.chain(features, follows, steps)


def _states(target, ids, mask, layers):
    import torch

    with torch.no_grad():
        states = target(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        return torch.cat([states.hidden_states[i].float() for i in layers], dim=-1)


def train_head(
    head: Eagle3Head,
    kept: list[np.ndarray],
    examples: list[Example],
    settings: TrainSettings,
    checkpoint: Path,
    progress: bool = True,
) -> list[float]:
    """Train ``head`` in place (every parameter: the embedding is a buffer), resumable;
    ``kept``: the target's states of every example."""
    return checkpointed_steps(
        head,
        dict(head.named_parameters()),
        lambda step: head_loss(head, kept, examples, settings, step),
        settings,
        checkpoint,
        progress,
    )


def report(head: Eagle3Head, target, examples: list[Example], k: int = 4) -> dict:
    """Greedy acceptance of the head's drafts on ``examples`` (the target's answers): of its
    first draft at every answer position, and of rounds of ``k`` replayed as a run makes them:
    a round whose last verified position is p drafts from p, and its chained drafts are the
    ones `Eagle3Head.chain` computes at p while every earlier draft of the round was right
    (teacher forcing is then exact)."""
    import torch

    reached, accepted = np.zeros(k), np.zeros(k)
    rounds = produced = matched = total = 0
    with torch.no_grad():
        for example in examples:
            tokens, chain = chained(head, target, example, k)
            best = [head.logits(hidden[0]).argmax(-1) for hidden in chain]
            drafts = [(b + head.d2t[b]).numpy() for b in best]
            # the first answer token comes from the prompt's pass; rounds start after it
            base, end = len(example.prompt) - 1, len(tokens) - 2
            hits = drafts[0][base:end] == tokens[base + 2 :]
            matched, total = matched + int(hits.sum()), total + len(hits)
            while base < end:
                run = 0
                for j in range(min(k, end - base)):
                    reached[j] += 1
                    if drafts[j][base] != tokens[base + j + 2]:
                        break
                    accepted[j] += 1
                    run += 1
                rounds += 1
                produced += min(run + 1, end - base)
                base += run + 1
    return {
        # as the draft model's report counts it: the first draft's match, at every position
        "acceptance_per_token": round(matched / max(1, total), 4),
        "acceptance_per_position": [
            round(float(a / r), 4) if r else None for a, r in zip(accepted, reached)
        ],
        "tokens_per_round": round(produced / max(1, rounds), 3),
        "num_draft_tokens": k,
        "answer_tokens": int(sum(len(example.tokens) for example in examples)),
        "prompts": len(examples),
    }


SAVED_DTYPE = "float16"  # as published heads are: half the bytes, the same drafts nearly


def round_to_saved(head: Eagle3Head) -> None:
    """Round the head's weights to what `save_head` writes."""
    import torch

    with torch.no_grad():
        for param in head.parameters():
            param.copy_(param.to(getattr(torch, SAVED_DTYPE)).float())


def save_head(head: Eagle3Head, out: Path, target_config) -> None:
    """``out``: the head in its authors' layout (config.json, model.safetensors; its weights
    in `SAVED_DTYPE`)."""
    import torch
    from safetensors.torch import save_file

    config = {
        **{k: v for k, v in head.config.to_dict().items() if not k.startswith("_")},
        "architectures": [EAGLE3_ARCHITECTURE],
        "torch_dtype": SAVED_DTYPE,
        "draft_vocab_size": int(head.lm_head.weight.shape[0]),
        "target_hidden_size": int(target_config.hidden_size),
        "eagle_aux_hidden_state_layer_ids": list(head.layers),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    half = getattr(torch, SAVED_DTYPE)
    state = {
        k: (v.to(half) if v.is_floating_point() else v).detach().contiguous()
        for k, v in head.state_dict().items()
    }
    save_file(state, str(out / "model.safetensors"))
