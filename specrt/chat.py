"""Chat templates: the bundle tokenizer's Jinja template (as transformers renders it) turning
OpenAI-style messages into the model's prompt text, for `specrt serve`'s chat route and the
chat rows of `specrt batch`. Needs jinja2 (the serve extra)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from specrt import json_text
from specrt.errors import BundleError, InvalidInputError, RequestError

FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
# Variables a chat body's template kwargs may not set: the render's own.
RESERVED = {
    "messages": "the request's messages",
    "tools": "the request's tools",
    "bos_token": "the bundle's tokenizer",
    "eos_token": "the bundle's tokenizer",
    "add_generation_prompt": "its own field, add_generation_prompt",
    "continue_final_message": "its own field, continue_final_message",
    "raise_exception": "the renderer",
}


class ChatTemplateError(ValueError):
    """The template cannot render these messages (it raised, or is broken)."""


@dataclass(frozen=True)
class Rendering:
    """How a chat body asks its conversation rendered, as vLLM takes it: the assistant's turn
    opened after it (``add_generation_prompt``), or the last message left open to be continued
    (``continue_final_message``: a reply begun for the model); ``kwargs``: more variables for
    the template (``chat_template_kwargs``: Qwen3's ``enable_thinking``, for one)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict = field(default_factory=dict)


def read_rendering(body: dict) -> tuple[Rendering, dict]:
    """A chat body's `Rendering` and the body without its fields. Raises `RequestError`
    naming the field."""
    given = {key: body[key] for key in FIELDS if body.get(key) is not None}
    rest = {key: value for key, value in body.items() if key not in FIELDS}
    for key in FIELDS[:2]:
        if not isinstance(given.get(key, False), bool):
            raise RequestError(f"{key}={json.dumps(given[key])}: use true or false", key)
    kwargs = given.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        message = 'chat_template_kwargs must be an object of template variables ({"name": value})'
        raise RequestError(message, "chat_template_kwargs")
    taken = sorted(set(kwargs) & set(RESERVED))
    if taken:
        raise RequestError(
            f"chat_template_kwargs sets {taken[0]!r}, which is {RESERVED[taken[0]]}'s to set: "
            "leave it out",
            "chat_template_kwargs",
        )
    rendering = Rendering(
        given.get("add_generation_prompt", True), given.get("continue_final_message", False), kwargs
    )
    if rendering.add_generation_prompt and rendering.continue_final_message:
        raise RequestError(
            "continue_final_message and add_generation_prompt are both true: a continued "
            "message opens no new turn; send add_generation_prompt: false with it",
            "continue_final_message",
        )
    return rendering, rest


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        try:
            self._template = environment.from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"the bundle's chat template is broken: {exc}") from exc
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_directory(cls, directory: Path, given: str | None = None) -> ChatTemplate | None:
        """The template of a tokenizer directory (``chat_template.jinja``, or
        ``chat_template`` in ``tokenizer_config.json``), or None; ``given``: one in its place
        (``--chat-template``, as vLLM's: a Jinja file, or the template itself), with the
        directory's special tokens."""
        path = directory / "tokenizer_config.json"
        try:
            config = json_text.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            config = {}
        except (OSError, ValueError) as exc:
            raise BundleError(
                f"cannot read {path} ({exc}); fix it, or re-export the bundle"
            ) from exc
        if not isinstance(config, dict):
            raise BundleError(f"{path} is not a JSON object; fix it, or re-export the bundle")
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja = directory / "chat_template.jinja"
        if jinja.is_file():
            source = jinja.read_text()
        if given is not None:
            source = template_text(given)
        if not isinstance(source, str) or not source.strip():
            return None
        try:
            return cls(source, _token(config.get("bos_token")), _token(config.get("eos_token")))
        except ChatTemplateError as exc:
            if given is not None:
                raise InvalidInputError(f"--chat-template: {exc}; fix it") from exc
            where = jinja if jinja.is_file() else f"chat_template in {path}"
            raise BundleError(
                f"{exc} ({where}); fix it, or remove it to serve /v1/completions alone"
            ) from exc

    def prompt(
        self,
        messages: object,
        tools: list[dict] | None = None,
        rendering: Rendering | None = None,
    ) -> str:
        """OpenAI-style ``messages`` (each content a string or a list of text parts), checked,
        rendered as the prompt text (its special tokens written out); ``tools``: the
        functions a request offers, for a template that writes them (as transformers gives
        them: OpenAI's tool objects); ``rendering``: as the body asks (`read_rendering`)."""
        rendering = rendering or Rendering()
        messages = checked_messages(messages)
        text = self.render(messages, tools, rendering)
        return _continued(text, messages[-1]) if rendering.continue_final_message else text

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        rendering: Rendering | None = None,
    ) -> str:
        from jinja2.exceptions import TemplateError

        rendering = rendering or Rendering()
        try:
            return self._template.render(
                **rendering.kwargs,
                messages=messages,
                tools=tools,
                add_generation_prompt=rendering.add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:  # its own raise_exception: the message is the template's
            raise
        except TemplateError as exc:
            message = f"the chat template cannot render these messages: {exc}"
            raise ChatTemplateError(message) from exc
        except Exception as exc:  # a template is code: `{{ messages + 1 }}` raises TypeError
            name = type(exc).__name__
            message = f"the chat template cannot render these messages: {name}: {exc}"
            raise ChatTemplateError(message) from exc


def template_text(given: str) -> str:
    """``--chat-template``'s value as a template's text: a file's, or the value itself where it
    is Jinja (as vLLM reads its flag). Raises `InvalidInputError` for neither."""
    path = Path(given)
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # not a name a file can have (too long): the template itself
        is_file = False
    if is_file:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidInputError(f"--chat-template: cannot read {path} ({exc})") from exc
    if "{{" in given or "{%" in given:
        return given
    raise InvalidInputError(
        f"--chat-template {given!r}: no such file, nor a template (it has no {{{{ or {{%): give "
        "a Jinja file, or the template itself"
    )


def _continued(text: str, last: dict) -> str:
    """The rendered conversation cut right after the last message's text, so that the answer
    continues it (as transformers' ``continue_final_message``: the text as written, or stripped
    where the template strips it)."""
    content = last["content"]
    for written in (content, content.strip()):
        if written and written in text:
            return text[: text.rindex(written) + len(written)]
    raise ChatTemplateError(
        "continue_final_message: the last message's text is empty or not in what the chat "
        "template writes, so there is nothing to continue; give the text the answer goes on from"
    )


def _token(value: object) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def checked_messages(messages: object) -> list[dict]:
    """``messages`` with each content as text (a list of text parts joined by newlines, as
    vLLM does; an assistant's tool calls without content: empty text, which templates that
    do not write tool calls can render); anything else is a `ChatTemplateError` saying what
    a message must be."""
    if isinstance(messages, list):
        messages = [_with_text(m) if isinstance(m, dict) else m for m in messages]
    if not (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise ChatTemplateError(
            'messages must be a non-empty list of {"role": str, "content": str, or a list of '
            '{"type": "text", "text": str} parts}'
        )
    return messages


def _with_text(message: dict) -> dict:
    """A message with its content as text (an assistant's tool calls without any: "")."""
    if message.get("tool_calls") and message.get("content") is None:
        return {**message, "content": ""}
    return {**message, "content": _text_of(message["content"])} if "content" in message else message


def _text_of(content: object) -> object:
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatTemplateError(
                f"message content part of type {kind!r}: only text parts are supported"
            )
        if not isinstance(part.get("text"), str):
            return None  # reported as a malformed message
        texts.append(part["text"])
    return "\n".join(texts)
