"""vLLM's tokenizer routes on a real `specrt serve`: ``POST /tokenize`` gives the very ids the
chat and completion routes read (a client counts its prompt with them), ``POST /detokenize``
their text back, ``GET /version``; a body they cannot take is one 400 naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from specrt.runtime import SpeculativeGenerator
from tests.test_chat_rendering import ASK, BEGUN, CONTINUE, NO_THINKING
from tests.test_chat_rendering import TEMPLATE as CHAT_TEMPLATE
from tests.test_serve import running_server

# The rendering test's template, with the tools written out where a request offers them.
TEMPLATE = "{% if tools %}<tools>{{ tools | tojson }}\n{% endif %}" + CHAT_TEMPLATE
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def server(llama_bundle):
    with running_server(llama_bundle, "--chat-template", TEMPLATE) as (url, _):
        yield url


@pytest.fixture(scope="module")
def generator(llama_bundle):
    return SpeculativeGenerator.from_bundle(llama_bundle, threads=1)


@pytest.fixture(scope="module")
def tokenizer(generator):
    return generator.tokenizer


def tokenize(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/tokenize", json=body)


def test_a_prompt_is_tokenized_as_the_completion_route_reads_it(server, tokenizer):
    text = "def add(x, y):\n    return"
    got = tokenize(server, {"model": "tiny", "prompt": text, "return_token_strs": True}).json()
    ids = tokenizer.encode(text)
    assert got["tokens"] == ids and got["count"] == len(ids)
    assert got["token_strs"] == tokenizer.token_strings(ids) and None not in got["token_strs"]
    [model] = httpx.get(f"{server}/v1/models").json()["data"]
    assert got["max_model_len"] == model["max_model_len"] > 0
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(model="tiny", prompt=text, max_tokens=2)
    assert reply.usage.prompt_tokens == got["count"]
    assert tokenize(server, {"prompt": text}).json()["token_strs"] is None
    back = httpx.post(f"{server}/detokenize", json={"model": "tiny", "tokens": ids})
    assert back.status_code == 200
    assert back.json() == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    assert text in back.json()["prompt"]  # (after the BOS the tokenizer adds, if it does)


@pytest.mark.parametrize(
    "messages, fields",
    [(ASK, {}), (ASK, NO_THINKING), (BEGUN, CONTINUE), (ASK, {"tools": TOOLS})],
    ids=["plain", "template kwargs", "continued", "tools"],
)
def test_messages_are_tokenized_as_the_chat_route_renders_them(server, messages, fields):
    """The count is the chat route's own prompt_tokens for the same body: rendered with the
    server's template, its kwargs, a continued message and the tools it writes out."""
    got = tokenize(server, {"messages": messages, **fields})
    assert got.status_code == 200, got.text
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    extra = {**fields, "tool_choice": "none"} if "tools" in fields else fields
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=1, extra_body=extra
    )
    assert reply.usage.prompt_tokens == got.json()["count"]
    text = httpx.post(f"{server}/detokenize", json={"tokens": got.json()["tokens"]}).json()
    assert ("<tools" in text["prompt"]) == ("tools" in fields)  # (the tiny vocabulary lacks ">")


@pytest.mark.parametrize(
    "route, body, field, words",
    [
        ("tokenize", {"prompt": "x", "messages": ASK}, "prompt", "one of them"),
        ("tokenize", {}, "prompt", "one of them"),
        ("tokenize", {"prompt": "x", **NO_THINKING}, "chat_template_kwargs", "a chat field"),
        ("tokenize", {"prompt": "x", "chat_template": "{{ x }}"}, "chat_template",
         "--chat-template"),
        ("tokenize", {"prompt": "x", "return_token_strs": "yes"}, "return_token_strs",
         "true or false"),
        ("tokenize", {"messages": ASK, "continue_final_message": True},
         "continue_final_message", "add_generation_prompt: false"),
        ("tokenize", {"messages": ASK, "tools": [{"name": "add"}]}, "tools", "list of functions"),
        ("tokenize", {"prompt": "x", "temperature": 0}, "temperature", "unknown field"),
        ("detokenize", {"tokens": [1, True]}, "tokens", "token ids"),
        ("detokenize", {"tokens": "1 2"}, "tokens", "token ids"),
        ("detokenize", {"tokens": [10**6]}, "tokens", "not in the tokenizer's vocabulary"),
    ],
)  # fmt: skip
def test_bodies_the_routes_cannot_take_are_refused_naming_the_field(
    server, route, body, field, words
):
    answer = httpx.post(f"{server}/{route}", json=body)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == field, error
    assert words in error["message"]


def test_an_empty_prompt_counts_the_special_tokens_alone(server, tokenizer):
    """As vLLM counts it: no text, no tokens but those the tokenizer adds (a BOS)."""
    bare = tokenize(server, {"prompt": "", "add_special_tokens": False})
    assert bare.status_code == 200 and bare.json()["count"] == 0 and bare.json()["tokens"] == []
    added = tokenize(server, {"prompt": ""}).json()["tokens"]
    assert added == tokenizer.encode("x")[: len(added)] and "x" not in tokenizer.decode(added)


