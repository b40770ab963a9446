"""Tool calling on `specrt serve`'s chat route: a call the body requires (``tool_choice``
``"required"`` or a named function) is the target's own answer under the JSON schema of the
tools' parameters, given back as ``tool_calls``, streamed or not; ``"none"`` answers in text;
the tools reach a chat template that writes them. Bodies specrt cannot answer as asked are one
400 naming the field. On the demo pair: its byte-level tokenizer writes JSON (the tiny one
writes no braces)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from specrt.chat import ChatTemplate
from specrt.openai_tools import StreamedText, read_tools, with_tools
from specrt.runtime import GenerationConfig, SpeculativeGenerator, StructuredOutput
from tests.test_serve import running_server

# writes the tools as JSON before the conversation, as tool-calling templates do
TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "now"}}  # no parameters
TOOLS = [WEATHER, CLOCK]
MESSAGES = [{"role": "user", "content": "def weather(city):"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tools_bundle(demo_bundle, tmp_path_factory) -> Path:
    """The demo bundle with `TEMPLATE` as its chat template."""
    bundle = tmp_path_factory.mktemp("tools") / "demo"
    shutil.copytree(demo_bundle, bundle)
    (bundle / "tokenizer" / "chat_template.jinja").write_text(TEMPLATE)
    return bundle


@pytest.fixture(scope="module")
def served(tools_bundle):
    with running_server(tools_bundle) as (url, _):
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def generator(tools_bundle):
    return SpeculativeGenerator.from_bundle(tools_bundle, threads=1)


def expected(generator, structured: StructuredOutput | None, max_tokens: int = 40):
    """What `generate` answers to `MESSAGES` rendered with `TOOLS`, under ``structured``."""
    text = ChatTemplate(TEMPLATE).prompt(MESSAGES, TOOLS)
    assert text.startswith("<tools>[") and '"get_weather"' in text  # the template wrote them
    ids = generator.tokenizer.encode(text, add_special_tokens=False)
    config = GenerationConfig(max_new_tokens=max_tokens, structured_output=structured)
    [result] = generator.generate([ids], config)
    return result


def test_a_named_function_is_called_with_the_targets_own_arguments(served, generator):
    _, client = served
    want = expected(generator, read_tools({"tools": TOOLS, "tool_choice": NAMED})[0]
                    .structured_output())  # fmt: skip
    assert json.loads(want.text)["city"]  # the scenario: a whole call within max_tokens
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=40
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and call.function.arguments == want.text.strip()
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=40,
            stream=True,
        )
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)
    [streamed] = [call for d in deltas for call in d.tool_calls or []]
    assert streamed.index == 0 and streamed.function.name == "get_weather"
    assert streamed.function.arguments == want.text.strip()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_calls_one_of_the_tools_and_none_answers_in_text(served, generator):
    _, client = served
    # One call: the demo target, a code model, would list calls until max_tokens
    one = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    want = expected(generator, read_tools(one)[0].structured_output(), max_tokens=60)
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, **one)
    calls = reply.choices[0].message.tool_calls
    assert want.finish_reason == "stop" and len(calls) == 1  # the scenario: a whole call
    assert reply.choices[0].finish_reason == "tool_calls"
    written = [{"name": c["name"], "arguments": c["arguments"]} for c in json.loads(want.text)]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (c["name"], c["arguments"]) for c in written
    ]
    assert {c.function.name for c in calls} <= {"get_weather", "now"}
    plain = expected(generator, None, max_tokens=12)
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=12
    )
    assert reply.choices[0].message.content == plain.text
    assert reply.choices[0].message.tool_calls is None
    chunks = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=12,
        stream=True,
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.text


def test_a_call_cut_short_comes_back_as_text_and_a_turn_after_a_call_renders(served):
    _, client = served
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=3
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content  # what was written of the call
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    turn = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    reply = client.chat.completions.create(
        model="tiny", messages=turn, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": TOOLS}, "tool_choice", 'tool_choice "auto" (the default with tools)'),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--tool-call-parser hermes"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [{"name": "f"}]}, "tools", "each tool is"),
        ({"tools": [CLOCK, CLOCK], "tool_choice": "required"}, "tools", "twice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice", "naming one of"),
        ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": 1},
         "parallel_tool_calls", "true or false"),
        ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
         "response_format", "give one"),
        ({"tools": TOOLS, "tool_choice": NAMED, "logprobs": True}, "logprobs", "not supported"),
    ],
)  # fmt: skip
def test_a_body_specrt_cannot_answer_as_asked_is_one_400(served, body, param, words):
    url, _ = served
    raw = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, **body}, timeout=30)
    error = raw.json()["error"]
    assert raw.status_code == 400 and words in error["message"], raw.text
    assert error["param"] == param, raw.text


def test_batch_files_take_tools_as_the_server_does(tools_bundle, generator, tmp_path):
    """`specrt batch` on OpenAI batch lines: a named call comes back as the server gives it,
    a body the server refuses is that line's 400, and the other lines go on; with
    --tool-call-parser, "auto" reads the model's own calls."""
    import subprocess
    import sys

    want = expected(generator, read_tools({"tools": TOOLS, "tool_choice": NAMED})[0]
                    .structured_output())  # fmt: skip
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 40}
    lines = [
        {"custom_id": "named", "url": "/v1/chat/completions",
         "body": {**body, "tool_choice": NAMED}},
        {"custom_id": "auto", "url": "/v1/chat/completions", "body": body},
    ]  # fmt: skip
    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    args = ["batch", "--bundle", str(tools_bundle), "--input", str(rows), "--output", str(out),
            "--threads", "1"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "specrt.cli", *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr  # a row failed
    written = {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}
    choice = written["named"]["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": want.text.strip()}
    refused = written["auto"]["response"]
    assert (
        refused["status_code"] == 400
        and "--tool-call-parser hermes" in refused["body"]["error"]["message"]
    )
    # told the format, "auto" reads the model's own call (a regex makes the demo model write one)
    regex = 'Hi[.]<tool_call>[{]"name":"now","arguments":[{][}][}]</tool_call>'
    rows.write_text(json.dumps({**lines[1], "body": {**body, "guided_regex": regex}}) + "\n")
    out.unlink()
    done = subprocess.run(
        [sys.executable, "-m", "specrt.cli", *args, "--tool-call-parser", "hermes"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    message = json.loads(out.read_text())["response"]["body"]["choices"][0]["message"]
    assert message["content"] == "Hi." and message["tool_calls"][0]["function"] == {
        "name": "now", "arguments": "{}"
    }  # fmt: skip


def test_hermes_calls_are_read_out_of_the_text_and_held_back_while_streaming():
    """``tool_choice: "auto"`` with the hermes parser: calls in ``<tool_call>`` tags, the text
    before them the content; a call cut short (no closing tag) or not JSON leaves the answer
    text. Streamed, the text goes out as it comes but for the tags and what follows them, and
    an end that may be a tag's start waits until it is not."""
    hermes = read_tools({"tools": TOOLS}, "hermes")[0]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, [one] = hermes.reply("Let me look." + call)
    assert content == "Let me look." and one["function"] == {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'
    }  # fmt: skip
    content, calls = hermes.reply(call + "\n" + call.replace("Oslo", "Rome"))
    assert content is None and [c["function"]["arguments"] for c in calls] == [
        '{"city": "Oslo"}', '{"city": "Rome"}'
    ]  # fmt: skip
    for text in ("no call", "a" + call[:-3], "<tool_call>{not json}</tool_call>"):
        assert hermes.reply(text) is None, text
    streamed = StreamedText(hermes)
    assert [streamed.push(part) for part in ("Let me", " look.<tool", "_call>\n{", '"x"')] == [
        "Let me", " look.", "", ""
    ]  # fmt: skip
    rest, calls = streamed.finish("Let me look." + call)
    assert rest == "" and [c["function"] for c in calls] == [one["function"]]
    plain = StreamedText(hermes)
    assert [plain.push(part) for part in ("a <to", "ast> b")] == ["a ", "<toast> b"]
    assert plain.finish("a <toast> b") == ("", None)


def test_llama3_json_and_pythonic_calls_are_the_whole_answer_and_held_while_they_may_be():
    """Llama's formats, as vLLM's parsers of those names read them: an answer that is JSON
    objects ``{"name", "parameters"}`` separated by ``;`` (after Llama's python tag, where a
    tokenizer writes it), or a Python list of calls with keyword arguments; anything else,
    a call cut short or text before the calls included, is text. Streamed, nothing goes out
    while the answer may be calls (blank so far, or beginning as they do)."""
    llama = read_tools({"tools": TOOLS}, "llama3_json")[0]
    oslo = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    content, calls = llama.reply(f" {oslo}; {oslo.replace('Oslo', 'Rome')}")
    assert content is None and [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    ]
    [now] = llama.reply('<|python_tag|>{"name": "now", "arguments": {}}')[1]
    assert now["function"] == {"name": "now", "arguments": "{}"}
    for text in ("The weather: " + oslo, oslo[:-2], oslo + " and more", '{"city": 1}', "{}"):
        assert llama.reply(text) is None, text
    pythonic = read_tools({"tools": TOOLS}, "pythonic")[0]
    content, calls = pythonic.reply('[get_weather(city="Oslo"), now()]')
    assert content is None and [(c["function"]["name"], c["function"]["arguments"])
                                for c in calls] == [("get_weather", '{"city": "Oslo"}'),
                                                    ("now", "{}")]  # fmt: skip
    for text in ("[1, 2]", "[f(1)]", "[f(**x)]", "[f(x=open())]", '[get_weather(city="Os', "no"):
        assert pythonic.reply(text) is None, text
    for tooling, parts, call in [
        (llama, ["  ", "{", '"name": "now", "arguments": {}}'],
         '  {"name": "now", "arguments": {}}'),
        (llama, ["<|py", "thon_tag|>", '{"name": "now", "arguments": {}}'],
         '<|python_tag|>{"name": "now", "arguments": {}}'),
        (pythonic, ["\n", "[now", "()]"], "\n[now()]"),
    ]:  # fmt: skip
        streamed = StreamedText(tooling)
        assert [streamed.push(part) for part in parts] == ["", "", ""]
        rest, [made] = streamed.finish(call)
        assert rest == "" and made["function"]["name"] == "now"
    text = StreamedText(llama)  # text: it goes out as it comes once its first character says so
    assert [text.push(part) for part in (" ", "Hi", " there")] == ["", " Hi", " there"]
    assert text.finish(" Hi there") == ("", None)
    cut = StreamedText(pythonic)  # a call cut short: the text, held, goes out at the end
    assert [cut.push(part) for part in ("[now(", "")] == ["", ""]
    assert cut.finish("[now(") == ("[now(", None)


def test_mistral_calls_follow_their_special_tag_which_the_text_then_shows():
    """Mistral's format: ``[TOOL_CALLS]`` then a JSON array of calls (tokenizers up to v7),
    or ``name[ARGS]{...}`` after each tag (v11 on), the text before the first tag the content.
    The tag is a special token, so a request read in this format writes special tokens into
    its text (``skip_special_tokens`` false, as vLLM's parser asks); streamed, text goes out
    up to the tag, and an end that may be its start waits."""
    mistral = read_tools({"tools": TOOLS}, "mistral")[0]
    array = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "now"'
    content, calls = mistral.reply("Sure. " + array + ', "arguments": {}}]')
    assert content == "Sure. " and [(c["function"]["name"], c["function"]["arguments"])
                                     for c in calls] == [("get_weather", '{"city": "Oslo"}'),
                                                         ("now", "{}")]  # fmt: skip
    _, calls = mistral.reply('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]now[ARGS]{}')
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Rome"}', "{}"]
    for text in ("no call", array, "[TOOL_CALLS]now[ARGS]{", "[TOOL_CALLS]now"):
        assert mistral.reply(text) is None, text
    assert with_tools(mistral, {})["skip_special_tokens"] is False
    assert "skip_special_tokens" not in with_tools(read_tools({"tools": TOOLS}, "hermes")[0], {})
    streamed = StreamedText(mistral)
    assert [streamed.push(part) for part in ("Sure. [TOOL", "_CALLS][", "{")] == ["Sure. ", "", ""]


@pytest.mark.parametrize(
    ("parser", "regex", "content"),
    [
        ("hermes", 'Hi[.]<tool_call>[{]"name":"now","arguments":[{][}][}]</tool_call>', "Hi."),
        ("llama3_json", '[{]"name":"now","parameters":[{][}][}]', None),
        ("pythonic", r"\[now\(\)\]", None),
        ("mistral", r'Hi[.]\[TOOL_CALLS\]\[[{]"name":"now","arguments":[{][}][}]\]', "Hi."),
    ],
)
def test_auto_on_a_server_told_the_format_gives_the_models_own_calls(
    tools_bundle, parser, regex, content
):
    """`specrt serve --tool-call-parser P`: "auto" (the default with tools) answers with the
    calls the model wrote in P's format, streamed or not; here a regex makes the demo model
    write one."""
    with running_server(tools_bundle, "--tool-call-parser", parser) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=60,
                    extra_body={"guided_regex": regex})  # fmt: skip
        choice = client.chat.completions.create(**args).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == content
        [made] = choice.message.tool_calls
        assert (made.function.name, made.function.arguments) == ("now", "{}")
        chunks = [c for c in client.chat.completions.create(**args, stream=True) if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        [streamed] = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
        assert text == (content or "") and streamed.function.name == "now"
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        plain = client.chat.completions.create(**{**args, "extra_body": {"guided_regex": "Hi!"}})
        assert plain.choices[0].message.content == "Hi!"
        assert plain.choices[0].message.tool_calls is None
