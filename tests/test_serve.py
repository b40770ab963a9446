"""`specrt serve`: a real server process on 127.0.0.1, driven by the official openai client and
raw HTTP; it ends with SIGTERM and must exit 0."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from specrt.runtime import GenerationConfig, SpeculativeGenerator
from specrt.runtime.prefixes import MIN_SHARED_PREFIX
from tests.conftest import in_threads
from tests.test_greedy import PROMPTS

openai = pytest.importorskip("openai", reason="the dev extra's openai client is not installed")
pytest.importorskip("starlette", reason="the serve extra is not installed")

REPO = Path(__file__).resolve().parents[1]
K = 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(bundle: Path, *extra: str, log: Path | None = None):
    """A real `specrt serve` process; on exit, SIGTERM, and it must exit 0. ``log``: the file
    its output (stdout and stderr) goes to, for the test to read."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "specrt.cli", "serve", "--bundle", str(bundle),
        "--port", str(port), "--threads", "1", "--batch-size", "4", "--max-waiting", "64",
        "--num-draft-tokens", str(K), "--model-name", "tiny", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if log is None:
        process = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    else:
        with log.open("w") as out:
            process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def output() -> str:
        return process.stderr.read() if log is None else log.read_text()

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    else:
        process.kill()
        pytest.fail(f"the server did not come up: {output()}")
    try:
        yield url, process
    except BaseException:  # a failed test: its server must not outlive it
        process.kill()
        process.wait(timeout=60)
        raise
    process.send_signal(signal.SIGTERM)  # graceful shutdown: exit 0
    assert process.wait(timeout=60) == 0, output()


def logged(log: Path, words: str, timeout: float = 10) -> str:
    """The first line of a server's output holding ``words``, waited for: a reply may reach
    its client before its request's last line is written."""
    deadline = time.monotonic() + timeout
    while True:
        found = [line for line in log.read_text().splitlines() if words in line]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no line with {words!r} in {log.read_text()}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server_log(tmp_path_factory) -> Path:
    """The output (stdout and stderr) of the module's server."""
    return tmp_path_factory.mktemp("server") / "output.log"


@pytest.fixture(scope="module")
def server(llama_bundle, server_log):
    with running_server(llama_bundle, log=server_log) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(llama_bundle):
    """What `specrt generate` gives, greedy: the server must answer the same."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=K)
    return generator, {p: r for p, r in zip(PROMPTS, generator.generate(PROMPTS, config))}


def test_completions_streamed_or_not_equal_generate(server, client, reference):
    generator, expected = reference
    for prompt in PROMPTS[:6]:
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=24)
        choice = reply.choices[0]
        assert choice.text == expected[prompt].text
        assert choice.finish_reason == expected[prompt].finish_reason
        assert reply.usage.completion_tokens == len(expected[prompt].token_ids)
        assert reply.usage.prompt_tokens == len(generator.encode_prompts([prompt])[0])
        assert reply.model_extra["speculative_decoding"]["draft_tokens"] >= 0
        chunks = list(
            client.completions.create(model="tiny", prompt=prompt, max_tokens=24, stream=True)
        )
        assert "".join(c.choices[0].text for c in chunks) == choice.text
        assert chunks[-1].choices[0].finish_reason == choice.finish_reason
        assert all(c.usage is None for c in chunks)  # usage only where asked, as OpenAI
        # asked: one more chunk, no choices, the usage (clients read it where choices are empty;
        # it rode on the finish chunk, asked or not)
        chunks = list(
            client.completions.create(
                model="tiny", prompt=prompt, max_tokens=24, stream=True,
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
        assert chunks[-2].choices[0].finish_reason == choice.finish_reason
        details = {"prompt_tokens_details"}
        assert chunks[-1].choices == []
        usage = reply.usage.model_dump(exclude=details)
        assert chunks[-1].usage.model_dump(exclude=details) == usage
        # the prompt was just read: all but its last token come from the finished row's cache
        ids = generator.encode_prompts([prompt])[0]
        cached = len(ids) - 1 if len(ids) > MIN_SHARED_PREFIX else 0
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
        assert all(c.usage is None for c in chunks[:-1])
        # on the wire, as OpenAI's: "usage": null in every other chunk (clients that index
        # chunk["usage"] failed on its absence); stream_options without a stream is refused
        body = {"prompt": prompt, "max_tokens": 24, "stream_options": {"include_usage": True}}
        raw = httpx.post(f"{server[0]}/v1/completions", json={**body, "stream": True}, timeout=30)
        events = [json.loads(line[6:]) for line in raw.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        assert all("usage" in e and e["usage"] is None for e in events[:-1])
        usage = reply.usage.model_dump(exclude_none=True)
        assert events[-1]["usage"] == {**usage, "prompt_tokens_details": {"cached_tokens": cached}}
        raw = httpx.post(f"{server[0]}/v1/completions", json=body, timeout=30)
        assert raw.status_code == 400 and raw.json()["error"]["param"] == "stream_options"


def test_logprobs_are_the_targets_own_as_openai_gives_them(client, reference):
    """A completion's ``logprobs: N`` and a chat's ``logprobs: true, top_logprobs: N``: each
    new token's log-probability under the target's own distribution (before temperature, as
    vLLM's), with the N most likely tokens at its position, from the pass that verified it:
    the values `generate` gives, with speculation or the target alone."""
    generator, _ = reference
    prompt = PROMPTS[1]
    config = GenerationConfig(max_new_tokens=12, temperature=0.8, seed=4, logprobs=2)
    [alone] = generator.generate([prompt], replace(config, num_draft_tokens=0))
    [spec] = generator.generate([prompt], config)
    assert spec.token_ids == alone.token_ids and len(spec.logprobs) == 12
    for a, b in zip(spec.logprobs, alone.logprobs):
        assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.top[0][1] >= a.top[1][1] and a.top[0][1] >= a.logprob  # most likely first
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0.8, seed=4, logprobs=2
    )
    logprobs = reply.choices[0].logprobs
    assert "".join(logprobs.tokens) == alone.text
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in alone.logprobs], abs=1e-4)
    listed = [lp for top in logprobs.top_logprobs for lp in top.values()]
    assert listed == pytest.approx([lp for e in alone.logprobs for _, lp in e.top], abs=1e-4)
    assert logprobs.text_offset[:2] == [0, len(logprobs.tokens[0])]
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_streamed_logprobs_join_to_the_whole_answers(server, client, reference):
    """Streamed, the chunks bring the log-probabilities of the tokens that came with their
    text: joined, the tokens, values, alternatives and offsets of the answer unstreamed (a
    stop string holding text back too; a chat's: the chat template's test)."""
    _, expected = reference
    prompt = next(p for p in PROMPTS if len(expected[p].text) >= 12)
    stop = expected[prompt].text[6:9]
    for extra in ({}, {"stop": [stop]}):
        args = dict(model="tiny", prompt=prompt, max_tokens=12, seed=4, logprobs=2, **extra)
        whole = client.completions.create(**args).choices[0]
        chunks = list(client.completions.create(**args, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == whole.text
        parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
        assert len(parts) > 1 and all(part.tokens for part in parts)
        assert [t for part in parts for t in part.tokens] == whole.logprobs.tokens
        assert [o for part in parts for o in part.text_offset] == whole.logprobs.text_offset
        values = [v for part in parts for v in part.token_logprobs]
        assert values == pytest.approx(whole.logprobs.token_logprobs, abs=1e-4)
        tops = [top for part in parts for top in part.top_logprobs]
        assert [list(top) for top in tops] == [list(top) for top in whole.logprobs.top_logprobs]


def test_penalties_bias_min_p_and_stop_token_ids_answer_as_generate_does(server, client, reference):
    """OpenAI's ``logit_bias`` and penalties, vLLM's ``repetition_penalty``, ``min_p``
    (sampling) and ``stop_token_ids`` (the row ends at the first, in its tokens, not its
    text, as vLLM's), as `generate` gives them."""
    generator, expected = reference
    prompt = next(p for p in PROMPTS if len(expected[p].token_ids) >= 8)
    config = GenerationConfig(max_new_tokens=12, temperature=1.5, seed=3, min_p=0.2)
    [sampled], [unfiltered] = (
        generator.generate([prompt], c) for c in (config, replace(config, min_p=0))
    )
    assert sampled.text != unfiltered.text  # the filter changes this answer
    args = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=1.5, seed=3)
    reply = client.completions.create(**args, extra_body={"min_p": 0.2})
    assert reply.choices[0].text == sampled.text
    stop = expected[prompt].token_ids[5]
    cut = expected[prompt].token_ids[: expected[prompt].token_ids.index(stop) + 1]
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, extra_body={"stop_token_ids": [stop]}
    )
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == len(cut)
    assert reply.choices[0].text == generator.tokenizer.decode(cut[:-1])
    streamed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, stream=True,
        extra_body={"stop_token_ids": [stop]},
    )  # fmt: skip
    assert "".join(part.choices[0].text for part in streamed) == reply.choices[0].text
    penalties = dict(frequency_penalty=1.0, presence_penalty=0.5, logit_bias={"7": 3})
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, **penalties,
        extra_body={"repetition_penalty": 1.2},
    )  # fmt: skip
    config = GenerationConfig(max_new_tokens=16, repetition_penalty=1.2, **penalties)
    [processed], [plain] = (generator.generate([prompt], c) for c in (config, replace(config, **{
        "logit_bias": {}, "repetition_penalty": 1, "frequency_penalty": 0, "presence_penalty": 0}
    )))  # fmt: skip
    assert reply.choices[0].text == processed.text != plain.text
    eos = min(generator.eos_token_ids)  # vLLM's skip_special_tokens: false writes them out
    forced = dict(max_tokens=3, logit_bias={str(eos): 100})
    extra = {"ignore_eos": True, "skip_special_tokens": False}
    reply = client.completions.create(model="tiny", prompt=prompt, **forced, extra_body=extra)
    assert reply.choices[0].text == generator.tokenizer.decode([eos] * 3, False) != ""