def test_another_model_is_a_404_and_the_version_is_the_packages(server):
    from specrt import __version__

    answer = tokenize(server, {"model": "other", "prompt": "x"})
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "model"
    assert httpx.get(f"{server}/version").json() == {"version": __version__}


def streamed_ids(url: str, route: str, body: dict) -> tuple[list[int] | None, list[list[int]]]:
    """A stream's prompt ids (the first chunk's: a chat's at the top, a completion's in its
    choice) and each choice's ids, joined over its chunks."""
    raw = httpx.post(f"{url}/v1/{route}", json={**body, "stream": True}, timeout=60)
    events = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: {")]
    first = events[0].get("prompt_token_ids", events[0]["choices"][0].get("prompt_token_ids"))
    ids: list[list[int]] = [[] for _ in range(1 + max(e["choices"][0]["index"] for e in events))]
    for event in events:
        ids[event["choices"][0]["index"]] += event["choices"][0]["token_ids"]
    return first, ids


def test_return_token_ids_gives_the_prompts_and_the_answers_tokens(server, generator):
    """vLLM's ``return_token_ids``: a chat's prompt ids at the top (a stream's first chunk), a
    completion's in each choice; each choice its new tokens, streamed chunk by chunk, the same
    whole (the ending EOS too, whose text is none); the tokens `/tokenize` and the usage count."""
    tokenizer = generator.tokenizer
    text, asked = "def add(x, y):", {"return_token_ids": True, "max_tokens": 8, "ignore_eos": True}
    reply = httpx.post(f"{server}/v1/completions", json={"prompt": text, "n": 2, **asked}).json()
    for choice in reply["choices"]:
        assert choice["prompt_token_ids"] == tokenizer.encode(text)
        assert len(choice["token_ids"]) == 8
    assert sum(len(c["token_ids"]) for c in reply["choices"]) == reply["usage"]["completion_tokens"]
    first, ids = streamed_ids(server, "completions", {"prompt": text, "n": 2, **asked})
    assert first == tokenizer.encode(text) and ids == [c["token_ids"] for c in reply["choices"]]
    assert tokenizer.decode(ids[0]) == reply["choices"][0]["text"]
    body = {"messages": ASK, **asked}
    reply = httpx.post(f"{server}/v1/chat/completions", json=body).json()
    assert reply["prompt_token_ids"] == tokenize(server, {"messages": ASK}).json()["tokens"]
    assert len(reply["choices"][0]["token_ids"]) == reply["usage"]["completion_tokens"] == 8
    assert streamed_ids(server, "chat/completions", body) == (
        reply["prompt_token_ids"],
        [reply["choices"][0]["token_ids"]],
    )
    eos = min(generator.eos_token_ids)
    ended = {"prompt": text, "return_token_ids": True, "logit_bias": {str(eos): 100}}
    reply = httpx.post(f"{server}/v1/completions", json=ended).json()
    assert reply["choices"][0]["token_ids"] == [eos] and reply["choices"][0]["text"] == ""
    assert streamed_ids(server, "completions", ended)[1] == [[eos]]
    refused = httpx.post(f"{server}/v1/completions", json={"prompt": text, "return_token_ids": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_token_ids"


def test_return_tokens_as_token_ids_names_the_logprobs_tokens_by_id(server):
    """vLLM's ``return_tokens_as_token_ids``: every token of the log-probabilities, chosen or
    alternative, is "token_id:N" (N the id ``return_token_ids`` gives), whole or streamed; the
    values and text offsets are the text's."""
    text = "def add(x, y):"
    asked = {"prompt": text, "max_tokens": 6, "logprobs": 2, "temperature": 0, "ignore_eos": True}
    named = {**asked, "return_tokens_as_token_ids": True, "return_token_ids": True}
    plain = httpx.post(f"{server}/v1/completions", json=asked).json()["choices"][0]
    [choice] = httpx.post(f"{server}/v1/completions", json=named).json()["choices"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert choice["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    assert choice["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    for top in choice["logprobs"]["top_logprobs"]:
        assert len(top) == 2 and all(name.startswith("token_id:") for name in top)
    flags = {"return_tokens_as_token_ids": True, "return_token_ids": True, "stream": True}
    chat = {"messages": ASK, "max_tokens": 6, "logprobs": True, "top_logprobs": 2, **flags}
    raw = httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=60)
    events = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: {")]
    ids, names = [], []
    for event in events:
        ids += event["choices"][0]["token_ids"]
        for entry in (event["choices"][0].get("logprobs") or {}).get("content") or []:
            names.append(entry["token"])
            assert all(alt["token"].startswith("token_id:") for alt in entry["top_logprobs"])
    assert names == [f"token_id:{t}" for t in ids] and len(ids) == 6
    wrong = {**asked, "return_tokens_as_token_ids": 1}
    refused = httpx.post(f"{server}/v1/completions", json=wrong)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "return_tokens_as_token_ids"
