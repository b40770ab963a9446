"""Exported ONNX vs PyTorch on the same random tokens: a prefill, then a multi-token step on top
of the cached past (exactly what a verification pass does). Runs through the runtime's own
decoder (`specrt.backends`), so the check also covers how the runtime feeds the graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specrt.backends.base import one_call_against_one_each
from specrt.backends.select import make_decoder
from specrt.backends.session import create_session
from specrt.bundle import ModelSpec
from specrt.export.ort_builder import UNPROPOSED

CHECK_TOKENS = 12
LONGEST_CHECK = 520  # a sliding window up to 512 positions is checked past its edge


def max_logit_difference(
    model: torch.nn.Module,
    graph: Path,
    spec: ModelSpec,
    token_range: int,
    seed: int = 0,
    proposed: np.ndarray | None = None,
) -> dict[str, float]:
    """Return max |logit diff| for the prefill and for the multi-token step; ``proposed``: the
    tokens a draft with a reduced vocabulary proposes (its graph's logit is `UNPROPOSED` at
    the others, which the reference then has too)."""
    window = getattr(model.config, "sliding_window", None) or 0
    total = window + 8 if CHECK_TOKENS < window + 8 <= LONGEST_CHECK else CHECK_TOKENS
    total = min(total, spec.max_positions)
    prefill = max(1, total - 4)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, token_range, size=total).tolist()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
    reference = logits[:, : spec.vocab_size]  # an engine graph may leave padding rows out
    if proposed is not None:
        reference = np.full_like(reference, UNPROPOSED)
        reference[:, proposed] = logits[:, proposed]
    decoder = make_decoder(
        create_session(graph, providers=["CPUExecutionProvider"]), spec, spec.vocab_size, "check"
    )
    prefill_logits = decoder.forward(ids[:prefill]).logits.copy()  # valid until the next call
    step_logits, one_each_diff = one_call_against_one_each(decoder, ids[prefill:])
    prefill_diff = float(np.abs(prefill_logits - reference[:prefill]).max())
    step_diff = float(np.abs(step_logits - reference[prefill:]).max())
    return {
        "prefill_max_abs_logit_diff": prefill_diff,
        "step_max_abs_logit_diff": step_diff,
        # np.max keeps a NaN, builtin max may drop it
        "max_abs_logit_diff": float(np.max([prefill_diff, step_diff])),
        "step_tokens": total - prefill,
        # 0 where verifying several positions computes what decoding them one by one does
        "step_vs_one_at_a_time_max_abs_diff": one_each_diff,
    }
