"""Training the draft on the target's answers, resumable after a kill.

The loss is the cross-entropy of the draft's next-token distribution against the target's
top-k probabilities (renormalised), at every answer position, over the tokens the draft will
propose (its reduced vocabulary, as its engine's softmax is: see `Scorer`). Only the draft's
own weights (`draft.own_names`) train. The batch of step ``s`` is drawn by a generator seeded with
``(seed, s)`` and the learning rate is a function of ``s``: a run resumed from the checkpoint
of step ``s`` goes on exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specrt.distill.data import Example
from specrt.distill.draft import decoder, own_names
from specrt.errors import ExportError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 1500
    batch_size: int = 4
    seq_len: int = 192  # prompt and answer tokens of one example (the prompt's end kept)
    lr: float = 5e-4
    seed: int = 0
    save_every: int = 50  # steps between checkpoints
    # Matrix products in bfloat16 (weights, optimizer and loss in float32): more steps an hour
    # on a CPU that has bfloat16 instructions (`native_bf16`), fewer on one without.
    bf16: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX-512 BF16 or AMX)."""
    import torch

    return bool(
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def learning_rate(settings: TrainSettings, step: int) -> float:
    """Linear warm-up over the first 5% of the steps, then a cosine down to a tenth."""
    warmup = max(1, settings.steps // 20)
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    done = (step - warmup) / max(1, settings.steps - warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def spans(
    examples: list[Example], settings: TrainSettings, step: int
) -> list[tuple[int, int, int]]:
    """Step ``step``'s rows: (example, its first prompt token kept, answer tokens kept). A long
    prompt keeps its end; the row holds at most ``seq_len`` tokens."""
    rng = np.random.default_rng([settings.seed, step])
    picks = rng.choice(len(examples), size=min(settings.batch_size, len(examples)), replace=False)
    out = []
    for pick in picks:
        example = examples[pick]
        start = max(0, len(example.prompt) - settings.seq_len // 2)
        answered = min(len(example.tokens), settings.seq_len - (len(example.prompt) - start))
        out.append((int(pick), start, answered))
    return out


def batch(examples: list[Example], settings: TrainSettings, step: int):
    """Step ``step``'s batch: (input ids, attention mask, positions, top ids, top probs), the
    positions (row, column) being where the draft predicts an answer token."""
    import torch

    rows, rows_at, cols, top_ids, top_probs = [], [], [], [], []
    for row, (pick, start, answered) in enumerate(spans(examples, settings, step)):
        example = examples[pick]
        prompt = example.prompt[start:]
        rows.append(np.concatenate([prompt, example.tokens[:answered]]))
        # the logits at column c predict the token at c + 1: answer token j is read at P + j - 1
        rows_at += [row] * answered
        cols += range(len(prompt) - 1, len(prompt) - 1 + answered)
        top_ids.append(example.top_ids[:answered])
        top_probs.append(example.top_probs[:answered])
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, tokens in enumerate(rows):
        ids[row, : len(tokens)] = torch.from_numpy(tokens.astype(np.int64))
        mask[row, : len(tokens)] = 1
    probs = torch.from_numpy(np.concatenate(top_probs))
    return (
        ids,
        mask,
        (torch.tensor(rows_at), torch.tensor(cols)),
        torch.from_numpy(np.concatenate(top_ids).astype(np.int64)),
        probs / probs.sum(-1, keepdim=True),
    )


class Scorer:
    """The draft's log-probabilities at the answer positions, over the tokens it proposes.

    The output layer is most of a small draft's work (SmolLM2's 49152 rows against 4 layers):
    where the draft's logits are its output layer on its last hidden state, only the proposed
    rows are computed, and only at the answer positions. A family that scales or caps its
    logits (Gemma 2) is scored through its own forward over the whole vocabulary.
    """

    def __init__(self, draft: torch.nn.Module, proposed: np.ndarray | None, sample) -> None:
        import torch

        self.draft = draft
        self.body = decoder(draft)
        vocab = draft.get_output_embeddings().weight.shape[0]
        self.rows = None
        if proposed is not None and self._logits_are_head(sample):
            picked = torch.from_numpy(np.asarray(proposed, np.int64))
            head = draft.get_output_embeddings()
            self.rows = head.weight.detach()[picked]
            self.bias = None if head.bias is None else head.bias.detach()[picked]
            self.index = torch.full((vocab,), -1, dtype=torch.long)
            self.index[picked] = torch.arange(len(picked))

    def _logits_are_head(self, sample) -> bool:
        import torch

        config = self.draft.config
        # caps and scales small logits leave almost as they are: known by name, not by numbers
        if getattr(config, "final_logit_softcapping", None) or any(
            getattr(config, name, 1.0) not in (None, 1.0)
            for name in ("logit_scale", "logits_scaling")
        ):
            return False
        with torch.no_grad():
            logits = self.draft(input_ids=sample).logits
            hidden = self.body(input_ids=sample).last_hidden_state
            fast = self.draft.get_output_embeddings()(hidden)
        return bool(torch.allclose(fast, logits, rtol=1e-4, atol=1e-4))

    def loss(self, ids, mask, rows, cols, top_ids, top_probs):
        """Cross-entropy against the target's top tokens at (rows, cols); the tokens the draft
        cannot propose are left out of the target's share (renormalised over the rest)."""
        import torch

        if self.rows is None:
            logits = self.draft(input_ids=ids, attention_mask=mask).logits[rows, cols]
            return soft_cross_entropy(logits, top_ids, top_probs)
        picked = self.index[top_ids]  # (answers, k): -1 where the draft has no such token
        probs = top_probs * (picked >= 0)
        usable = probs.sum(-1) > 0
        hidden = self.body(input_ids=ids, attention_mask=mask).last_hidden_state
        hidden = hidden[rows[usable], cols[usable]]  # (usable answers, hidden)
        if not len(hidden):  # nothing the draft proposes: a step that changes nothing
            return hidden.sum() * 0.0
        logits = torch.nn.functional.linear(hidden, self.rows, self.bias)
        return soft_cross_entropy(logits, picked[usable].clamp(0), probs[usable])


def soft_cross_entropy(logits, ids, probs):
    """Cross-entropy of ``logits``' distribution against ``probs`` (renormalised) on the tokens
    at ``ids``: the loss drafts and heads train on. ``logits``: (n, tokens); ``ids``, ``probs``:
    (n, k)."""
    import torch

    log_q = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids)
    return -(probs / probs.sum(-1, keepdim=True) * log_q).sum(-1).mean()


def loss_of(scorer: Scorer, examples: list[Example], settings, step: int):
    ids, mask, (rows, cols), top_ids, top_probs = batch(examples, settings, step)
    return scorer.loss(ids, mask, rows, cols, top_ids, top_probs)


def train(
    draft: torch.nn.Module,
    examples: list[Example],
    settings: TrainSettings,
    checkpoint: Path,
    progress: bool = True,
    proposed: np.ndarray | None = None,
) -> list[float]:
    """Train ``draft``'s own weights in place for ``settings.steps`` steps (see
    `checkpointed_steps`); ``proposed``: the tokens its engine proposes (all: None); the loss
    of every step."""
    import torch

    params = dict(draft.named_parameters())
    own = own_names(draft)
    sample = torch.from_numpy(examples[0].prompt[:16].astype(np.int64))[None]
    scorer = Scorer(draft, proposed, sample)
    for name, param in params.items():
        param.requires_grad_(name in own)
    trained = {name: params[name] for name in own}
    step_loss = lambda step: loss_of(scorer, examples, settings, step)  # noqa: E731
    losses = checkpointed_steps(draft, trained, step_loss, settings, checkpoint, progress)
    for param in params.values():
        param.requires_grad_(False)
    return losses


def checkpointed_steps(
    model: torch.nn.Module,
    trained: dict[str, torch.nn.Parameter],
    step_loss: Callable[[int], torch.Tensor],
    settings: TrainSettings,
    checkpoint: Path,
    progress: bool = True,
) -> list[float]:
    """AdamW on ``trained`` for ``settings.steps`` steps of ``step_loss(step)``, from
    ``checkpoint`` where a killed run left one (saved every ``save_every`` steps,
    atomically), with a progress bar; the loss of every step."""
    import torch
    from tqdm import tqdm

    for param in trained.values():
        param.requires_grad_(True)
    optimizer = torch.optim.AdamW(list(trained.values()), lr=settings.lr, weight_decay=0.0)
    step, losses = 0, []
    state = _load_checkpoint(checkpoint) if checkpoint.is_file() else None
    if state is not None:
        with torch.no_grad():
            for name, tensor in state["weights"].items():
                trained[name].copy_(tensor)
        optimizer.load_state_dict(state["optimizer"])
        step, losses = state["step"], list(state["losses"])
    model.train()
    bar = tqdm(
        total=settings.steps, initial=step, unit="step", desc="training", disable=not progress
    )
    while step < settings.steps:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(settings, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
            loss = step_loss(step)
        if not torch.isfinite(loss):
            _diverged(settings, step + 1, f"the loss is {float(loss.detach())}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(trained.values()), 1.0)
        optimizer.step()
        step += 1
        losses.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
        if step % settings.save_every == 0 or step == settings.steps:
            # a checkpoint to go on from holds finite weights; so does what is written after
            if not all(bool(torch.isfinite(p).all()) for p in trained.values()):
                _diverged(settings, step, "its weights are no longer finite")
            _save(checkpoint, trained, optimizer, step, losses)
    bar.close()
    model.eval()
    for param in trained.values():
        param.requires_grad_(False)
    return losses


def _load_checkpoint(path: Path) -> dict | None:
    """The state a killed run saved; None where it cannot be read (a crash before the disk had
    it): training starts over, which loses only what is lost already."""
    import torch

    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # torch's and pickle's many errors: a damaged file
        why = type(exc).__name__
        print(f"{path} cannot be read ({why}): training starts over", file=sys.stderr)
        path.unlink(missing_ok=True)
        return None


def _diverged(settings: TrainSettings, step: int, what: str) -> None:
    """Training that blew up is stopped, and nothing is written from it: a draft of NaN
    weights exported only to fail there, and replaced a good one under --force."""
    raise ExportError(
        f"training diverged at step {step} ({what}): lower --lr (it is {settings.lr:g}) and "
        "run again; the target's answers are kept"
    )


def _save(path: Path, trained: dict, optimizer, step: int, losses: list[float]) -> None:
    import torch

    state = {
        "step": step,
        "losses": losses,
        "weights": {name: param.detach().clone() for name, param in trained.items()},
        "optimizer": optimizer.state_dict(),
    }
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    torch.save(state, partial)
    os.replace(partial, path)
