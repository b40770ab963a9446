"""OpenAI API bodies (completions, chat completions, errors), shared by `specrt serve` and the
OpenAI output of `specrt batch`: one shape wherever a client reads them. No HTTP here."""

from __future__ import annotations

import time
import uuid

COMPLETION, CHAT = "completion", "chat"


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{uuid.uuid4().hex}"


def completion(
    ident: str,
    kind: str,
    model: str,
    text: str | None,
    finish_reason: str | None,
    final: bool = False,
) -> dict:
    """A completion (``final``: the whole answer) or one streamed chunk of ``kind``; ``text``
    None: the chat stream's opening chunk (the role alone)."""
    if kind == COMPLETION:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        name = "text_completion"
    elif final:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": finish_reason}
        name = "chat.completion"
    else:
        delta = {"role": "assistant"} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        name = "chat.completion.chunk"
    return {
        "id": ident,
        "object": name,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def spec_stats(stats: dict) -> dict:
    """The speculative report beside a completion (an extension), from
    `GenerationStats.to_dict()`."""
    return {
        "rounds": stats["rounds"],
        "draft_tokens": stats["drafted_tokens"],
        "accepted_tokens": stats["accepted_tokens"],
        "acceptance_rate": stats["acceptance_rate"],
        "accepted_per_position": stats["accepted_per_position"],
        "proposers": stats["proposers"],
    }


def error_body(message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