def test_structured_output_answers_as_generate_does(server, client, reference):
    """vLLM's ``guided_regex``/``guided_choice``/``structured_outputs`` and OpenAI's
    ``response_format`` hold the answer to their grammar, streamed or not, as `generate` gives
    it; a grammar that does not compile, two at once or a format specrt does not know are a
    400 naming the field. (The tiny tokenizer writes no braces: JSON is tested on the demo pair
    in test_grammar.)"""
    generator, _ = reference
    prompt = PROMPTS[1]
    regex = r"(cab|bad|ace)( (cab|bad|ace)){0,3}\."
    config = GenerationConfig(max_new_tokens=24, structured_output={"regex": regex})
    [expected] = generator.generate([prompt], config)
    assert re.fullmatch(regex, expected.text) and expected.finish_reason == "stop"
    for extra in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        args = dict(model="tiny", prompt=prompt, max_tokens=24, extra_body=extra)
        reply = client.completions.create(**args)
        assert reply.choices[0].text == expected.text and reply.choices[0].finish_reason == "stop"
        chunks = client.completions.create(**args, stream=True)
        assert "".join(c.choices[0].text for c in chunks) == expected.text
    choices = ["bad cab", "ace"]
    config = GenerationConfig(max_new_tokens=24, structured_output={"choice": choices})
    [chosen] = generator.generate([prompt], config)
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, extra_body={"guided_choice": choices}
    )
    assert reply.choices[0].text == chosen.text and chosen.text in choices
    url = server[0]
    for body, param, words in [
        ({"guided_regex": "[a-"}, "guided_regex", "does not compile"),
        ({"response_format": {"type": "xml"}}, "response_format", 'use {"type": "text"}'),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "give one"),
        ({"structured_outputs": "a+"}, "structured_outputs", "give a StructuredOutput"),
        ({"guided_regex": "a+", "ignore_eos": True}, None, "cannot be combined"),
    ]:
        raw = httpx.post(f"{url}/v1/completions", json={"prompt": "a", **body}, timeout=10)
        error = raw.json()["error"]
        assert raw.status_code == 400 and words in error["message"], raw.text
        assert param is None or error["param"] == param, raw.text


def test_echo_gives_the_prompt_and_its_logprobs_before_the_answer(server, client, reference):
    """``echo`` (as evaluation harnesses send it, to score a text): the prompt before the
    answer, with each prompt token's log-probability (None for the first) where ``logprobs``
    asks, the target's own as `generate` gives them (``prompt_logprobs``); ``max_tokens: 0``
    gives the prompt alone; streamed, the prompt's chunk comes first. In a chat, a 400."""
    generator, expected = reference
    prompt = PROMPTS[2]
    ids = generator.encode_prompts([prompt])[0]
    config = GenerationConfig(max_new_tokens=4, logprobs=1, prompt_logprobs=1)
    [result] = generator.generate([prompt], config)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True)
    assert reply.choices[0].text == prompt + result.text and reply.choices[0].logprobs is None
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=1
    )
    logprobs = reply.choices[0].logprobs
    assert reply.choices[0].text == prompt + result.text
    assert len(logprobs.tokens) == len(ids) + 4 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None and len(logprobs.top_logprobs[1]) == 1
    values = [e.logprob for e in [*result.prompt_logprobs[1:], *result.logprobs]]
    assert logprobs.token_logprobs[1:] == pytest.approx(values, abs=1e-4)
    assert "".join(logprobs.tokens) == generator.tokenizer.decode(ids + result.token_ids)
    scored = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0
    )
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(values[:-4], abs=1e-4)
    url = server[0]
    # streamed: the prompt's chunk first (with its entries), then the answer's, as unstreamed
    chunks = list(client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=1, stream=True
    ))  # fmt: skip
    assert chunks[0].choices[0].text == prompt
    assert "".join(c.choices[0].text for c in chunks) == reply.choices[0].text
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for part in parts for t in part.tokens] == logprobs.tokens
    assert [o for part in parts for o in part.text_offset] == logprobs.text_offset
    streamed = [v for part in parts for v in part.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(values, abs=1e-4)
    bad = [
        ({"prompt": prompt, "echo": True, "stream": True, "max_tokens": 0}, "is not streamed"),
        ({"prompt": prompt, "echo": 1}, "echo=1: use true or false"),
        ({"prompt": prompt, "max_tokens": 0}, "max_tokens=0: use an integer"),
    ]
    for body, words in bad:
        raw = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert raw.status_code == 400 and words in raw.json()["error"]["message"], raw.text


def test_truncate_prompt_tokens_answers_from_the_prompts_last_tokens(server, client, reference):
    """vLLM's ``truncate_prompt_tokens``: a prompt too long for the context is answered from
    its last N tokens as if they were the prompt (its usage counts those, ``echo`` gives their
    text), where without it the request is refused as too long; a bad value is a 400."""
    generator, _ = reference
    ids = [3 + (7 * i) % 40 for i in range(generator.target.max_positions + 20)]
    [expected] = generator.generate([ids[-30:]], GenerationConfig(max_new_tokens=5))
    url = server[0]
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 5})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    reply = client.completions.create(
        model="tiny", prompt=ids, max_tokens=5, echo=True, extra_body={"truncate_prompt_tokens": 30}
    )
    echoed = generator.tokenizer.decode(ids[-30:])
    assert reply.choices[0].text == echoed + expected.text
    assert reply.usage.prompt_tokens == 30 and reply.usage.completion_tokens == 5
    for value in (0, -2, "30"):
        body = {"prompt": "a", "truncate_prompt_tokens": value}
        raw = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert raw.status_code == 400 and "truncate_prompt_tokens" in raw.text, raw.text


