"""`specrt corpus`: give a bundle a corpus of its target's text to draft from
(`specrt.runtime.corpus`)."""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from pathlib import Path

import click
import numpy as np

from specrt import json_text
from specrt.checksums import VOCAB_FILE
from specrt.cli.common import _chat_prompts, _friendly_errors
from specrt.errors import InvalidInputError
from specrt.jobs import openai_batch
from specrt.prompts import read_text


@click.command()
@click.option("--bundle", required=True, type=click.Path(path_type=Path), help="Bundle directory.")
@click.option(
    "--text-file",
    "text_files",
    multiple=True,
    type=click.Path(path_type=Path),
    help='Text the target wrote (repeatable): a .jsonl file holds {"prompt": ..., '
    '"completion": ...} or {"text": ...} objects, or is `specrt batch` output (its token ids '
    "are taken; of OpenAI batch output lines, the texts of their choices); any other file is "
    "one text.",
)
@click.option(
    "--answers-dir",
    "answer_dirs",
    multiple=True,
    type=click.Path(path_type=Path),
    help="The target's answers made by `specrt distill`: its state folder (--state-dir), or one "
    "of the answers-* folders in it (repeatable); their token ids as the target wrote them, "
    "the held-out prompts' left out.",
)
@click.option(
    "--chat",
    is_flag=True,
    help="Render each prompt of a .jsonl file as a user's message with the bundle's chat "
    "template, as `specrt serve` and `specrt generate --chat` send it.",
)
@_friendly_errors
def corpus(bundle: Path, text_files: tuple[Path, ...], answer_dirs: tuple[Path, ...], chat: bool):
    """Build the bundle's corpus: what its target wrote before, for prompt lookup and the
    hybrid to draft from where a row's own text has no match (REST's retrieval drafting).

    Answers the target gave to prompts like the ones it will be sent teach it most: a
    service's logged completions, or the answers `specrt distill` made. Replaces the corpus
    the bundle had; the output stays exactly the target's whatever the corpus holds."""
    from specrt.bundle import read_manifest
    from specrt.runtime.corpus import CORPUS_FILE, write_corpus
    from specrt.runtime.tokenizer import BundleTokenizer

    if not text_files and not answer_dirs:
        raise click.UsageError("give the text to learn: --text-file FILE or --answers-dir DIR")
    manifest = read_manifest(bundle)
    tokenizer = BundleTokenizer(bundle / manifest.tokenizer.path, manifest.tokenizer)

    render = _chat_renderer(bundle) if chat else None

    def documents() -> Iterator[list[int]]:
        for path in text_files:
            found = False
            for where, prompt, text in _texts(path):
                found |= bool(text)
                if isinstance(text, list):  # `specrt batch`'s token ids, as the target wrote
                    yield text
                    continue
                if not text:  # nothing written: nothing to learn (the tokenizer refuses "")
                    continue
                ids = []
                if prompt:
                    rendered = render(prompt, where) if render else prompt
                    ids = tokenizer.encode(rendered, add_special_tokens=render is None)
                yield ids + tokenizer.encode(text, add_special_tokens=not prompt)
            if not found:
                raise InvalidInputError(f"{path} holds no text: give the text the target wrote")
        for folder in dict.fromkeys(path.resolve() for path in answer_dirs):  # each once
            yield from _answers(folder, tokenizer.vocab_fingerprint)

    table = write_corpus(bundle, documents())
    click.echo(
        f"corpus of {table.documents} texts, {table.tokens} tokens, {len(table)} contexts: "
        f"{bundle / CORPUS_FILE}"
    )


def _chat_renderer(bundle: Path):
    """``render(prompt, where)``: a user's message through the bundle's chat template."""
    from specrt.chat import ChatTemplate, ChatTemplateError

    _chat_prompts(bundle, [])  # says in one line where there is no template (or no jinja2)
    template = ChatTemplate.from_directory(bundle / "tokenizer")

    def render(prompt: str, where: str) -> str:
        try:
            return template.prompt([{"role": "user", "content": prompt}])
        except ChatTemplateError as exc:
            raise InvalidInputError(f"{where}: {exc}") from exc

    return render


def _texts(path: Path) -> Iterator[tuple[str, str | None, str | list[int]]]:
    """(where, prompt or None, text or token ids) of each record of ``path``."""
    content = read_text(str(path), "text file")
    if path.suffix != ".jsonl":
        yield str(path), None, content
        return
    for number, line in enumerate(content.splitlines(), 1):
        where = f"{path}:{number}"
        if not line.strip():
            continue
        try:
            record = json_text.loads(line)
        except ValueError as exc:
            raise InvalidInputError(f"{where} is not JSON ({exc.msg})") from exc
        if not isinstance(record, dict):
            record = {}
        ids = record.get("token_ids")
        if isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids):
            yield where, None, ids
        elif openai_batch.is_record(record):  # `specrt batch`'s (or OpenAI's) batch output
            if not openai_batch.failed(record):
                yield from ((where, None, text) for text in _choice_texts(record))
        elif "error" in record and "id" in record:
            continue  # a `specrt batch` row that could not run: no text
        elif isinstance(record.get("text"), str):
            yield where, None, record["text"]
        elif isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
            yield where, record["prompt"], record["completion"]
        else:
            raise InvalidInputError(
                f'{where}: give {{"prompt": ..., "completion": ...}} or {{"text": ...}} '
                "(strings), or a line of `specrt batch`'s output"
            )


def _choice_texts(record: dict) -> list[str]:
    """The texts of an OpenAI batch output line's completion or chat completion."""
    body = record["response"].get("body")
    choices = body.get("choices") if isinstance(body, dict) else None
    texts = []
    for choice in choices if isinstance(choices, list) else []:
        choice = choice if isinstance(choice, dict) else {}
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        if isinstance(text, str):
            texts.append(text)
    return texts


def _answers(folder: Path, vocab: str) -> Iterator[list[int]]:
    """Each answer of a `specrt distill` answers folder: its prompt's and answer's token ids.
    ``vocab``: the bundle's `vocab_fingerprint`; answers marked with another are refused (their
    ids would be another tokenizer's tokens: a corpus that never matches)."""
    if not folder.is_dir():
        raise InvalidInputError(f"answers folder {folder} does not exist or is not a folder")
    if folder.resolve().name.startswith("heldout-"):
        raise InvalidInputError(
            f"{folder} holds the answers to the held-out prompts, which measure a draft and "
            "are never drafted from: give the state folder or one of its answers-* folders"
        )
    # a folder of answers, or a state folder holding such folders (never its held-out ones)
    files = sorted(folder.glob("*.npz")) or sorted(folder.glob("answers-*/*.npz"))
    if not files:
        raise InvalidInputError(
            f"{folder} holds no answers (.npz files): give a `specrt distill` state folder "
            "(--state-dir) or one of its answers-* folders"
        )
    for marked in dict.fromkeys(path.parent / VOCAB_FILE for path in files):
        if marked.is_file() and marked.read_text(errors="replace").strip() != vocab:
            raise InvalidInputError(
                f"{marked.parent} holds answers of another target (their tokens are not this "
                "bundle's tokenizer's): give the answers `specrt distill` made for the "
                "bundle's target"
            )
    for path in files:
        try:
            with np.load(path, allow_pickle=False) as data:
                yield data["prompt"].tolist() + data["tokens"].tolist()
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            raise InvalidInputError(f"{path} is not an answer of `specrt distill` ({exc})") from exc
