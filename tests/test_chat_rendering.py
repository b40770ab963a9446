"""How a chat body asks its conversation rendered, as vLLM takes it: ``chat_template_kwargs``
(template variables: Qwen3's ``enable_thinking``), ``add_generation_prompt`` and
``continue_final_message`` (the answer goes on from the last message's text). The answer is
the target's own to the prompt so rendered, on `specrt serve` (streamed or not) and in OpenAI
batch lines; bodies that cannot be rendered as asked are one 400 naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from specrt.chat import ChatTemplate, ChatTemplateError, Rendering, read_rendering
from specrt.errors import RequestError
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from tests.test_batch_job import chat_bundle, command, run
from tests.test_serve import running_server

# Qwen3's switch, in the tiny template's words: no thinking asked, an empty think block.
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)
ASK = [{"role": "user", "content": "def f"}]
BEGUN = [*ASK, {"role": "assistant", "content": "def f(x):"}]  # a reply begun for the model
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def rendered(messages: list[dict], body: dict) -> str:
    return ChatTemplate(TEMPLATE).prompt(messages, None, read_rendering(body)[0])


def test_the_fields_reach_the_template_and_cut_a_continued_message():
    assert rendered(ASK, {}) == "<user>def f\n<assistant>"
    assert rendered(ASK, NO_THINKING) == "<user>def f\n<assistant><think></think>"
    assert rendered(ASK, {"add_generation_prompt": False}) == "<user>def f\n"
    # the last message stays open: no newline, no new turn after its text
    assert rendered(BEGUN, CONTINUE) == "<user>def f\n<assistant>def f(x):"
    trims = ChatTemplate(TEMPLATE.replace("{{ m.content }}", "{{ m.content | trim }}"))
    spaced = [*ASK, {"role": "assistant", "content": "def f(x): "}]
    continued = Rendering(add_generation_prompt=False, continue_final_message=True)
    assert trims.prompt(spaced, None, continued) == "<user>def f\n<assistant>def f(x):"
    for text in ("", "   "):
        with pytest.raises(ChatTemplateError, match="nothing to continue"):
            trims.prompt([*ASK, {"role": "assistant", "content": text}], None, continued)
    _, rest = read_rendering({**NO_THINKING, **CONTINUE, "messages": ASK})
    assert rest == {"messages": ASK}  # read_request sees the rest only


@pytest.mark.parametrize(
    "body, field, words",
    [
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "an object"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "'messages'"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs",
         "its own field"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt", "true or false"),
        ({"continue_final_message": True}, "continue_final_message",
         "add_generation_prompt: false"),
    ],
)  # fmt: skip
def test_bodies_that_cannot_be_rendered_as_asked_are_refused_naming_the_field(body, field, words):
    with pytest.raises(RequestError, match=words) as caught:
        read_rendering(body)
    assert caught.value.param == field


@pytest.fixture(scope="module")
def bundle(llama_bundle, tmp_path_factory):
    return chat_bundle(llama_bundle, tmp_path_factory.mktemp("rendering"), TEMPLATE)


@pytest.fixture(scope="module")
def generator(bundle):
    return SpeculativeGenerator.from_bundle(bundle, threads=1)


def alone(generator, text: str, tokens: int = 10):
    ids = generator.tokenizer.encode(text, add_special_tokens=False)
    config = GenerationConfig(max_new_tokens=tokens, num_draft_tokens=0, ignore_eos=True)
    [result] = generator.generate([ids], config)
    return ids, result


def test_the_server_answers_the_prompt_rendered_as_the_body_asks(bundle, generator):
    with running_server(bundle) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for messages, fields in [(ASK, NO_THINKING), (BEGUN, CONTINUE), (ASK, {})]:
            ids, want = alone(generator, rendered(messages, fields))
            reply = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=10,
                extra_body={**fields, "ignore_eos": True},
            )  # fmt: skip
            assert reply.usage.prompt_tokens == len(ids)
            assert reply.choices[0].message.content == want.text
            chunks = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=10, stream=True,
                extra_body={**fields, "ignore_eos": True},
            )  # fmt: skip
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
        assert len(rendered(ASK, NO_THINKING)) > len(rendered(ASK, {}))  # the kwarg counted
        refusals = [
            ("chat/completions", {"messages": ASK, "continue_final_message": True},
             "continue_final_message"),
            ("chat/completions", {"messages": ASK, "chat_template_kwargs": {"tools": []}},
             "chat_template_kwargs"),
            ("chat/completions", {"messages": [*ASK, {"role": "assistant", "content": ""}],
                                  **CONTINUE}, "messages"),
            ("completions", {"prompt": "def f", **NO_THINKING}, "chat_template_kwargs"),
        ]  # fmt: skip
        for route, body, field in refusals:
            bad = httpx.post(f"{url}/v1/{route}", json=body)
            error = bad.json()["error"]
            assert bad.status_code == 400 and error["param"] == field, error
        assert "a completion's prompt is sent as it is" in error["message"]


def test_openai_batch_lines_are_rendered_as_their_bodies_ask(bundle, generator, tmp_path):
    lines = [
        {"custom_id": name, "url": "/v1/chat/completions",
         "body": {"messages": messages, "max_tokens": 10, "ignore_eos": True, **fields}}
        for name, messages, fields in [("think", ASK, NO_THINKING), ("go on", BEGUN, CONTINUE)]
    ]  # fmt: skip
    lines.append({"custom_id": "bad", "body": {"messages": ASK, "continue_final_message": 1}})
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = run(command(bundle, path, tmp_path / "out.jsonl"))
    assert done.returncode == 1, done.stderr  # the bad line
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    got = {line["custom_id"]: line for line in lines}  # OpenAI's batch output form
    for name, messages, fields in [("think", ASK, NO_THINKING), ("go on", BEGUN, CONTINUE)]:
        ids, want = alone(generator, rendered(messages, fields))
        body = got[name]["response"]["body"]
        assert body["choices"][0]["message"]["content"] == want.text
        assert body["usage"]["prompt_tokens"] == len(ids)
    assert "continue_final_message=1: use true or false" in got["bad"]["error"]["message"]


def test_our_own_chat_lines_take_the_fields_too():
    """specrt's own batch lines (and Ray Data rows) with "messages" read the fields as an
    OpenAI body does; a "prompt" line with one of them is told it is sent as it is."""
    from specrt.jobs.rows import row_from_item

    row = row_from_item({"id": "a", "messages": BEGUN, **CONTINUE, **NO_THINKING}, "line 1")
    assert row.error is None and row.rendering == read_rendering({**CONTINUE, **NO_THINKING})[0]
    bad = row_from_item({"id": "b", "messages": ASK, "continue_final_message": True}, "line 2")
    assert "add_generation_prompt: false" in bad.error
    plain = row_from_item({"id": "c", "prompt": "def f", **NO_THINKING}, "line 3")
    assert (
        plain.error == 'chat_template_kwargs renders chat "messages": a "prompt" is sent as it is'
    )


def test_a_template_given_inline_may_be_longer_than_a_file_name(tmp_path):
    """A real template is thousands of characters: past what a file name may hold (the check
    for a file raised ENAMETOOLONG), it is the template itself."""
    from specrt.chat import template_text

    long = TEMPLATE + "{# " + "x" * 5000 + " #}"
    assert template_text(long) == long
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert template_text(str(path)) == TEMPLATE


def test_a_chat_template_given_renders_in_place_of_the_bundles(llama_bundle, tmp_path):
    """``--chat-template`` (vLLM's flag: a Jinja file, or the template itself) on serve, batch
    and generate --chat: a bundle without a template (the tiny one) chats with it, and the
    answer is the target's to the prompt it renders. One that is neither a file nor a template,
    or that does not compile, stops the command in one line before any work."""
    from click.testing import CliRunner

    from specrt.cli import main

    source = tmp_path / "template.jinja"
    source.write_text(TEMPLATE)
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    ids, want = alone(generator, rendered(ASK, NO_THINKING))
    with running_server(llama_bundle, "--chat-template", str(source)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=10,
            extra_body={**NO_THINKING, "ignore_eos": True},
        )
        assert reply.choices[0].message.content == want.text
        assert reply.usage.prompt_tokens == len(ids)
    line = {"custom_id": "c", "body": {"messages": ASK, "max_tokens": 10, **NO_THINKING}}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(line) + "\n")
    done = run(command(llama_bundle, path, tmp_path / "out.jsonl", "--chat-template", TEMPLATE))
    assert done.returncode == 0, done.stderr
    body = json.loads((tmp_path / "out.jsonl").read_text())["response"]["body"]
    assert body["choices"][0]["message"]["content"] == want.text
    options = ["--max-new-tokens", "10", "--ignore-eos", "--json"]
    args = ["generate", "--bundle", str(llama_bundle), "--prompt", "def f", *options]
    result = CliRunner().invoke(main, [*args, "--chat", "--chat-template", TEMPLATE])
    assert result.exit_code == 0, result.output
    _, plain = alone(generator, rendered(ASK, {}))
    assert json.loads(result.output)["token_ids"] == plain.token_ids
    for given, words in [
        ("templates/none.jinja", "no such file, nor a template"),
        ("{% for m in messages %}", "--chat-template: "),
    ]:
        bad = CliRunner().invoke(main, [*args, "--chat", "--chat-template", given])
        assert bad.exit_code == 2 and words in bad.output, bad.output
        assert "Traceback" not in bad.output
    for command_args in (  # the server and a batch job: before they load the bundle
        ["serve", "--bundle", str(llama_bundle), "--port", "0"],
        ["batch", "--bundle", str(llama_bundle), "--input", str(path), "--output",
         str(tmp_path / "never.jsonl")],
    ):  # fmt: skip
        bad = CliRunner().invoke(main, [*command_args, "--chat-template", "none.jinja"])
        assert bad.exit_code == 2 and "no such file, nor a template" in bad.output, bad.output
    assert not (tmp_path / "never.jsonl").exists()
    alone_flag = CliRunner().invoke(main, [*args, "--chat-template", TEMPLATE])
    assert alone_flag.exit_code == 2 and "give --chat with it" in alone_flag.output
