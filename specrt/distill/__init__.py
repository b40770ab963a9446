"""`specrt distill`: a draft for a target that has none, made from the target itself.

    1. read the target (a Hugging Face folder or a GGUF file) and cut the draft from it;
    2. have the target answer the training prompts (and the held-out ones), kept on disk;
    3. train the draft's own weights on those answers;
    4. write the draft as a checkpoint `specrt export` takes, its own weights beside it, and a
       report of its acceptance on the held-out prompts before and after training.

Everything a killed run did is kept in ``.OUT.distill/`` beside the output (the answers, one
file per prompt, and the training checkpoint) and the next run with the same settings goes on
from there. Needs the export extra (torch, transformers).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specrt.distill.train import TrainSettings
from specrt.errors import ExportError
from specrt.export.destination import check_destination
from specrt.export.options import DEFAULT_TARGET_BLOCK_SIZE, check_block_size, target_tag

REPORT = "distill_report.json"


@dataclass(frozen=True)
class DistillSettings:
    layers: int = 2
    max_new_tokens: int = 128
    top_k: int = 16  # soft targets kept per answer token
    num_draft_tokens: int = 4  # the rounds the acceptance report replays
    train: TrainSettings = field(default_factory=TrainSettings)
    kind: str = "draft"  # or "eagle3": an EAGLE-3 head (`specrt.distill.eagle`)
    vocab: int = 8192  # the tokens a draft or head proposes: the answers' most used
    # The prompts go through the target's chat template where it has one; False: as plain text,
    # as completions send them (drafts learn the text they will see).
    chat_template: bool = True
    # A head for a quantised target engine learns from that engine's weights
    # (`specrt.distill.quantized`): its precision and block size, as `specrt export` takes them.
    target_precision: str = "float32"
    target_block_size: int = DEFAULT_TARGET_BLOCK_SIZE

    def __post_init__(self) -> None:  # before the target is read: its mistakes are the user's
        if self.target_precision != "float32" and self.kind != "eagle3":
            raise ExportError(
                "--target-precision trains an EAGLE-3 head for a quantised target: use it with "
                "--kind eagle3 (a draft model learns from the float32 target)"
            )
        check_block_size(self.target_precision, self.target_block_size)


def state_dir(out: Path) -> Path:
    """Where a run keeps what it has done: beside the output, named after it."""
    return out.parent / f".{out.name}.distill"


def distill(
    target_source: Path,
    out: Path,
    prompts: list[str],
    heldout: list[str],
    settings: DistillSettings,
    init_from: Path | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
    progress: bool = True,
    state: Path | None = None,
) -> dict:
    """Make the draft at ``out``; return the report written beside it. ``state``: where the
    answers and the training checkpoint are kept (default `state_dir`; the draft and the head
    of one target can share the target's answers)."""
    import torch

    from specrt.distill import acceptance, data, train
    from specrt.distill import draft as drafts
    from specrt.export.draft_vocab import write_draft_vocab
    from specrt.staging import staging

    started = time.monotonic()
    trained_on = set(prompts) if settings.train.steps else set()
    if any(prompt in trained_on for prompt in heldout):  # a measure of text it never saw
        seen = sum(prompt in trained_on for prompt in heldout)
        heldout = [prompt for prompt in heldout if prompt not in trained_on]
        log(f"note: {seen} held-out prompt(s) are also training prompts: left out of the measure")
    sources = [target_source, *([init_from] if init_from is not None else [])]
    if state is not None and Path(os.path.abspath(state)).is_relative_to(os.path.abspath(out)):
        raise ExportError(
            f"--state-dir {state} is or is inside --out {out}, which the draft replaces: keep "
            "the answers elsewhere (the default is beside --out)"
        )
    check_destination(out, [*sources, *([state] if state is not None else [])], force, *MARK)
    torch.manual_seed(settings.train.seed)

    # 1. The target, and the draft cut from it (its own weights from --init-from if given).
    target, tokenizer, identity = _load_target(target_source, out, log)
    _check_fits(target.config, settings)  # before a state folder is made for it
    room = getattr(target.config, "max_position_embeddings", None)
    if room:  # a prompt and its answer past the target's positions teach nothing it does
        prompts = _fitting(prompts, "training", tokenizer, room, settings, log)
        heldout = _fitting(heldout, "held-out", tokenizer, room, settings, log)
    if settings.target_precision != "float32":
        from specrt.distill.quantized import quantize_like_engine

        quantize_like_engine(target, settings.target_precision, settings.target_block_size)
        # the answers and states are this engine's: kept apart from the float32 target's
        identity["precision"] = target_tag(settings.target_precision, settings.target_block_size)
        log(
            f"target: its {settings.target_precision} engine's weights (blocks of "
            f"{settings.target_block_size}), as `specrt export --target-precision` makes them"
        )
    state = state or state_dir(out)
    eagle3 = settings.kind == "eagle3"
    if eagle3:
        if not settings.train.steps or init_from is not None:
            raise ExportError("--kind eagle3 trains a new head: give --steps > 0, no --init-from")
        log(f"draft: an EAGLE-3 head for the target; progress kept in {state}")
    else:
        draft = drafts.truncated(target, settings.layers)
        if init_from is not None:
            drafts.load_own(draft, init_from)
        log(
            f"draft: the target's first {settings.layers} of {target.config.num_hidden_layers} "
            f"layers; progress kept in {state}"
        )
    state.mkdir(parents=True, exist_ok=True)  # once the settings are known to be sound

    # 2. The target's answers to the training and held-out prompts.
    def answers(name: str, texts: list[str], bf16: bool) -> list[data.Example]:
        # a file per prompt in a folder of these settings: a grown prompt set reuses them
        kept = (identity, settings.max_new_tokens, settings.top_k, *_plain(settings))
        exact = state / f"{name}-{_key(*kept)}"
        return data.answer(
            target,
            tokenizer,
            texts,
            state / f"{name}-{_key(*kept, 'bfloat16')}" if bf16 else exact,
            settings.max_new_tokens,
            settings.top_k,
            progress=progress,
            chat_template=settings.chat_template,
            bf16=bf16,
            exact=exact,
        )

    # what the draft learns from may be the target's in bfloat16; what it is measured on is not
    examples = answers("answers", prompts, settings.train.bf16) if settings.train.steps else []
    held = answers("heldout", heldout, False) if heldout else []

    # 3. Training, from the checkpoint a killed run left.
    k = settings.num_draft_tokens
    if eagle3:
        return _distill_head(target, identity, examples, held, settings, out, log, prompts,
                             started, progress, state)  # fmt: skip
    # the tokens its engine will propose (`specrt.export.draft_vocab`): the answers' most used
    vocab = int(target.config.vocab_size)
    proposed = data.most_used(examples, settings.vocab, vocab) if examples else None
    proposed = None if proposed is None or len(proposed) >= vocab else proposed
    before = acceptance.report(draft, held, k, proposed) if held else None
    losses: list[float] = []
    checkpoint = None
    if settings.train.steps:
        init_key = _file_key(init_from) if init_from else ""
        train_key = _key(
            identity, prompts, settings.layers, init_key, settings.max_new_tokens,
            settings.top_k, settings.train.as_dict(), *_plain(settings),
            None if proposed is None else ("scored over", len(proposed)),
        )  # fmt: skip
        checkpoint = state / f"train-{train_key}.pt"
        losses = train.train(draft, examples, settings.train, checkpoint, progress, proposed)
    drafts.round_own(draft)
    after = acceptance.report(draft, held, k, proposed) if held else None

    # 4. The checkpoint, its own weights and the report, put in place at once.
    own = {"layers": settings.layers, "init_from": str(init_from) if init_from else None,
           "draft_vocab": None if proposed is None else len(proposed)}  # fmt: skip
    report = _report(identity, own, settings, prompts, heldout, losses, before, after, started)
    with staging(out, "partial") as staged:
        draft.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        drafts.save_own(
            draft,
            staged / drafts.OWN_WEIGHTS,
            {"layers": settings.layers, "target": identity["name"]},
        )
        if proposed is not None:
            write_draft_vocab(staged, proposed)
        (staged / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        _publish(staged, out, log)
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)  # done: the draft is written
    log(f"the target's answers stay in {state} for another run; remove it when done")
    return report


def _distill_head(target, identity, examples, held, settings, out, log, prompts, started,
                  progress, state) -> dict:  # fmt: skip
    """Steps 3 and 4 for an EAGLE-3 head (`specrt.distill.eagle`)."""
    from specrt.distill import eagle, features
    from specrt.staging import staging

    head = eagle.new_head(target, examples, settings.vocab)
    # a file per answer, in a folder of this target and these layers: a grown set reuses them
    states_key = _key(identity, head.layers, "per answer")
    kept = features.states(target, examples, head.layers, state / f"states-{states_key}", progress)
    k = settings.num_draft_tokens
    before = eagle.report(head, target, held, k) if held else None
    key = _key(identity, prompts, "eagle3", settings.vocab, settings.max_new_tokens,
               settings.top_k, settings.train.as_dict(), head.layers,
               *_plain(settings))  # fmt: skip
    checkpoint = state / f"train-{key}.pt"
    losses = eagle.train_head(head, kept, examples, settings.train, checkpoint, progress)
    eagle.round_to_saved(head)  # the report is of the head as written
    after = eagle.report(head, target, held, k) if held else None
    own = {
        "kind": "eagle3",
        "head_vocab": int(head.lm_head.weight.shape[0]),
        "layers_read": list(head.layers),
        "target_precision": identity.get("precision", "float32"),
    }
    report = _report(identity, own, settings, prompts, held, losses, before, after, started)
    with staging(out, "partial") as staged:
        eagle.save_head(head, staged, target.config)
        (staged / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        _publish(staged, out, log)
    checkpoint.unlink(missing_ok=True)  # done: the head is written
    log(f"the target's answers and states stay in {state} for another run; remove it when done")
    return report


def _check_fits(config, settings: DistillSettings) -> None:
    """The settings against the target: a mistake found later left its state folder."""
    from specrt.distill import draft as drafts

    vocab = int(config.vocab_size)
    if settings.top_k > vocab:
        raise ExportError(
            f"--top-k {settings.top_k} is more than the target's vocabulary ({vocab} tokens): "
            f"give {vocab} or fewer"
        )
    if settings.kind != "eagle3":
        drafts.check_layers(config, settings.layers)


def _fitting(prompts: list[str], what: str, tokenizer, room: int, settings, log) -> list[str]:
    """The ``prompts`` that leave room in the target's ``room`` positions for their answers."""
    from specrt.distill.data import prompt_ids

    limit = room - settings.max_new_tokens
    kept = [p for p in prompts if len(prompt_ids(tokenizer, p, settings.chat_template)) <= limit]
    if len(kept) < len(prompts):
        log(
            f"note: {len(prompts) - len(kept)} {what} prompt(s) and their answers of up to "
            f"{settings.max_new_tokens} tokens pass the target's {room} positions: left out"
        )
    if prompts and not kept:
        raise ExportError(
            f"no {what} prompt leaves room for an answer of --max-new-tokens "
            f"{settings.max_new_tokens} in the target's {room} positions: shorten them, or "
            "lower --max-new-tokens"
        )
    return kept


def _ours(folder: Path) -> bool:
    """Whether ``folder`` is a draft or head this command wrote (its report marks it)."""
    return (folder / REPORT).is_file()


MARK = (_ours, ("a draft or head", REPORT))  # what --out may replace (`check_destination`)


def _publish(staged: Path, out: Path, log: Callable[[str], None]) -> None:
    """Put the ``staged`` draft at ``out``, carrying into it the files a user put in the one
    it replaces (notes, a licence): what this command writes is replaced, nothing else."""
    from specrt.staging import keep_others, publish, through_links

    old = through_links(out)
    if _ours(old):
        try:
            kept = keep_others(old, staged, lambda rel: (staged / rel).exists())
        except FileExistsError as exc:
            raise ExportError(
                f"{old / exc.filename} was not written by specrt distill and the new draft "
                f"writes a file there: move it out of {out} and run again (its answers and "
                "training are kept)"
            ) from exc
        if kept:
            log(f"kept {len(kept)} file(s) in {out} that specrt did not write")
    publish(staged, out)


def _report(identity, own: dict, settings, prompts, heldout, losses, before, after, started):
    """What `distill_report.json` says of a draft or a head (``own``: what is its alone)."""
    return {
        "target": identity["name"],
        **own,
        "settings": {
            "max_new_tokens": settings.max_new_tokens,
            "top_k": settings.top_k,
            "chat_template": settings.chat_template,
            **settings.train.as_dict(),
        },
        "train_prompts": len(prompts),
        "heldout_prompts": len(heldout),
        "loss_first_steps": _mean(losses[:20]),
        "loss_last_steps": _mean(losses[-20:]),
        "heldout_before": before,
        "heldout_after": after,
        "seconds": round(time.monotonic() - started, 1),
    }


def _load_target(source: Path, out: Path, log: Callable[[str], None]):
    """(model, tokenizer, identity) of the target at ``source``: a Hugging Face folder, or a
    GGUF file read into a staging folder that is removed once the model is in memory."""
    from transformers import AutoTokenizer

    from specrt.export.checkpoints import load_causal_lm, load_config
    from specrt.export.gguf_checkpoints import as_folders, gguf_file

    if not source.exists():
        raise ExportError(
            f"--target {source} does not exist: pass a Hugging Face checkpoint "
            "folder or a GGUF file"
        )
    found = gguf_file(source, "target")
    ggufs = {"target": found} if found else {}
    with as_folders({"target": source}, ggufs, out, log) as folders:
        folder = folders["target"]
        if not (folder / "config.json").is_file():
            raise ExportError(
                f"--target {source} is not a Hugging Face checkpoint folder (no "
                "config.json) or a GGUF file"
            )
        config = load_config(folder, "target")  # a model export takes, or one line why not
        model = load_causal_lm(folder, config)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer, {"name": source.name, "files": _file_key(found or source)}


def _file_key(path: Path) -> str:
    """What identifies a checkpoint cheaply: its files' names, sizes and modification times."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return _key([(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files])


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def _plain(settings: DistillSettings) -> tuple[str, ...]:
    """What the keys of answers and checkpoints add for plain prompts (none for the default, so
    that answers kept by earlier versions are found again)."""
    return () if settings.chat_template else ("plain prompts",)


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]
