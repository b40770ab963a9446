"""Train the demo draft/target pair shipped in models/demo/, with nothing downloaded.

Corpus: every .py file of the running interpreter's standard library, split into train and
held-out files by a hash of the file's relative path (about 2% held out). Tokenizer: byte-level
BPE trained with `tokenizers`. Target: a 6-layer Llama. Draft: a 1-layer Llama sharing the
tokenizer, trained on the corpus and then distilled from the target (0.8 KL + 0.2 CE).

    python models/train_demo.py --out models/demo          # the shipped pair (see MODEL_CARD.md)
    python models/train_demo.py --smoke --out /tmp/demo    # seconds: tiny sizes, a few steps

Stage 2 (part of the shipped pair since 2026-12-01): ``--long-steps N --redistill-steps M``
(1500 and 600 by default) go on training the target on 768-token windows, 3 in 4 of them a
text followed by a copy of its beginning, then distil the draft again from it on plain text;
``--continue-from DIR`` runs stage 2 alone on a pair from stage 1 (MODEL_CARD.md has the copy
accuracy it reached, CHANGELOG.md on 2026-11-30 and 2026-12-01 the speed it brought).

Seeded; step counts are fixed, so a rerun on the same Python does the same work.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sysconfig
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
HELDOUT_EVERY = 50  # a file is held out when hash(path) % 50 == 0


@dataclass
class Plan:
    vocab: int
    seq: int
    files: int | None  # None = every file
    target: dict
    draft: dict
    target_steps: int
    target_batch: int
    target_lr: float
    draft_steps: int
    distill_steps: int
    draft_batch: int
    draft_lr: float
    eval_windows: int
    compile: bool
    # Stage 2 (CHANGELOG.md, 2026-11-30 and 2026-12-01): the target on long windows, most of
    # them a text followed by a copy of its beginning (stage 1's 256-token windows taught no
    # position past 256, and a target that follows a copy is what prompt lookup needs), then
    # the draft distilled again from it on long windows.
    long_seq: int
    long_steps: int
    long_batch: int
    long_lr: float
    redistill_steps: int
    copy_fraction: float = 0.75
    # The draft learns the target on plain text only: copies are prompt lookup's to propose,
    # and a 1-layer draft chasing them agreed less with the target elsewhere (0.558 vs 0.577).
    redistill_copy_fraction: float = 0.0
    long_bf16: bool = True  # bf16 autocast: 0.93 s a step with AMX, float32 1.5 s


FULL = Plan(
    vocab=4096,
    seq=256,
    files=None,
    target=dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    draft=dict(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
    target_steps=4900,
    target_batch=16,
    target_lr=1.5e-3,
    draft_steps=1300,
    distill_steps=1000,
    draft_batch=32,
    draft_lr=3e-3,
    eval_windows=400,
    compile=True,
    long_seq=768,
    long_steps=1500,
    long_batch=8,
    long_lr=1e-3,
    redistill_steps=600,
)
SMOKE = Plan(
    vocab=300,
    seq=32,
    files=40,
    target=dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
    draft=dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
    ),
    target_steps=6,
    target_batch=4,
    target_lr=1e-3,
    draft_steps=4,
    distill_steps=3,
    draft_batch=4,
    draft_lr=1e-3,
    eval_windows=8,
    compile=False,
    long_seq=64,
    long_steps=3,
    long_batch=2,
    long_lr=1e-4,
    redistill_steps=2,
)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------------------------
def corpus(limit: int | None) -> tuple[list[str], list[str]]:
    """(train texts, held-out texts) from the standard library's .py files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    if limit:
        paths = paths[:limit]
    train, heldout = [], []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        held = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0
        (heldout if held else train).append(text)
    if limit and not heldout:  # smoke runs: make sure something is held out
        heldout.append(train.pop())
    return train, heldout