@pytest.fixture(scope="module")
def templated_server(llama_bundle):
    """A server of the tiny bundle (which has no chat template) with a template given, and
    vLLM's priority scheduling."""
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    flags = ("--scheduling-policy", "priority", "--chat-template", template)
    with running_server(llama_bundle, *flags) as (url, _):
        yield url


def test_priority_is_refused_under_fcfs_and_ordered_under_the_priority_policy(
    server, client, reference, templated_server
):
    """vLLM's ``priority``: a first-come server (the default, as vLLM's) answers 0 or null
    and refuses any other in one 400 naming the field and the flag; one started with
    ``--scheduling-policy priority`` takes any integer (its order: `test_service.py`)."""
    _, expected = reference
    url = server[0]
    for value in (0, None):
        reply = client.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=24, extra_body={"priority": value}
        )
        assert reply.choices[0].text == expected[PROMPTS[0]].text
    raw = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "priority": 3}, timeout=30)
    assert raw.status_code == 400, raw.text
    error = raw.json()["error"]
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
    other = templated_server
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for value in (-3, 7):
        body = {"prompt": PROMPTS[0], "max_tokens": 24, "priority": value}
        reply = httpx.post(f"{other}/v1/completions", json=body, timeout=30)
        assert reply.json()["choices"][0]["text"] == expected[PROMPTS[0]].text
        answer = httpx.post(f"{other}/v1/chat/completions", json={**chat, "priority": value})
        assert answer.status_code == 200, answer.text
    bad = {"prompt": "a", "priority": "high"}
    raw = httpx.post(f"{other}/v1/completions", json=bad, timeout=30)
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "priority", raw.text


