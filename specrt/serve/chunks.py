"""What a streamed answer's chunks carry beside their text, as the body asked: the usage
(`openai_shapes.stream_usage`) and vLLM's ``return_token_ids`` (`specrt.openai_token_ids`);
an answer's usage and speculative report, and the event lines that carry chunks."""

from __future__ import annotations

import json

from specrt import openai_shapes as shapes
from specrt.openai_shapes import CHAT
from specrt.openai_shapes import usage as shapes_usage
from specrt.runtime.results import GenerationResult, GenerationStats


class StreamExtras:
    """The extras of one stream's chunks: ``usage_mode`` (None, "final": ``"usage": null`` in
    every chunk, "continuous": each chunk its choice's usage so far); ``token_ids``: a chat's
    first chunk carries the prompt's ids, a completion choice's first chunk its prompt's, and
    every chunk of a choice the ids that came since its chunk before."""

    def __init__(
        self, kind: str, usage_mode: str | None, token_ids: bool, prompts: list[list[int]]
    ) -> None:
        self.kind, self.usage_mode, self.token_ids, self.prompts = (
            kind,
            usage_mode,
            token_ids,
            prompts,
        )
        self.pending: list[list[int]] = [[] for _ in prompts]
        self.started: set[int] = set()
        self.given = [0] * len(prompts)  # each choice's new tokens come so far

    def came(self, index: int, ids: tuple[int, ...]) -> None:
        """Choice ``index``'s new tokens ``ids``."""
        self.pending[index] += ids
        self.given[index] += len(ids)

    def finished(self, index: int, ids: list[int]) -> None:
        """Choice ``index`` ended with the new tokens ``ids``: those no text piece brought (an
        ending token whose text is none) come with its last chunks."""
        self.came(index, tuple(ids[self.given[index] :]))

    def __call__(self, part: dict, index: int) -> dict:
        """``part``, a chunk of choice ``index``, with its extras (the ids waiting handed out)."""
        if self.usage_mode == "continuous":
            part["usage"] = shapes_usage(len(self.prompts[index]), self.given[index])
        elif self.usage_mode:
            part["usage"] = None
        if self.token_ids:
            choice = part["choices"][0]
            if not self.started and self.kind == CHAT:
                part["prompt_token_ids"] = list(self.prompts[0])
            if index not in self.started and self.kind != CHAT:
                choice["prompt_token_ids"] = list(self.prompts[index])
            self.started.add(index)
            choice["token_ids"], self.pending[index] = self.pending[index], []
        return part


def answer_usage(results: list[GenerationResult], n: int) -> dict:
    """One request's usage: each prompt once (as its first choice read it; ``n`` choices a
    prompt), the tokens of all its choices."""
    completion_tokens = sum(len(result.token_ids) for result in results)
    firsts = [result.stats for result in results[::n]]
    prompt_tokens = sum(stats.prompt_tokens for stats in firsts)
    return shapes_usage(prompt_tokens, completion_tokens, sum(s.cached_tokens for s in firsts))


def spec_stats(results: list[GenerationResult]) -> dict:
    return shapes.spec_stats(GenerationStats.total([r.stats for r in results]).to_dict())


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