def heldout_prompts(count: int = 64, context_lines: int = 8) -> list[dict]:
    """Prompts cut from held-out files: a function's ``def`` line and the lines before it, so the
    model is asked to write a body it never saw. Two per file, in file order; then, where the
    files run out (63 on Python 3.11's), a third per file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    held: list[tuple[str, list[str], list[int]]] = []
    for path in sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts):
        rel = path.relative_to(root).as_posix()
        if int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELDOUT_EVERY:
            continue
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        defs = [i for i, line in enumerate(lines) if re.match(r"\s*def \w+\(.*\):\s*$", line)]
        held.append((rel, lines, defs))
    prompts: list[dict] = []
    for first, last in ((1, 3), (3, 4)):  # skip the first def: there the file's header dominates
        for rel, lines, defs in held:
            for i in defs[first:last]:
                prompt = "".join(lines[max(0, i - context_lines) : i + 1])[-600:]
                prompts.append({"file": rel, "line": i + 1, "prompt": prompt})
                if len(prompts) == count:
                    return prompts
    return prompts


def train_tokenizer(texts: list[str], vocab: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS)


def encode(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(np.asarray(ids, dtype=np.int64))


# ---------------------------------------------------------------------------------------------
def lr_at(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 50)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def windows(
    data: torch.Tensor, batch: int, seq: int, generator: torch.Generator, copy_fraction: float
) -> torch.Tensor:
    """``[batch, seq + 1]`` random windows of the corpus; ``copy_fraction`` of them repeat
    their first L tokens (L from seq/8 to seq/2) right after them, as a file continued after
    a copy of its beginning or an edited block does, and go on with the text after them."""
    offsets = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
    if not copy_fraction:  # stage 1 (its random draws as they always were)
        return torch.stack([data[o : o + seq + 1] for o in offsets])
    copies = torch.rand(batch, generator=generator) < copy_fraction
    lengths = torch.randint(seq // 8, seq // 2 + 1, (batch,), generator=generator)
    rows = []
    for offset, copy, length in zip(offsets.tolist(), copies.tolist(), lengths.tolist()):
        window = data[offset : offset + seq + 1]
        if copy:
            head = window[:length]
            window = torch.cat([head, head, window[length:]])[: seq + 1]
        rows.append(window)
    return torch.stack(rows)


def train(
    model: LlamaForCausalLM,
    data: torch.Tensor,
    steps: int,
    batch: int,
    seq: int,
    lr: float,
    generator: torch.Generator,
    compile_model: bool,
    teacher: LlamaForCausalLM | None = None,
    name: str = "",
    copy_fraction: float = 0.0,
    bf16: bool = True,
) -> None:
    """AdamW, warmup + cosine, bf16 autocast (``bf16``). With a teacher: 0.8 KL(teacher||model)
    + 0.2 CE."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    forward = torch.compile(model) if compile_model else model
    teach = (torch.compile(teacher) if compile_model else teacher) if teacher else None
    start, seen = time.time(), 0
    for step in range(steps):
        window = windows(data, batch, seq, generator, copy_fraction)
        inputs, labels = window[:, :-1], window[:, 1:]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = forward(input_ids=inputs).logits.float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            if teach is not None:
                with torch.no_grad():
                    target_logits = teach(input_ids=inputs).logits.float()
                kl = F.kl_div(
                    F.log_softmax(logits, -1).reshape(-1, logits.shape[-1]),
                    F.log_softmax(target_logits, -1).reshape(-1, logits.shape[-1]),
                    log_target=True,
                    reduction="batchmean",
                )
                loss = 0.8 * kl + 0.2 * loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        seen += inputs.numel()
        if step % 20 == 0 or step == steps - 1:
            rate = seen / max(time.time() - start, 1e-9)
            log(f"{name} step {step + 1}/{steps} loss {loss.item():.3f} {rate:,.0f} tokens/s")
    model.eval()