def test_the_responses_api_answers_as_the_chat_route_whole_and_streamed(templated_server):
    """OpenAI's ``/v1/responses`` through the openai client: ``input`` and ``instructions``
    are a chat's messages, so the text is the chat route's own answer to them, whole or
    streamed (its deltas join to it, its events numbered in order); what needs state, tools or
    other items than text is a 400 naming the field."""
    client = openai.OpenAI(base_url=f"{templated_server}/v1", api_key="x", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12)
    expected = chat.choices[0].message.content
    parts = [{"type": "input_text", "text": "h"}, {"type": "input_text", "text": "i"}]
    for given in ("hi", [{"role": "user", "content": parts}]):
        reply = client.responses.create(
            model="tiny", input=given, instructions="Be brief.", max_output_tokens=12
        )
        assert reply.output_text == expected and reply.id.startswith("resp_")
        assert reply.usage.input_tokens == chat.usage.prompt_tokens
        assert reply.usage.output_tokens == chat.usage.completion_tokens
        cut = chat.choices[0].finish_reason == "length"
        assert reply.status == ("incomplete" if cut else "completed")
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    reply = client.responses.create(model="tiny", input=developer, max_output_tokens=12)
    assert reply.output_text == expected  # a developer message is the system's
    events = list(
        client.responses.create(
            model="tiny", input="hi", instructions="Be brief.", max_output_tokens=12, stream=True
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected == events[-1].response.output_text
    refusals = [
        ({"input": "a", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "a", "tools": [{"type": "function", "name": "f"}]}, "tools"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": "a", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "a", "frobnicate": 1}, "frobnicate"),
        ({"input": 3}, "input"),
    ]
    for body, param in refusals:
        raw = httpx.post(f"{templated_server}/v1/responses", json=body, timeout=30)
        assert raw.status_code == 400 and raw.json()["error"]["param"] == param, raw.text


def test_vllm_flag_names_serve_as_ours(llama_bundle, tmp_path):
    """A command line written for vLLM (`--served-model-name`, `--max-num-seqs`,
    `--max-model-len`, `--enable-auto-tool-choice` with its parser) starts the same server
    as ours; the auto flag without a parser is refused in one line, as vLLM refuses it."""
    flags = (
        "--served-model-name", "other", "--max-num-seqs", "2", "--max-model-len", "64",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )  # fmt: skip
    log = tmp_path / "server.log"
    with running_server(llama_bundle, *flags, log=log) as (url, _):
        [model] = httpx.get(f"{url}/v1/models").json()["data"]
        assert model["id"] == "other" and model["max_model_len"] == 64
        assert "2 requests x 64 positions" in logged(log, "KV cache")
    refused = subprocess.run(
        [sys.executable, "-m", "specrt.cli", "serve", "--bundle", str(llama_bundle),
         "--enable-auto-tool-choice"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "--enable-auto-tool-choice needs --tool-call-parser" in refused.stderr


def test_stop_strings_and_max_tokens_mid_round(client, reference):
    _, expected = reference
    checked = 0
    for prompt in PROMPTS[:10]:
        full = expected[prompt].text
        if len(full) < 10:
            continue
        stop = full[4:7]
        for stream, included in ((False, False), (True, False), (False, True), (True, True)):
            reply = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=24, stop=[stop], stream=stream,
                extra_body={"include_stop_str_in_output": included},
            )  # fmt: skip
            chunks = list(reply) if stream else [reply]
            text = "".join(c.choices[0].text for c in chunks)
            assert text == full[: full.find(stop) + (len(stop) if included else 0)]
            assert chunks[-1].choices[0].finish_reason == "stop"
        checked += 1
    assert checked >= 3
    for limit in (1, 2, 5):  # K = 3: rounds emit up to 4 tokens; the limit is exact
        reply = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=limit)
        assert reply.usage.completion_tokens == limit or reply.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return (
            client.completions.create(
                model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    assert sample(11) == sample(11)
    assert len({sample(11), sample(12), sample(13)}) > 1


def test_n_choices_are_the_rows_generate_gives_one_prompt(server, client, reference):
    """``n`` choices of one prompt, streamed or not, are what `generate` gives the prompt n
    times: choice i samples from the stream (seed, i), so they differ and each is
    reproducible. The usage counts the prompt once, the choices' tokens all."""
    generator, _ = reference
    prompt, sampled = PROMPTS[1], dict(max_tokens=16, temperature=1.0, seed=7)
    config = GenerationConfig(max_new_tokens=16, temperature=1.0, seed=7)
    results = generator.generate([prompt] * 3, config)
    expected = [r.text for r in results]
    assert len(set(expected)) > 1  # (else choices mixed up would pass)
    reply = client.completions.create(model="tiny", prompt=prompt, n=3, **sampled)
    assert [(c.index, c.text) for c in reply.choices] == list(enumerate(expected))
    assert reply.usage.prompt_tokens == len(generator.encode_prompts([prompt])[0])
    assert reply.usage.completion_tokens == sum(len(r.token_ids) for r in results)
    assert reply.model_extra["speculative_decoding"]["rounds"] >= 3
    chunks = list(
        client.completions.create(
            model="tiny", prompt=prompt, n=3, stream=True,
            stream_options={"include_usage": True}, **sampled,
        )
    )  # fmt: skip
    texts, finished = ["", "", ""], []
    for c in chunks[:-1]:
        [choice] = c.choices
        texts[choice.index] += choice.text
        finished += [choice.index] if choice.finish_reason else []
    assert texts == expected and sorted(finished) == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage
    greedy = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text


def test_continuous_usage_stats_give_each_chunk_its_choices_usage_so_far(server, client, reference):
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk
    carries its choice's usage so far, the tokens its text came from (counted here by the
    log-probability entries each chunk brings), the last one the request's; without
    ``include_usage`` nothing, as vLLM. Keys ``stream_options`` does not take are a 400."""
    generator, _ = reference
    prompt, sampled = PROMPTS[1], dict(max_tokens=12, temperature=1.0, seed=5, logprobs=1)
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            model="tiny", prompt=prompt, n=2, stream=True, stream_options=options, **sampled
        )
    )
    prompt_tokens = len(generator.encode_prompts([prompt])[0])
    counted = [0, 0]
    for c in chunks[:-1]:
        [choice] = c.choices
        counted[choice.index] += len(choice.logprobs.tokens) if choice.logprobs else 0
        assert c.usage.prompt_tokens == prompt_tokens
        assert c.usage.completion_tokens == counted[choice.index] > 0
    reply = client.completions.create(model="tiny", prompt=prompt, n=2, **sampled)
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage
    assert sum(counted) == reply.usage.completion_tokens
    quiet = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, stream=True,
        stream_options={"continuous_usage_stats": True},
    )  # fmt: skip
    assert all(c.usage is None for c in quiet)
    for options, words in [
        ({"include_usage": True, "usage": True}, "stream_options.usage is unknown"),
        ({"include_usage": 1}, "true or false"),
        ({"include_obfuscation": True}, "send false"),
    ]:
        body = {"prompt": prompt, "stream": True, "stream_options": options}
        raw = httpx.post(f"{server[0]}/v1/completions", json=body, timeout=30)
        assert raw.status_code == 400 and words in raw.json()["error"]["message"]


def test_a_list_of_prompts_is_answered_as_each_prompt_alone(server, client, reference):
    """OpenAI's list of prompts: choice i of prompt p comes at p * n + i, and is what the
    prompt sent alone gets (choice i sampling from the stream (seed, i)), streamed or not; the
    usage counts each prompt once; echo gives each choice its own prompt; token-id prompts too."""
    generator, _ = reference
    prompts, sampled = PROMPTS[:2], dict(max_tokens=12, temperature=1.0, seed=3)
    config = GenerationConfig(max_new_tokens=12, temperature=1.0, seed=3)
    results = [r for p in prompts for r in generator.generate([p] * 2, config)]
    expected = [r.text for r in results]
    assert len(set(expected)) == 4  # (else choices mixed up would pass)
    reply = client.completions.create(model="tiny", prompt=prompts, n=2, **sampled)
    assert [(c.index, c.text) for c in reply.choices] == list(enumerate(expected))
    ids = generator.encode_prompts(prompts)
    assert reply.usage.prompt_tokens == sum(map(len, ids))
    assert reply.usage.completion_tokens == sum(len(r.token_ids) for r in results)
    chunks = list(
        client.completions.create(
            model="tiny", prompt=prompts, n=2, stream=True,
            stream_options={"include_usage": True}, **sampled,
        )
    )  # fmt: skip
    texts = [""] * 4
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == expected and chunks[-1].usage == reply.usage
    echoed = client.completions.create(
        model="tiny", prompt=[ids[0], prompts[1]], echo=True, **sampled
    )
    too_long = {"prompt": [prompts[0], "Simple is better than complex. " * 30], "n": 2}
    refused = httpx.post(f"{server[0]}/v1/completions", json=too_long, timeout=30)
    assert refused.status_code == 400  # the whole request: the first prompt's choices withdrawn
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    alone = [generator.generate([p], config)[0].text for p in prompts]
    assert [c.text for c in echoed.choices] == [
        generator.tokenizer.decode(ids[0]) + alone[0],
        prompts[1] + alone[1],
    ]


def test_a_client_gone_cancels_every_choice(server):
    url = server[0]
    body = {"prompt": PROMPTS[2], "max_tokens": 200, "stream": True, "n": 3}

    def aborted() -> float:
        metrics = scrape(httpx.get(f"{url}/metrics").text)
        return metrics.get('vllm:request_success_total{finished_reason="abort"}', 0.0)

    before = aborted()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                break  # walk away mid-stream
    deadline = time.monotonic() + 20
    while aborted() - before < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborted() - before == 3
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "running": 0, "waiting": 0}


def test_bad_requests_get_their_status_and_the_server_goes_on(server, client):
    url = server[0]
    cases = [
        (dict(max_tokens=-1), openai.BadRequestError, "max_tokens"),
        (dict(top_p=2.0), openai.BadRequestError, "top_p"),
        (dict(temperature=-1), openai.BadRequestError, "temperature"),
        (dict(model="gpt-4"), openai.NotFoundError, "not served here"),
        # too long: 400 with OpenAI's code, which clients catch to trim and retry (it was 413)
        (dict(prompt="Simple is better than complex. " * 30), None, "positions fit"),
        (dict(logprobs=21), openai.BadRequestError, "logprobs=21: use an integer from 0 to 20"),
        (dict(prompt=["Simple is"] * 3, n=30), openai.BadRequestError, "3 prompts of n=30 each"),
        (dict(prompt=[1, "a"]), openai.BadRequestError, "prompt must be a string, a list of"),
        (dict(extra_body={"top_logprobs": 2}), openai.BadRequestError, "a chat field"),
        (dict(extra_body={"echo": "yes"}), openai.BadRequestError, 'echo="yes": use true'),
        (dict(frequency_penalty=2.5), openai.BadRequestError, "frequency_penalty=2.5 is out"),
        (dict(logit_bias={"99999": 1}), openai.BadRequestError, "logit_bias names token 99999"),
        (dict(extra_body={"tool_choice": "auto"}), openai.BadRequestError, "tool_choice is not"),
        (
            dict(extra_body={"max_completion_tokens": 5}),
            openai.BadRequestError,
            "max_tokens and max_completion_tokens differ",
        ),
        (dict(extra_body={"colour": 1}), openai.BadRequestError, "unknown field(s) ['colour']"),
        (dict(n=0), openai.BadRequestError, "n=0: use an integer from 1 to 128"),
        (dict(extra_body={"n": 1.5}), openai.BadRequestError, "n=1.5: use an integer"),
        (dict(extra_body={"n": True}), openai.BadRequestError, "n=true: use an integer"),
        (dict(n=129), openai.BadRequestError, "n=129: use an integer from 1 to 128"),
        # more than the slots and the queue hold: never served, so not a 429 to retry
        (dict(n=69), openai.BadRequestError, "n=69: this server holds at most 68 requests"),
    ]
    for overrides, kind, words in cases:
        request = {**dict(model="tiny", prompt="Simple is", max_tokens=4), **overrides}
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(**request)
        assert kind is None or isinstance(caught.value, kind)
        if kind is None:
            assert isinstance(caught.value, openai.BadRequestError)
            assert caught.value.response.json()["error"]["code"] == "context_length_exceeded"
        assert words in caught.value.response.json()["error"]["message"]
    # OpenAI's error body names the field at fault (it was null for the sampling fields)
    for field, value in [("temperature", -1), ("top_p", 2.0), ("top_k", -3), ("seed", "x"),
                         ("stop", [""]), ("max_completion_tokens", 0), ("min_p", 2),
                         ("stop_token_ids", [-1])]:  # fmt: skip
        raw = httpx.post(f"{url}/v1/completions", json={"prompt": "a", field: value}, timeout=10)
        assert raw.status_code == 400 and raw.json()["error"]["param"] == field, raw.text
    # a path or method it does not serve: OpenAI's body ("Invalid URL"), not plain text
    for method, path, status in [("POST", "/v1/embeddings", 404), ("GET", "/v1/completions", 405)]:
        raw = httpx.request(method, f"{url}{path}", timeout=10)
        error = raw.json()["error"]
        assert raw.status_code == status and error["type"] == "invalid_request_error"
        assert f"Invalid URL ({method} {path})" in error["message"]
    assert "POST" in httpx.get(f"{url}/v1/completions", timeout=10).headers["allow"]
    raw = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=10)
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    nulls = dict.fromkeys(["temperature", "top_p", "seed", "stop", "n", "stream", "max_tokens"])
    nulls["model"] = None  # (null was taken for a model's name: 404)
    raw = httpx.post(f"{url}/v1/completions", json={"prompt": "Simple is", **nulls}, timeout=30)
    assert raw.status_code == 200, raw.text  # null is the default, as OpenAI reads it
    assert raw.json()["usage"]["completion_tokens"] <= 16  # the default max_tokens
    vllm_off = {"prompt": "Simple is", "max_tokens": 4, "top_k": -1}  # vLLM's "no filter"
    assert httpx.post(f"{url}/v1/completions", json=vllm_off, timeout=30).status_code == 200
    # what clients written for vLLM send at neutral values (refused as unknown fields before),
    # and one prompt of token ids in a list
    vllm_off = {"prompt": [[5, 6, 7]], "max_tokens": 4, "min_p": 0.0, "stop_token_ids": [],
                "skip_special_tokens": True, "ignore_eos": True,
                "modalities": ["text"]}  # fmt: skip
    done = httpx.post(f"{url}/v1/completions", json=vllm_off, timeout=30)
    assert done.status_code == 200 and done.json()["usage"]["prompt_tokens"] == 3, done.text
    assert done.json()["usage"]["completion_tokens"] == 4  # ignore_eos taken
    raw = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": "4"}, timeout=10)
    assert raw.status_code == 400 and 'max_tokens="4"' in raw.json()["error"]["message"]
    chat = httpx.post(
        f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]
    assert client.completions.create(model="tiny", prompt="Simple is", max_tokens=4).choices
    off = client.completions.create(  # what clients such as LangChain send: all "off"
        model="tiny",
        prompt="Simple is",
        max_tokens=4,
        logprobs=None,
        echo=False,
        presence_penalty=0,
        frequency_penalty=0.0,
        logit_bias={},
        best_of=1,
        user="someone",
        extra_body={"max_completion_tokens": 4, "response_format": {"type": "text"}},
    )
    assert off.choices[0].logprobs is None and off.usage.completion_tokens == 4
    assert client.models.list().data[0].id == "tiny"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_oversized_bodies_and_prompts_are_refused_before_they_are_read_whole(server, reference):
    """A body larger than any prompt of the model could need gets 413 whether its length is
    declared or not (chunked), and a prompt of more characters than its positions could
    hold gets 400 ("context_length_exceeded") without being tokenized; a non-boolean stream
    gets 400; the server goes on answering meanwhile."""
    url = server[0]
    generator, _ = reference
    chars = generator.max_prompt_chars
    too_big = 6 * chars + (1 << 20) + 1
    body = b'{"prompt": "' + b"a" * too_big + b'"}'
    declared = httpx.post(f"{url}/v1/completions", content=body, timeout=60)
    assert declared.status_code == 413, declared.text
    assert "request body is over" in declared.json()["error"]["message"]
    parts = (body[i : i + 65536] for i in range(0, len(body), 65536))
    chunked = httpx.post(f"{url}/v1/completions", content=parts, timeout=60)
    assert chunked.status_code == 413 and "request body is over" in chunked.text
    long = {"prompt": "Simple is better. " * (chars // 18 + 1), "max_tokens": 2}
    started = time.monotonic()
    refused = httpx.post(f"{url}/v1/completions", json=long, timeout=60)
    assert refused.status_code == 400, refused.text  # a prompt too long, as OpenAI says it
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert "characters, far more than 128 positions hold" in refused.json()["error"]["message"]
    assert time.monotonic() - started < 10
    streamed = {"prompt": "Simple is", "max_tokens": 2, "stream": "yes"}
    bad = httpx.post(f"{url}/v1/completions", json=streamed, timeout=30)
    assert bad.status_code == 400 and "stream must be true or false" in bad.text
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_disconnects_mid_stream_free_their_slots(server, client, reference):
    url, process = server
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 200, "stream": True}

    def rss() -> int:
        return int(Path(f"/proc/{process.pid}/statm").read_text().split()[1]) * os.sysconf(
            "SC_PAGE_SIZE"
        )

    def drop_one() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    break  # walk away mid-stream

    for _ in range(20):  # warm up: caches, allocator pools
        drop_one()
    before = rss()
    for _ in range(200):
        drop_one()
    deadline = time.monotonic() + 20
    while httpx.get(f"{url}/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "running": 0, "waiting": 0}
    assert rss() - before < 30 * 2**20, (before, rss())
    _, expected = reference
    reply = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=24)
    assert reply.choices[0].text == expected[PROMPTS[3]].text
    metrics = scrape(httpx.get(f"{url}/metrics").text)
    assert 'vllm:request_success_total{finished_reason="abort"}' in metrics  # vLLM's name
    assert "vllm:spec_decode_num_draft_tokens_total" in metrics


def test_a_client_gone_before_its_answer_cancels_it_streaming_or_not(server):
    """Clients that send a whole request and hang up (a timeout, a retry) do not leave work
    behind: non-streaming requests are cancelled too (they ran to their end before)."""
    url = server[0]
    port = int(url.rsplit(":", 1)[1])

    def finished() -> tuple[float, float]:
        """Requests cancelled, and requests finished for any reason."""
        metrics = scrape(httpx.get(f"{url}/metrics").text)
        ended = [v for k, v in metrics.items() if k.startswith("vllm:request_success_total{")]
        return metrics.get('vllm:request_success_total{finished_reason="abort"}', 0.0), sum(ended)

    body = json.dumps({"model": "tiny", "prompt": PROMPTS[5], "max_tokens": 100}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    # A tiny model's answer takes milliseconds, about as long as the server takes to see a
    # hang-up on a loaded machine: bursts until 4 are cancelled (none ever is, if hang-ups
    # are not noticed), each waited out whole.
    cancelled_before, _ = finished()
    for _ in range(20):
        _, ended_before = finished()
        for _ in range(12):  # 4 slots: most wait
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(head + body)
        # the server may not have read every request yet when the last socket closes: wait
        # for all 12 to end, not for an idle moment (which can come before the last arrive)
        deadline = time.monotonic() + 60
        while finished()[1] - ended_before < 12 and time.monotonic() < deadline:
            time.sleep(0.05)
        cancelled, ended = finished()
        assert ended - ended_before == 12
        if cancelled - cancelled_before >= 4:
            break
    assert cancelled - cancelled_before >= 4


def test_sixteen_concurrent_streams_equal_their_serial_output(client, reference):
    _, expected = reference

    def stream(prompt: str) -> str:
        chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, stream=True)
        return "".join(c.choices[0].text for c in chunks)

    outputs = in_threads(stream, PROMPTS[:16])
    assert outputs == {p: expected[p].text for p in PROMPTS[:16]}


def scrape(text: str) -> dict[str, float]:
    """The samples of a /metrics page by name and labels, read with prometheus_client's own
    parser; every one must carry ``model_name`` (vLLM's dashboards filter on it), left out of
    the keys."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == "tiny", sample
            shown = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
            values[sample.name + (f"{{{shown}}}" if shown else "")] = sample.value
    return values


def scrape_counted(url: str, before: float) -> dict[str, float]:
    """The metrics once more than ``before`` requests are counted: a reply may leave before
    the service thread has counted its request."""
    deadline = time.monotonic() + 10
    while True:
        values = scrape(httpx.get(f"{url}/metrics").text)
        if values["vllm:e2e_request_latency_seconds_count"] > before:
            return values
        assert time.monotonic() < deadline, "the request was never counted"
        time.sleep(0.01)


def test_metrics_count_speculation(server):
    body = {"model": "tiny", "prompt": PROMPTS[1] * 3, "max_tokens": 24, "ignore_eos": True}
    for _ in range(2):  # not only earlier tests'; the second reads the first's cache
        httpx.post(f"{server[0]}/v1/completions", json=body, timeout=60)
    assert "_created" not in httpx.get(f"{server[0]}/metrics").text  # none beside each counter
    values = scrape_counted(server[0], 0)
    assert values["vllm:generation_tokens_total"] > 0
    assert (
        values["vllm:spec_decode_num_accepted_tokens_total"]
        <= values["vllm:spec_decode_num_draft_tokens_total"]
    )
    assert values["vllm:e2e_request_latency_seconds_count"] > 0
    # The same counts split by proposer (the server's default is the hybrid; "grammar": the
    # tokens a structured output forced, where an earlier test asked for one): they add up.
    by_proposer: dict[str, float] = {}
    for name, value in values.items():
        if name.startswith("specrt:proposer_num_draft_tokens_total{"):
            by_proposer[name.split('proposer="')[1].split('"')[0]] = value
    assert set(by_proposer) <= {"model", "lookup", "suffix", "grammar"}
    assert "lookup" in by_proposer
    assert sum(by_proposer.values()) == values["vllm:spec_decode_num_draft_tokens_total"]
    # Per-request histograms: their sums are the counters' totals.
    assert values["vllm:request_generation_tokens_sum"] == values["vllm:generation_tokens_total"]
    assert values["vllm:request_prompt_tokens_sum"] == values["vllm:prompt_tokens_total"]
    # vLLM's prefix caching counters, in tokens: every prompt's looked up, the repeat's found
    assert values["vllm:prefix_cache_queries_total"] == values["vllm:prompt_tokens_total"]
    assert 0 < values["vllm:prefix_cache_hits_total"] < values["vllm:prefix_cache_queries_total"]
    assert 0 < values["vllm:request_queue_time_seconds_count"]
    assert (
        values["vllm:request_queue_time_seconds_count"]
        <= values["vllm:e2e_request_latency_seconds_count"]
    )
    assert 0 < values["vllm:request_time_per_output_token_seconds_count"]


# The series vLLM's own Grafana dashboard (examples/online_serving/prometheus_grafana) reads,
# beyond the cache gauge: a panel whose series is missing stays empty.
DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:gpu_cache_usage_perc",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)


def test_metrics_fill_every_panel_of_vllms_dashboard(server):
    """The inter-token, prefill and decode series were missing: three of the dashboard's panels
    stayed empty. One request's share of each, read as differences of two scrapes."""
    url, _ = server
    before = scrape(httpx.get(f"{url}/metrics").text)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12, "ignore_eos": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    after = scrape(httpx.get(f"{url}/metrics").text)  # counted before its reply left
    assert after["vllm:e2e_request_latency_seconds_count"] == (
        before["vllm:e2e_request_latency_seconds_count"] + 1
    )
    names = {name.split("{")[0] for name in after}
    assert not [series for series in DASHBOARD_SERIES if series not in names]

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    tokens = reply["usage"]["completion_tokens"]
    assert tokens == 12
    assert grew("vllm:request_params_max_tokens_sum") == 12
    assert grew("vllm:request_max_num_generation_tokens_sum") == tokens
    # Its first token comes from the prompt's pass, the other 11 from 1 to 11 rounds
    gaps = grew("vllm:inter_token_latency_seconds_count")
    assert 1 <= gaps <= tokens - 1
    assert grew("vllm:time_per_output_token_seconds_count") == gaps
    assert grew("vllm:time_per_output_token_seconds_sum") == pytest.approx(
        grew("vllm:inter_token_latency_seconds_sum")
    )
    prefill, decode = (
        grew("vllm:request_prefill_time_seconds_sum"),
        grew("vllm:request_decode_time_seconds_sum"),
    )
    assert prefill > 0 and decode > 0
    assert grew("vllm:request_inference_time_seconds_sum") == pytest.approx(prefill + decode)
    assert decode == pytest.approx(grew("vllm:inter_token_latency_seconds_sum"))
    assert prefill + decode <= grew("vllm:e2e_request_latency_seconds_sum")


def test_metrics_count_every_answer_by_route_and_status(server):
    """Refused requests (400, 404, 429) were in no metric: only finished ones were counted.
    As vLLM's ``http_requests_total``, by route, method and status class."""
    url, _ = server
    key = 'http_requests_total{handler="%s",method="%s",status="%s"}'
    before = scrape(httpx.get(f"{url}/metrics").text)
    good = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=good, timeout=60).status_code == 200
    for bad in ({**good, "model": "other"}, {**good, "max_tokens": -1}):
        assert httpx.post(f"{url}/v1/completions", json=bad, timeout=60).status_code // 100 == 4
    assert httpx.get(f"{url}/no/such/route/42").status_code == 404
    assert httpx.get(f"{url}/v1/models/tiny").status_code == 200
    after = scrape(httpx.get(f"{url}/metrics").text)
    grown = {k: v - before.get(k, 0.0) for k, v in after.items() if k.startswith("http_")}
    assert grown[key % ("/v1/completions", "POST", "2xx")] == 1
    assert grown[key % ("/v1/completions", "POST", "4xx")] == 2
    assert grown[key % ("none", "GET", "4xx")] == 1  # not one series per path asked for
    assert grown[key % ("/v1/models/{name:path}", "GET", "2xx")] == 1  # the route's template
    assert grown[key % ("/metrics", "GET", "2xx")] == 1  # the first scrape


def test_metrics_gauge_requests_running_and_waiting(server):
    """The scheduler's state, read at each scrape: sixteen streams at once on a server with
    four slots fill the batch and queue the rest, and hold part of the KV cache; afterwards
    all three are 0 again."""
    url, _ = server
    usage, older = [], []
    # One pooled client, connections opened up front: a new client per stream costs enough
    # (TLS context, thread start) on a slow machine that requests trickle in one at a time.
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    client = httpx.Client(base_url=url, limits=limits, timeout=60)

    def gauges() -> tuple[float, float]:
        value = scrape(client.get("/metrics").text)
        usage.append(value["vllm:kv_cache_usage_perc"])
        older.append(value["vllm:gpu_cache_usage_perc"])  # the dashboard's name for it
        return value["vllm:num_requests_running"], value["vllm:num_requests_waiting"]

    def stream(prompt: str) -> None:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 200, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            for _ in response.iter_lines():
                pass

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda _: client.get("/health"), range(16)))  # warm the pool
        seen = set()
        streams = [pool.submit(stream, prompt) for prompt in PROMPTS[:16]]
        while not all(future.done() for future in streams):
            seen.add(gauges())
        for future in streams:
            future.result()
    assert max(running for running, _ in seen) == 4, seen
    assert max(waiting for _, waiting in seen) > 0, seen
    deadline = time.monotonic() + 20
    while gauges() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gauges() == (0, 0) and usage[-1] == older[-1] == 0
    assert 0 < max(usage) <= 1  # the running rows' positions, while they ran
    assert 0 < max(older) <= 1
    client.close()


TEMPLATE = (  # a message "boom" makes it raise a plain TypeError: a template is code
    "{% for m in messages %}{% if m.content == 'boom' %}{{ m.content + 1 }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def chat_bundle(llama_bundle: Path, bundle: Path) -> Path:
    """A copy of the tiny bundle at ``bundle``, with `TEMPLATE` as its chat template."""
    shutil.copytree(llama_bundle, bundle)
    config_path = bundle / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config))
    return bundle


def test_chat_completions_render_the_bundles_chat_template(llama_bundle, tmp_path, reference):
    bundle = chat_bundle(llama_bundle, tmp_path / "chat")
    generator, _ = reference
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f"}]
    rendered = "<system>be brief\n<user>def f\n<assistant>"
    ids = generator.tokenizer.encode(rendered, add_special_tokens=False)
    [expected] = generator.generate([ids], GenerationConfig(max_new_tokens=12, num_draft_tokens=K))
    with running_server(bundle) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12)
        assert reply.choices[0].message.content == expected.text
        assert reply.choices[0].message.role == "assistant"
        assert reply.usage.prompt_tokens == len(ids)
        chunks = list(
            client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=12, stream=True
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
        # The next turn: the conversation so far comes from the finished request's cache
        answer = {"role": "assistant", "content": expected.text}
        turn = [*messages, answer, {"role": "user", "content": "def g"}]
        next_ids = generator.tokenizer.encode(
            f"{rendered}{expected.text}\n<user>def g\n<assistant>", add_special_tokens=False
        )
        [after] = generator.generate([next_ids], GenerationConfig(max_new_tokens=12))
        reply = client.chat.completions.create(model="tiny", messages=turn, max_tokens=12)
        assert reply.choices[0].message.content == after.text
        assert reply.usage.prompt_tokens == len(next_ids)
        assert reply.usage.prompt_tokens_details.cached_tokens >= len(ids) >= MIN_SHARED_PREFIX
        # A chat's log-probabilities: each new token's, with its 2 most likely alternatives
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, logprobs=True, top_logprobs=2
        )
        content = reply.choices[0].logprobs.content
        assert "".join(entry.token for entry in content) == expected.text
        assert [len(entry.top_logprobs) for entry in content] == [2] * len(expected.token_ids)
        assert all(e.top_logprobs[0].logprob >= e.logprob for e in content)
        assert content[0].bytes == list(content[0].token.encode())
        chunks = client.chat.completions.create(  # streamed: the same entries, chunk by chunk
            model="tiny", messages=messages, max_tokens=12, logprobs=True, top_logprobs=2,
            stream=True,
        )  # fmt: skip
        parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        streamed = [entry for part in parts for entry in part.content]

        def shown(entries):
            return [(e.token, e.bytes, [a.token for a in e.top_logprobs]) for e in entries]

        assert len(parts) > 1 and shown(streamed) == shown(content)
        values = [e.logprob for e in streamed]
        assert values == pytest.approx([e.logprob for e in content], abs=1e-4)
        bad = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages,
                         "top_logprobs": 2})  # fmt: skip
        assert bad.status_code == 400 and "needs logprobs: true" in bad.text
        bad = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "echo": True})
        assert bad.status_code == 400 and "echo is a completion field" in bad.text
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                               n=2)  # fmt: skip
        assert [c.message.content for c in reply.choices] == [expected.text] * 2
        chunks = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, n=2, stream=True
        )
        roles, texts = [], ["", ""]
        for c in chunks:
            [choice] = c.choices
            roles += [choice.index] if choice.delta.role else []
            texts[choice.index] += choice.delta.content or ""
        assert roles == [0, 1] and texts == [expected.text] * 2
        finish = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages,
                            "max_tokens": 12, "stream": True}).text.splitlines()  # fmt: skip
        last = json.loads([line for line in finish if line.startswith("data: {")][-1][6:])
        assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"]
        bad = httpx.post(f"{url}/v1/chat/completions", json={"messages": "hi"})
        assert bad.status_code == 400 and "messages must be" in bad.json()["error"]["message"]
        boom = {"messages": [{"role": "user", "content": "boom"}], "max_tokens": 2}
        for stream in (False, True):
            bad = httpx.post(f"{url}/v1/chat/completions", json={**boom, "stream": stream})
            error = bad.json()["error"]  # was a 500 in plain text
            assert bad.status_code == 400 and "render these messages: TypeError" in error["message"]
        parts = [  # OpenAI's newer content form: a list of text parts, joined by newlines
            {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "def"}, {"type": "text", "text": "f"}],
            },
        ]
        reply = client.chat.completions.create(model="tiny", messages=parts, max_tokens=12)
        joined = "<system>be brief\n<user>def\nf\n<assistant>"
        assert reply.usage.prompt_tokens == len(
            generator.tokenizer.encode(joined, add_special_tokens=False)
        )
        image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
        body = {"messages": [{"role": "user", "content": image}]}
        bad = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert bad.status_code == 400 and "only text parts" in bad.json()["error"]["message"]


