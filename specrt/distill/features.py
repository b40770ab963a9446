"""The target's states a head reads, computed once for every answer and kept on disk.

Training a head runs over the same answers many times; running the target over each batch again
cost more than half of every step (measured in CHANGELOG.md). So the target reads every prompt
and answer once, in its full context, and the states of the head's layers are kept as float16
(what the head reads is float32 of them). One file an example, named by its tokens and written
atomically: a killed run computes only the examples it had not finished, a prompt set grown by
new prompts only the new ones, and each example is read in a pass of its own, so its states are
the same to the bit whichever examples come with it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specrt.distill.data import Example, _remove_partials, readable

if TYPE_CHECKING:
    import torch


def states(
    target: torch.nn.Module,
    examples: list[Example],
    layers: tuple[int, ...],
    folder: Path,
    progress: bool = True,
) -> list[np.ndarray]:
    """Each example's ``[prompt + answer tokens, len(layers) * hidden]`` float16 states: the
    residual stream entering each of ``layers`` (HF's ``hidden_states[i]``), side by side;
    ``folder``: where they are kept, for this target and these layers."""
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    _remove_partials(folder)
    paths = [_path(folder, example) for example in examples]
    todo = {
        path: example
        for path, example in zip(paths, examples)
        if not readable(path, lambda p: np.load(p, mmap_mode="r"))  # a header read, and its size
    }
    unique = len(set(paths))  # a prompt given twice is one answer
    bar = tqdm(
        total=unique,
        initial=unique - len(todo),
        unit="answer",
        desc="target states",
        disable=not progress,
    )
    for path, example in todo.items():
        _compute(target, example, layers, path)
        bar.update(1)
    bar.close()
    return [np.load(path) for path in paths]


def rows(
    examples: list[Example], kept: list[np.ndarray], spans: list[tuple[int, int, int]], width: int
) -> torch.Tensor:
    """The states of a batch's rows ``[rows, width, features]`` (float32, zeros past a row's
    end), ``spans`` as `specrt.distill.train.spans` gives them."""
    import torch

    out = torch.zeros((len(spans), width, kept[0].shape[-1]), dtype=torch.float32)
    for row, (pick, start, answered) in enumerate(spans):
        end = len(examples[pick].prompt) + answered
        out[row, : end - start] = torch.from_numpy(kept[pick][start:end].astype(np.float32))
    return out


def _compute(target, example: Example, layers, path: Path) -> None:
    import torch

    tokens = np.concatenate([example.prompt, example.tokens]).astype(np.int64)
    with torch.no_grad():
        # logits_to_keep=1: the output layer's full-vocabulary logits are not wanted here
        hidden = target(
            input_ids=torch.from_numpy(tokens)[None], output_hidden_states=True, logits_to_keep=1
        ).hidden_states
        joined = torch.cat([hidden[i][0].float() for i in layers], dim=-1).numpy()
    # float16 holds SmolLM2's largest state (about 25000) with 3 digits; a model whose states
    # pass its range keeps float32
    kind = np.float16 if np.abs(joined).max() < np.finfo(np.float16).max / 2 else np.float32
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with open(partial, "wb") as handle:
        np.save(handle, joined.astype(kind))
    os.replace(partial, path)


def _path(folder: Path, example: Example) -> Path:
    """An example's file: named by the tokens the target reads (its prompt and answer)."""
    key = hashlib.sha256(example.prompt.astype(np.int64).tobytes() + b"|")
    key.update(example.tokens.astype(np.int64).tobytes())
    return folder / f"{key.hexdigest()[:20]}.npy"
