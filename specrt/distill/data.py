"""What the draft learns from: the target's own greedy answers to a prompt set.

Sequence-level distillation: the target answers each prompt (its chat template applied where
it has one, as `specrt generate --chat` and the server render a chat), and the draft learns to
predict those answers. Each answer token keeps the target's top-k next-token probabilities
too (soft targets: the draft learns the target's second choices, which carry most of what a
greedy answer leaves out). One ``.npz`` per prompt, named by the prompt's text and written
atomically, so a killed run keeps every answer it finished, the next run starts where it stopped,
and a prompt set grown by new prompts asks the target for those alone.
"""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specrt.checksums import VOCAB_FILE, vocab_fingerprint

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Example:
    """One prompt and the target's answer: ``tokens[j]`` is its j-th answer token, and
    ``top_ids[j]``/``top_probs[j]`` its top-k next-token distribution at that step."""

    prompt: np.ndarray  # (P,) int32
    tokens: np.ndarray  # (N,) int32
    top_ids: np.ndarray  # (N, k) int32
    top_probs: np.ndarray  # (N, k) float32


def most_used(examples: list[Example], size: int, vocab: int) -> np.ndarray:
    """The ``size`` tokens the answers use most (their own tokens first, then the target's
    other top-k choices), sorted: the vocabulary a draft or head proposes."""
    counts = np.zeros(vocab, dtype=np.int64)
    for example in examples:
        np.add.at(counts, example.tokens, 4)
        np.add.at(counts, example.top_ids.ravel(), 1)
    return np.sort(np.argsort(-counts, kind="stable")[: min(size, vocab)])


def prompt_ids(tokenizer, prompt: str, chat_template: bool = True) -> list[int]:
    """The prompt as the target reads it: through its chat template where it has one and
    ``chat_template`` (special tokens written by the template, none added), as plain text
    otherwise."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def answer(
    target: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    folder: Path,
    max_new_tokens: int,
    top_k: int,
    batch_size: int = 128,  # a decode step's products run faster on more rows (compute-bound)
    progress: bool = True,
    chat_template: bool = True,
    bf16: bool = False,
    exact: Path | None = None,
) -> list[Example]:
    """The target's greedy answers to ``prompts``, those not yet in ``folder`` generated (a batch
    at a time, prompts of near lengths together: see `_batches`) and written there; all of them
    returned in prompt order. ``bf16``: the target multiplies in bfloat16 (faster on a CPU with
    bfloat16 instructions: the answers are the longest part of a distillation), so the answers
    are those of the target rounded so: for training, not for measuring; an answer in ``exact``
    (the folder of float32 answers) is taken in place of one."""
    import torch
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    _remove_partials(folder)
    _mark_vocab(folder, vocab_fingerprint(tokenizer.get_vocab()))
    first: dict[str, int] = {}  # a prompt given twice is answered once
    for index, prompt in enumerate(prompts):
        first.setdefault(prompt, index)
    folders = [folder] + ([exact] if exact is not None and exact != folder else [])

    def found(prompt: str) -> Path | None:
        return next((p for f in folders if readable(p := _path(f, prompt), load)), None)

    todo = [index for prompt, index in first.items() if found(prompt) is None]
    ids = {index: prompt_ids(tokenizer, prompts[index], chat_template) for index in todo}
    pad = tokenizer.pad_token_id
    pad = pad if pad is not None else target.config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else (pad or 0)
    eos = target.config.eos_token_id
    eos = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    bar = tqdm(
        total=len(first),
        initial=len(first) - len(todo),
        unit="prompt",
        desc="target answers",
        disable=not progress,
    )
    bf16_products = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with torch.inference_mode(), bf16_products, _grouped_attention(target):
        position = _position_bytes(target)

        def row_bytes(length: int) -> int:
            return position * (length + max_new_tokens)

        for chunk in _batches(todo, ids, batch_size, row_bytes):
            new, top, probs = _greedy(
                target, [ids[i] for i in chunk], pad, eos, max_new_tokens, top_k
            )
            for row, index in enumerate(chunk):
                length = _answer_length(new[row].tolist(), eos, pad)
                _save(
                    _path(folder, prompts[index]),
                    Example(
                        np.asarray(ids[index], np.int32),
                        new[row, :length].numpy().astype(np.int32),
                        top[row, :length].numpy().astype(np.int32),
                        probs[row, :length].numpy().astype(np.float32),
                    ),
                )
            bar.update(len(chunk))
    bar.close()
    return [load(found(prompt)) for prompt in prompts]


CACHE_BUDGET = 2 << 30  # bytes of keys and values a batch may hold


def _position_bytes(target) -> int:
    """Bytes of float32 keys and values a position of one row holds in the target's cache."""
    config = target.config.get_text_config(decoder=True)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    width = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2 * int(config.num_hidden_layers) * kv_heads * width * 4


def _batches(
    todo: list[int], ids: dict[int, list[int]], size: int, row_bytes=lambda length: 0
) -> list[list[int]]:
    """Batches of at most ``size`` prompts in order of length, so that a batch pads little: its
    padded rows cost what unpadded ones do (`_grouped_attention`), and full batches of near
    lengths pay more than one length a batch did (docs/performance.md). A batch holds fewer
    where its rows' cache (``row_bytes`` of its longest prompt's length) would pass
    `CACHE_BUDGET`."""
    batches: list[list[int]] = []
    for index in sorted(todo, key=lambda index: len(ids[index])):
        last = batches[-1] if batches else []
        grown = len(last) + 1
        if last and grown <= size and grown * row_bytes(len(ids[index])) <= CACHE_BUDGET:
            last.append(index)
        else:
            batches.append([index])
    return batches