def test_chat_without_max_tokens_runs_until_the_model_stops_or_the_context_ends(
    llama_bundle, tmp_path, reference
):
    """As OpenAI's and vLLM's chat: no max_tokens is no length (replies were cut at 16 tokens,
    the legacy completions' default, which /v1/completions keeps)."""
    bundle = chat_bundle(llama_bundle, tmp_path / "chat")
    generator, _ = reference
    messages = [{"role": "user", "content": "def f"}]
    ids = generator.tokenizer.encode("<user>def f\n<assistant>", add_special_tokens=False)
    context = generator.target.max_positions
    config = GenerationConfig(max_new_tokens=context, num_draft_tokens=K)
    [expected] = generator.generate([ids], config)
    with running_server(bundle) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=messages)
        assert reply.choices[0].message.content == expected.text
        assert reply.usage.completion_tokens == len(expected.token_ids)
        endless = client.chat.completions.create(
            model="tiny", messages=messages, extra_body={"ignore_eos": True}
        )
        assert endless.choices[0].finish_reason == "length"
        assert endless.usage.prompt_tokens == len(ids)
        assert endless.usage.completion_tokens == context - len(ids) > 16
        legacy = client.completions.create(
            model="tiny", prompt="def f", extra_body={"ignore_eos": True}
        )
        assert legacy.usage.completion_tokens == 16  # OpenAI's default for completions
        # a conversation cut to its last 20 tokens runs until the context ends after those
        long = [{"role": "user", "content": "def f " * context}]
        cut = client.chat.completions.create(
            model="tiny",
            messages=long,
            extra_body={"ignore_eos": True, "truncate_prompt_tokens": 20},
        )
        assert cut.usage.prompt_tokens == 20
        assert cut.usage.completion_tokens == context - 20