@torch.no_grad()
def evaluate(
    target: LlamaForCausalLM, draft: LlamaForCausalLM, data: torch.Tensor, seq: int, windows: int
) -> dict[str, float]:
    """Held-out cross-entropy of each (fp32) and greedy top-1 agreement, teacher-forced."""
    count = min(windows, (len(data) - 1) // seq)
    ce = {"target": 0.0, "draft": 0.0}
    agree = 0
    for i in range(count):
        window = data[i * seq : i * seq + seq + 1][None]
        inputs, labels = window[:, :-1], window[:, 1:]
        argmax = {}
        for name, model in (("target", target), ("draft", draft)):
            logits = model(input_ids=inputs).logits
            ce[name] += F.cross_entropy(logits[0], labels[0]).item()
            argmax[name] = logits[0].argmax(-1)
        agree += (argmax["target"] == argmax["draft"]).float().mean().item()
    return {
        "target_heldout_ce": ce["target"] / count,
        "draft_heldout_ce": ce["draft"] / count,
        "greedy_agreement": agree / count,
        "heldout_tokens": count * seq,
    }


@torch.no_grad()
def copy_accuracy(model: LlamaForCausalLM, data: torch.Tensor, seq: int, windows: int) -> float:
    """How often the model's argmax is the next token of a repeated block: held-out text of
    seq/2 tokens, then the same again (the first token of the copy is not predictable)."""
    half, hits, total = seq // 2, 0, 0
    for i in range(min(windows, (len(data) - 1) // half)):
        head = data[i * half : (i + 1) * half]
        predicted = model(input_ids=torch.cat([head, head])[None]).logits[0].argmax(-1)
        hits += (predicted[half : 2 * half - 1] == head[1:]).sum().item()
        total += half - 1
    return hits / total


def build(config: dict, vocab: int, eos: int, seq: int) -> LlamaForCausalLM:
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            max_position_embeddings=1024,
            bos_token_id=eos,
            eos_token_id=eos,
            tie_word_embeddings=False,
            **config,
        )
    )


def stage_one(
    plan: Plan,
    train_ids: torch.Tensor,
    vocab: int,
    eos: int,
    generator: torch.Generator,
    times: dict,
) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """The target on 256-token windows; the draft on them, then distilled from the target."""
    target = build(plan.target, vocab, eos, plan.seq)
    t = time.time()
    train(
        target,
        train_ids,
        plan.target_steps,
        plan.target_batch,
        plan.seq,
        plan.target_lr,
        generator,
        plan.compile,
        name="target",
    )
    times["target_train_s"] = time.time() - t

    draft = build(plan.draft, vocab, eos, plan.seq)
    t = time.time()
    train(
        draft,
        train_ids,
        plan.draft_steps,
        plan.draft_batch,
        plan.seq,
        plan.draft_lr,
        generator,
        plan.compile,
        name="draft",
    )
    train(
        draft,
        train_ids,
        plan.distill_steps,
        plan.draft_batch,
        plan.seq,
        plan.draft_lr / 3,
        generator,
        plan.compile,
        teacher=target,
        name="distill",
    )
    times["draft_train_s"] = time.time() - t
    return target, draft


def stage_two(
    plan: Plan,
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM,
    train_ids: torch.Tensor,
    seed: int,
    times: dict,
) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """The target on long windows with copies; the draft distilled again from it."""
    # Each part of stage 2 draws from its own stream: the same whether stage 1 (or the target's
    # part, --long-steps 0) ran in this process or not. No torch.compile: loaded models gained
    # nothing from it. On a CPU without bf16 instructions (AMD EPYC, 2026-11-30) bf16 autocast
    # ran 16x slower than float32: pass --long-fp32 there.
    generator = torch.Generator().manual_seed(seed + 1)
    t = time.time()
    train(
        target,
        train_ids,
        plan.long_steps,
        plan.long_batch,
        plan.long_seq,
        plan.long_lr,
        generator,
        False,
        name="target (long, copies)",
        copy_fraction=plan.copy_fraction,
        bf16=plan.long_bf16,
    )
    train(
        draft,
        train_ids,
        plan.redistill_steps,
        plan.long_batch,
        plan.long_seq,
        plan.draft_lr / 3,
        torch.Generator().manual_seed(seed + 2),
        False,
        teacher=target,
        name="draft (distilled again)",
        copy_fraction=plan.redistill_copy_fraction,
        bf16=plan.long_bf16,
    )
    times["stage2_s"] = time.time() - t
    return target, draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prompts-only", action="store_true", help="write held-out prompts only")
    parser.add_argument(
        "--continue-from",
        type=Path,
        default=None,
        help="a pair trained by stage 1 (its tokenizer, target and draft): run stage 2 on it",
    )
    names = ("target_steps", "draft_steps", "distill_steps", "files", "long_steps")
    names += ("redistill_steps",)
    for name in names:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    for name in ("long_lr", "copy_fraction"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=None)
    parser.add_argument("--long-fp32", action="store_true", help="stage 2 in float32")
    args = parser.parse_args()
    plan = SMOKE if args.smoke else FULL
    names += ("long_lr", "copy_fraction")
    overrides = {n: getattr(args, n) for n in names}
    if args.long_fp32:
        overrides["long_bf16"] = False
    plan = replace(plan, **{n: v for n, v in overrides.items() if v is not None})
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "heldout_prompts.jsonl", "w") as handle:
        for item in heldout_prompts():
            handle.write(json.dumps(item) + "\n")
    if args.prompts_only:
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    t0 = time.time()

    train_texts, heldout_texts = corpus(plan.files)
    log(f"corpus: {len(train_texts)} train files, {len(heldout_texts)} held-out files")
    if args.continue_from:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.continue_from / "tokenizer")
    else:
        tokenizer = train_tokenizer(train_texts, plan.vocab)
    train_ids, heldout_ids = encode(tokenizer, train_texts), encode(tokenizer, heldout_texts)
    elapsed = time.time() - t0
    log(f"tokens: {len(train_ids):,} train, {len(heldout_ids):,} held out ({elapsed:.0f}s)")
    eos = tokenizer.convert_tokens_to_ids(EOS)
    vocab = len(tokenizer)

    times = {}
    if args.continue_from:
        target = LlamaForCausalLM.from_pretrained(args.continue_from / "target")
        draft = LlamaForCausalLM.from_pretrained(args.continue_from / "draft")
        stage1 = json.loads((args.continue_from / "training_report.json").read_text())
        times.update({key: stage1[key] for key in ("target_train_s", "draft_train_s")})
    else:
        target, draft = stage_one(plan, train_ids, vocab, eos, generator, times)
    if plan.long_steps or plan.redistill_steps:
        target, draft = stage_two(plan, target, draft, train_ids, args.seed, times)

    metrics = evaluate(target, draft, heldout_ids, plan.seq, plan.eval_windows)
    metrics["target_copy_accuracy"] = copy_accuracy(target, heldout_ids, plan.long_seq, 16)
    times["total_s"] = time.time() - t0
    report = {
        **metrics,
        **times,
        "train_tokens": len(train_ids),
        "train_files": len(train_texts),
        "heldout_files": len(heldout_texts),
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "draft_parameters": sum(p.numel() for p in draft.parameters()),
        "python": sysconfig.get_python_version(),
        "torch": torch.__version__,
        "seed": args.seed,
        "smoke": args.smoke,
    }
    for role, model in (("target", target), ("draft", draft)):
        model.save_pretrained(args.out / role)
        tokenizer.save_pretrained(args.out / role)
    tokenizer.save_pretrained(args.out / "tokenizer")
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
