"""The target's states a head reads, computed once for every answer and kept on disk.

Training a head runs over the same answers many times; running the target over each batch again
cost more than half of every step (measured in CHANGELOG.md). So the target reads every prompt
and answer once, in its full context, and the states of the head's layers are kept as float16
(what the head reads is float32 of them). Examples go in chunks fixed by their indices alone, one
file a chunk written atomically, so a killed run recomputes only the chunks it had not finished,
and with the same rows as an uninterrupted run would have: the states are the same to the bit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specrt.distill.data import Example, _remove_partials

if TYPE_CHECKING:
    import torch

CHUNK_TOKENS = 1024  # tokens of one chunk's forward pass (rows times the longest row)


def states(
    target: torch.nn.Module,
    examples: list[Example],
    layers: tuple[int, ...],
    folder: Path,
    progress: bool = True,
) -> list[np.ndarray]:
    """Each example's ``[prompt + answer tokens, len(layers) * hidden]`` float16 states: the
    residual stream entering each of ``layers`` (HF's ``hidden_states[i]``), side by side."""
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    _remove_partials(folder)
    chunks = _chunks(examples)
    todo = [c for c in range(len(chunks)) if not _path(folder, c).is_file()]
    bar = tqdm(
        total=len(chunks),
        initial=len(chunks) - len(todo),
        unit="chunk",
        desc="target states",
        disable=not progress,
    )
    for c in todo:
        _compute(target, examples, chunks[c], layers, _path(folder, c))
        bar.update(1)
    bar.close()
    found: dict[int, np.ndarray] = {}
    for c, chunk in enumerate(chunks):
        with np.load(_path(folder, c)) as data:
            found.update({index: data[str(index)] for index in chunk})
    return [found[i] for i in range(len(examples))]


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


def _chunks(examples: list[Example]) -> list[list[int]]:
    """Examples grouped by length (little padding), each group within `CHUNK_TOKENS`."""
    order = sorted(range(len(examples)), key=lambda i: (_length(examples[i]), i))
    chunks: list[list[int]] = []
    for index in order:
        if chunks and (len(chunks[-1]) + 1) * _length(examples[index]) <= CHUNK_TOKENS:
            chunks[-1].append(index)
        else:
            chunks.append([index])
    return chunks


def _length(example: Example) -> int:
    return len(example.prompt) + len(example.tokens)


def _compute(target, examples, chunk: list[int], layers, path: Path) -> None:
    import torch

    sequences = [np.concatenate([examples[i].prompt, examples[i].tokens]) for i in chunk]
    width = max(map(len, sequences))
    ids = torch.zeros((len(chunk), width), dtype=torch.long)
    mask = torch.zeros((len(chunk), width), dtype=torch.long)
    for row, tokens in enumerate(sequences):  # padded on the right: causal rows never see it
        ids[row, : len(tokens)] = torch.from_numpy(tokens.astype(np.int64))
        mask[row, : len(tokens)] = 1
    with torch.no_grad():
        # logits_to_keep=1: the output layer's full-vocabulary logits are not wanted here
        hidden = target(
            input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1
        ).hidden_states
        joined = torch.cat([hidden[i].float() for i in layers], dim=-1).numpy()
    # float16 holds SmolLM2's largest state (about 25000) with 3 digits; a model whose states
    # pass its range keeps float32
    kind = np.float16 if np.abs(joined).max() < np.finfo(np.float16).max / 2 else np.float32
    arrays = {str(i): joined[row, : len(seq)].astype(kind)
              for row, (i, seq) in enumerate(zip(chunk, sequences))}  # fmt: skip
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with open(partial, "wb") as handle:
        np.savez(handle, **arrays)
    os.replace(partial, path)


def _path(folder: Path, chunk: int) -> Path:
    return folder / f"chunk-{chunk:05d}.npz"