def test_requests_are_logged_as_they_come_and_end_unless_the_level_is_above_info(
    server, server_log, client, llama_bundle, tmp_path
):
    """At --log-level info (the default), a line on stdout as each request comes (its id,
    route, prompt tokens, max_tokens, sampling, stream) and one as it ends (finish reason,
    completion tokens, prompt tokens cached, seconds), as vLLM logs them; at --log-level
    warning, neither."""
    reply = client.completions.create(
        model="tiny", prompt="Simple is", max_tokens=5, temperature=0.5, seed=3
    )
    received = logged(server_log, f"received request {reply.id}:")
    tokens = reply.usage.prompt_tokens
    assert received.startswith("INFO ") and "[specrt.serve]" in received
    assert f"/v1/completions, {tokens} prompt tokens, max_tokens 5, temperature 0.5" in received
    assert "seed 3, stream false" in received
    finished = logged(server_log, f"finished request {reply.id}:")
    choice, count = reply.choices[0], reply.usage.completion_tokens
    assert f": {choice.finish_reason}, {count} completion tokens, " in finished
    assert " prompt tokens cached, " in finished
    assert logged(server_log, "specrt serve: tiny on http://127.0.0.1:")  # the ready line
    quiet = tmp_path / "quiet.log"
    with running_server(llama_bundle, "--log-level", "warning", log=quiet) as (url, _):
        body = {"prompt": "Simple is", "max_tokens": 5}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200
    output = quiet.read_text()  # whole: the server has exited
    assert answer.json()["id"] not in output and "request" not in output, output
    assert "INFO" not in output, output
    assert "specrt serve: tiny on http://" in output  # the address, whatever the level