def _greedy(
    target, rows: list[list[int]], pad: int, eos: list[int], max_new_tokens: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy decoding of ``rows`` (left-padded where their lengths differ) with the target's
    own cache: (rows, steps) tokens, and each step's top-k token ids and probabilities. A loop
    of forward calls, not ``generate``: the same argmax, without its per-step work."""
    import inspect

    import torch

    width = max(map(len, rows))
    input_ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows])
    mask = positions = None
    if any(len(row) != width for row in rows):
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # a padded row starts at position 0
    # the prompt's last logits only, where the family can: a prompt's others are not needed
    last = (
        {"logits_to_keep": 1}
        if "logits_to_keep" in inspect.signature(target.forward).parameters
        else {}
    )
    out = target(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=_cache(target, width + max_new_tokens),
        use_cache=True,
        **last,
    )
    finished = torch.zeros(len(rows), dtype=torch.bool)
    stops = torch.tensor(eos, dtype=torch.long)  # none: every row runs max_new_tokens
    tokens, tops, probs = [], [], []
    for step in range(max_new_tokens):
        logits = out.logits[:, -1].float()
        p, top = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        token = torch.where(finished, pad, logits.argmax(dim=-1))  # a finished row pads
        tokens.append(token)
        tops.append(top)
        probs.append(p)
        finished |= torch.isin(token, stops)
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        if mask is not None:
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], dim=1)
            positions = positions[:, -1:] + 1
        out = target(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=positions,
            past_key_values=out.past_key_values,
            use_cache=True,
        )
    return torch.stack(tokens, 1), torch.stack(tops, 1), torch.stack(probs, 1)


GROUPED_SDPA = "specrt_grouped_sdpa"


@contextmanager
def _grouped_attention(target):
    """While answering, a target that attends with torch's SDPA hands it grouped keys and
    values as they are (``enable_gqa``), padding mask or not: HF's own attention repeats them
    for every query head where a batch is padded, a copy of every layer's cache at every step.
    torch repeats them as HF does, so the numbers are the same."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = target.config.get_text_config(decoder=True)
    if config._attn_implementation != "sdpa":  # eager (soft-capped Gemma 2) stays as it is
        yield
        return
    AttentionInterface.register(GROUPED_SDPA, _grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    config._attn_implementation = GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def _grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **_):
    import torch

    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    # no mask: a prompt's causal pass (several queries), or one query over the whole cache
    causal = attention_mask is None and query.shape[2] > 1
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _cache(target, capacity: int):
    """The target's cache for a batch of answers: each full-attention layer writes a step's
    keys and values in place into buffers of ``capacity`` positions and attends over a view of
    what is written, where HF's DynamicCache copies the whole cache at every step
    (docs/performance.md). Sliding-window layers, which keep a window, stay HF's own."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class InPlaceLayer(DynamicLayer):
        def update(self, key_states, value_states, cache_kwargs=None):
            if not self.is_initialized:
                self.lazy_initialization(key_states)
                self.written = 0
                shape = (*key_states.shape[:2], capacity)  # rows, heads, positions
                self.key_buffer = key_states.new_empty((*shape, key_states.shape[-1]))
                self.value_buffer = value_states.new_empty((*shape, value_states.shape[-1]))
            start, self.written = self.written, self.written + key_states.shape[-2]
            self.key_buffer[:, :, start : self.written] = key_states
            self.value_buffer[:, :, start : self.written] = value_states
            self.keys = self.key_buffer[:, :, : self.written]
            self.values = self.value_buffer[:, :, : self.written]
            return self.keys, self.values

    cache = DynamicCache(config=target.config)
    cache.layers = [InPlaceLayer() if type(x) is DynamicLayer else x for x in cache.layers]
    return cache


def _answer_length(tokens: list[int], eos, pad: int) -> int:
    """How many of a generated row's tokens are its answer: up to its first end-of-sequence
    token, that one included (what follows is padding)."""
    ends = set(eos if isinstance(eos, list) else [eos])
    for position, token in enumerate(tokens):
        if token in ends:
            return position + 1
    return len(tokens)


def _path(folder: Path, prompt: str) -> Path:
    return folder / f"{hashlib.sha256(prompt.encode()).hexdigest()[:20]}.npz"


def _save(path: Path, example: Example) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with open(partial, "wb") as handle:
        np.savez(handle, **example.__dict__)
    os.replace(partial, path)


def _mark_vocab(folder: Path, fingerprint: str) -> None:
    """Name whose token ids the folder holds, for `specrt corpus --answers-dir` to refuse
    another target's. A mark only: a folder it cannot be written to is used as it is."""
    mark = folder / VOCAB_FILE
    try:
        if mark.is_file() and mark.read_text().strip() == fingerprint:
            return
        partial = mark.with_suffix(".partial")
        partial.write_text(fingerprint + "\n")
        os.replace(partial, mark)
    except OSError:
        pass


def _remove_partials(folder: Path) -> None:
    """Remove the half-written files of killed runs (their writer's pid in the name)."""
    from specrt.staging import _alive

    for partial in folder.glob(".*.partial"):
        pid = partial.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not _alive(int(pid)):
            partial.unlink(missing_ok=True)


def readable(path: Path, read) -> bool:
    """Whether ``path``, a file of a run's state, is there and ``read`` reads it. One damaged
    (a crash before the disk had it, a full disk) is removed, to be made again: it is ours."""
    if not path.is_file():
        return False
    try:
        read(path)
        return True
    except Exception:  # numpy's and zipfile's many errors: whatever it is, it is made again
        path.unlink(missing_ok=True)
        return False


def load(path: Path) -> Example:
    with np.load(path) as data:
        return Example(**{name: data[name] for name in Example.__dataclass_fields__})
