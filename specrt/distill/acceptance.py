"""How often the draft would be accepted: greedy rounds replayed on the target's answers.

Under greedy decoding a drafted token is accepted when it equals the target's next token. Fed
the target's answer (teacher forcing), the draft's choice at each position is the one it makes
in a real run whenever every earlier token of the round was accepted, so replaying rounds of
``k`` drafts over the answer gives the acceptance a run would see, position by position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from specrt.distill.data import Example

if TYPE_CHECKING:
    import torch


def matches(
    draft: torch.nn.Module, example: Example, proposed: np.ndarray | None = None
) -> np.ndarray:
    """(N,) bool: whether the draft's greedy choice equals answer token j, given the prompt and
    the answer before j; ``proposed``: the tokens it may choose (all: None)."""
    import torch

    tokens = np.concatenate([example.prompt, example.tokens]).astype(np.int64)
    with torch.no_grad():
        logits = draft(input_ids=torch.from_numpy(tokens)[None]).logits[0]
    start = len(example.prompt) - 1
    logits = logits[start : start + len(example.tokens)]
    if proposed is None:
        chosen = logits.argmax(-1).numpy()
    else:
        chosen = proposed[logits[:, torch.from_numpy(proposed)].argmax(-1).numpy()]
    return chosen == example.tokens


def report(
    draft: torch.nn.Module,
    examples: list[Example],
    k: int = 4,
    proposed: np.ndarray | None = None,
) -> dict:
    """Acceptance on ``examples``: per drafted token (every answer position), and per position
    of rounds of ``k`` drafts (position i: accepted / reached), with tokens per round;
    ``proposed``: the draft's reduced vocabulary, as its engine proposes."""
    reached, accepted = np.zeros(k), np.zeros(k)
    matched = total = rounds = produced = 0
    for example in examples:
        hits = matches(draft, example, proposed)
        matched += int(hits.sum())
        total += len(hits)
        start = 0
        while start < len(hits):
            run = 0
            for i in range(min(k, len(hits) - start)):
                reached[i] += 1
                if not hits[start + i]:
                    break
                accepted[i] += 1
                run += 1
            rounds += 1
            produced += min(run + 1, len(hits) - start)  # the accepted and the target's own
            start += run + 1
    return {
        "acceptance_per_token": round(matched / max(1, total), 4),
        "acceptance_per_position": [
            round(a / r, 4) if r else None for a, r in zip(accepted, reached)
        ],
        "tokens_per_round": round(produced / max(1, rounds), 3),
        "num_draft_tokens": k,
        "answer_tokens": total,
        "prompts": len(examples),
    }