def test_json_python_cannot_read_gets_400_and_the_server_goes_on(server, server_log, client):
    """A body nested 100,000 deep, or with an integer of 5,000 digits in any field: JSON that
    Python's reader refuses (RecursionError, ValueError), answered with OpenAI's 400 in one
    line and no traceback (it was a plain-text 500)."""
    url = server[0]
    start = len(server_log.read_text())
    deep = "[" * 100_000 + "]" * 100_000
    digits = "7" * 5_000
    cases = [
        (deep, "nested too deeply"),
        ('{"prompt": "Simple is", "stop": ' + deep + "}", "nested too deeply"),
        ('{"prompt": "Simple is", "max_tokens": ' + digits + "}", "more than 4300 digits"),
        ('{"prompt": "Simple is", "seed": ' + digits + "}", "more than 4300 digits"),
    ]
    for body, words in cases:
        answer = httpx.post(
            f"{url}/v1/completions",
            content=body.encode(),
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert words in error["message"] and "\n" not in error["message"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] is None and error["code"] is None
    reply = client.completions.create(model="tiny", prompt="Simple is", max_tokens=4)
    assert reply.usage.completion_tokens >= 1
    output = server_log.read_text()[start:]
    assert not [word for word in ("Traceback", "RecursionError", "ValueError") if word in output]


def test_an_api_key_guards_the_v1_routes(llama_bundle):
    """With --api-key, /v1 wants it as a bearer token (the openai client sends its api_key so):
    a wrong or missing key gets OpenAI's 401, streaming works with the right one, and the
    health probe and the metrics scraper need none."""
    with running_server(llama_bundle, "--api-key", "s3cret") as (url, _):
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as caught:
            wrong.completions.create(model="tiny", prompt="Simple is", max_tokens=4)
        assert caught.value.response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        right = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        chunks = list(
            right.completions.create(model="tiny", prompt="Simple is", max_tokens=4, stream=True)
        )
        assert chunks[-1].choices[0].finish_reason == "length"
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200


def test_a_broken_chat_template_or_an_empty_key_stops_the_server_in_one_line(
    llama_bundle, tmp_path
):
    bundle = tmp_path / "broken"
    shutil.copytree(llama_bundle, bundle)
    config_path = bundle / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['role'] }"
    config_path.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    serve = [sys.executable, "-m", "specrt.cli", "serve", "--port", str(free_port())]
    cases = [
        (["--bundle", str(bundle)], 1, "chat template is broken"),
        (["--bundle", str(llama_bundle), "--api-key", ""], 2, "--api-key"),
    ]
    for extra, status, words in cases:
        done = subprocess.run(serve + extra, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == status, done.stderr
        assert words in done.stderr and "Traceback" not in done.stderr
    config_path.write_text("{not json")
    done = subprocess.run(
        serve + ["--bundle", str(bundle)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and "tokenizer_config.json" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_taken_port_or_a_bad_host_fails_before_the_bundle_loads(llama_bundle):
    """One line naming the address and what to do, a non-zero exit, no traceback, and before
    the bundle loads (minutes for large engines): the load's own line never shows."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for host, expected in (
            ("127.0.0.1", "Address already in use"),
            ("no-such-host.invalid", ""),
        ):
            cmd = [sys.executable, "-m", "specrt.cli", "serve", "--bundle", str(llama_bundle)]
            cmd += ["--host", host, "--port", str(port)]
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode != 0
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"Error: cannot listen on {host}:")
            assert expected in lines[0] and "Traceback" not in done.stderr


def test_sigterm_lets_running_requests_finish_and_exits_0(llama_bundle):
    """A request streaming when SIGTERM arrives gets its whole answer; new connections are
    refused; the process exits 0."""
    with running_server(llama_bundle) as (url, process):
        body = {"model": "tiny", "prompt": PROMPTS[4], "max_tokens": 60, "stream": True}
        texts = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break  # it is running
            process.send_signal(signal.SIGTERM)
            for line in lines:
                if line.startswith("data: {"):
                    texts.append(line)
        assert texts and '"finish_reason": "length"' in texts[-1]
        assert process.wait(timeout=60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)


def test_sigterm_right_after_the_ready_line_exits_0(llama_bundle):
    """A supervisor reads the address (`--port 0`: the port chosen) and may stop the server at
    once: the line comes only when the socket listens and SIGTERM is handled (it died of the
    signal, status -15, when stopped straight after the line)."""
    cmd = [
        sys.executable, "-m", "specrt.cli", "serve", "--bundle", str(llama_bundle),
        "--port", "0", "--threads", "1", "--batch-size", "2",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    try:
        for line in process.stdout:  # on stdout, as vLLM's log lines
            if "specrt serve: " in line and " on http://127.0.0.1:" in line:
                break
        else:
            pytest.fail("the server printed no address")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        process.kill()
