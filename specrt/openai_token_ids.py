"""vLLM's ``return_token_ids``: an answer's token ids beside its text, which clients that train
or score on exact tokens (reinforcement-learning harnesses) read rather than tokenizing the
text again, since text does not always tokenize back to the tokens it came from. Shared by
`specrt serve` and `specrt batch`'s OpenAI lines."""

from __future__ import annotations

import json

from specrt.errors import RequestError
from specrt.openai_shapes import CHAT

FIELD = "return_token_ids"


def token_ids_asked(body: dict) -> tuple[bool, dict]:
    """Whether the body asks for the token ids, and the body without the field. Raises
    `RequestError` naming it."""
    asked = body.get(FIELD)
    if asked is not None and not isinstance(asked, bool):
        raise RequestError(f"{FIELD}={json.dumps(asked)}: use true or false", FIELD)
    return bool(asked), {key: value for key, value in body.items() if key != FIELD}


def with_token_ids(body: dict, kind: str, prompts: list[list[int]], outputs: list[list[int]]):
    """A whole answer's ids, as vLLM's: a chat's prompt ids once (one prompt), a completion's in
    each choice (one prompt a choice); each choice its own new tokens."""
    if kind == CHAT:
        body["prompt_token_ids"] = list(prompts[0])
    for i, choice in enumerate(body["choices"]):
        if kind != CHAT:
            choice["prompt_token_ids"] = list(prompts[i])
        choice["token_ids"] = list(outputs[i])
