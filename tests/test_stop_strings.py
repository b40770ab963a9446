"""Stop strings end a row where its new text first contains one, whatever round emits it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specrt.errors import InvalidInputError
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from specrt.runtime.batching import Request
from specrt.runtime.stopping import StopStrings
from tests.test_greedy import PROMPTS


def chars(ids: list[int]) -> str:
    """A toy tokenizer: token i is the i-th letter, token 26 is "ab"."""
    return "".join("ab" if i == 26 else chr(ord("a") + i) for i in ids)


@pytest.mark.parametrize(
    ("rounds", "stops", "expected"),
    [
        ([[0, 1], [2, 3]], ["cd"], (4, "ab")),  # the stop string is a whole round
        ([[0, 1, 2], [3, 4]], ["cd"], (4, "ab")),  # it spans two rounds
        ([[7, 26, 4]], ["a"], (2, "h")),  # it starts inside a token
        ([[0, 1, 2, 3]], ["d", "bc"], (3, "a")),  # the earliest stop string wins
        ([[0, 1], [2], [3]], ["x"], None),  # never there
    ],
)
def test_stop_strings_are_found_across_rounds(rounds, stops, expected):
    for included in (False, True):  # vLLM's include_stop_str_in_output: the text ends after it
        stopper, ids, found = StopStrings(stops, chars, included), [], None
        for emitted in rounds:
            ids = ids + emitted
            found = stopper.check(ids)
            if found:
                break
        if expected is None or not included:
            assert found == expected
            continue
        text = chars(ids[: found[0]])
        stop = min((s for s in stops if s in text), key=lambda s: (text.find(s), len(s)))
        assert found == (expected[0], text[: text.find(stop) + len(stop)])


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_stops_before_the_stop_string(llama_bundle, batch):
    """Cut a target-only output at a stop string taken from its middle: the speculative run,
    one row at a time or batched, stops exactly there."""
    alone = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    base = alone.generate(PROMPTS[:8], GenerationConfig(max_new_tokens=24, num_draft_tokens=0))
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=batch)
    checked = 0
    for prompt, full in zip(PROMPTS[:8], base):
        if len(full.text) < 12:
            continue
        stop = full.text[6:9]
        config = GenerationConfig(max_new_tokens=24, num_draft_tokens=4, stop=[stop])
        [result] = generator.generate([prompt], config)
        assert result.finish_reason == "stop"
        assert result.text == full.text[: full.text.find(stop)]
        assert stop not in result.text
        assert result.token_ids == full.token_ids[: len(result.token_ids)]
        assert stop in alone.tokenizer.decode(result.token_ids)  # the last token completed it
        assert stop not in alone.tokenizer.decode(result.token_ids[:-1])
        [kept] = generator.generate([prompt], replace(config, include_stop_str_in_output=True))
        assert kept.token_ids == result.token_ids and kept.text == result.text + stop
        checked += 1
    assert checked >= 3


def test_bad_stop_strings_are_refused():
    for bad in ([""], [3], "", {"a": 1}):
        with pytest.raises(InvalidInputError, match="stop"):
            GenerationConfig(stop=bad)
    assert GenerationConfig(stop="\n").stop == ("\n",)
    # bounded: each is matched at every token, in the loop every row shares
    for many in (["x"] * 65, ["y" * 4097]):
        with pytest.raises(InvalidInputError, match="give at most 64 stop strings of 4096"):
            GenerationConfig(stop=many)
    assert len(GenerationConfig(stop=["x"] * 64).stop) == 64


@pytest.mark.parametrize("batch", [1, 4])
def test_stop_token_ids_end_a_row_at_the_first_one(llama_bundle, batch):
    """``stop_token_ids`` (vLLM's): a target-only output cut at the first of a token taken
    from its middle, which it keeps in its tokens and, as vLLM, not in its text (but with
    ``include_stop_str_in_output``), whatever round emits it; with EOS ignored too. Rows
    beside it without the stop run on."""
    alone = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=0, ignore_eos=True)
    base = alone.generate(PROMPTS[:8], config)
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=batch)
    for prompt, full in zip(PROMPTS[:8], base):
        stop = full.token_ids[5]
        end = full.token_ids.index(stop) + 1
        spec = GenerationConfig(max_new_tokens=24, num_draft_tokens=4, ignore_eos=True)
        [ids] = generator.encode_prompts([prompt])
        stopped = replace(spec, stop_token_ids=[stop])
        configs = [stopped, spec, replace(stopped, include_stop_str_in_output=True)]
        ran = dict(generator.run(Request(i, ids, c) for i, c in enumerate(configs)))
        rows = [ran[0], ran[1], ran[2]]
        assert rows[0].token_ids == full.token_ids[:end] and rows[0].finish_reason == "stop"
        assert rows[0].text == alone.tokenizer.decode(full.token_ids[: end - 1])
        assert rows[1].token_ids == full.token_ids and rows[1].finish_reason == "length"
        assert rows[2].token_ids == rows[0].token_ids
        assert rows[2].text == alone.tokenizer.decode(full.token_ids[:end])


def test_bad_stop_token_ids_are_refused():
    for bad in ([-1], ["a"], 3, [True], [1.0], list(range(65))):
        with pytest.raises(InvalidInputError, match="stop_token_ids=") as caught:
            GenerationConfig(stop_token_ids=bad)
        assert caught.value.field == "stop_token_ids"
    assert GenerationConfig(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_special_tokens_are_written_where_asked_but_the_one_that_ends_the_row(llama_bundle):
    """``skip_special_tokens=False`` (vLLM's) writes special tokens into the text, streamed or
    not, but for the EOS that ends a row (left out, as vLLM leaves it); the tokens are the same
    either way. A bias makes the tiny model write its EOS."""
    from specrt.runtime.service import Service

    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    eos = min(generator.eos_token_ids)
    written = generator.tokenizer.decode([eos], skip_special_tokens=False)
    assert written and generator.tokenizer.decode([eos]) == ""  # a special token
    base = dict(max_new_tokens=4, logit_bias={eos: 100.0}, num_draft_tokens=2)
    shown = GenerationConfig(**base, ignore_eos=True, skip_special_tokens=False)
    [every] = generator.generate(["Simple is"], shown)
    assert every.token_ids == [eos] * 4 and every.text == written * 4
    [skipped] = generator.generate(["Simple is"], replace(shown, skip_special_tokens=True))
    assert skipped.token_ids == every.token_ids and skipped.text == ""
    ended = GenerationConfig(**base, min_tokens=2, skip_special_tokens=False)
    [last] = generator.generate(["Simple is"], ended)
    assert last.token_ids[-1] == eos and len(last.token_ids) == 3
    assert last.text == generator.tokenizer.decode(last.token_ids[:-1]) and written not in last.text
    with Service(generator) as service:
        for config, want in [(shown, every.text), (ended, last.text)]:
            handle = service.submit("Simple is", config)
            assert "".join(delta.text for delta in handle.deltas()) == want
            assert handle.result().text == want
    with pytest.raises(InvalidInputError, match="skip_special_tokens"):
        GenerationConfig(skip_special_tokens="no")
