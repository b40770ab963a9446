"""Structured output (`specrt.runtime.grammar`): the masks at each position of a verification
pass against llguidance's own matcher fed token by token; greedy output, speculative or not,
against a decode written out here over the portable graph with those masks; the sampled law
of the first three tokens under a grammar (chi-square); JSON answers that parse; refusals.

False-alarm rate: 4 chi-square tests at ALPHA = 1e-4 each, so a correct implementation fails
this module by chance with probability at most 4e-4 (seeds are fixed: an outcome repeats)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import llguidance
import numpy as np
import pytest

from specrt.errors import InvalidInputError, NumericalError
from specrt.runtime import GenerationConfig, SpeculativeGenerator, StructuredOutput
from specrt.runtime.batching import Request
from specrt.runtime.grammar import row_grammar
from specrt.runtime.sampling import warp
from tests.conftest import build_bundle, generator_paths
from tests.stats import chi_square_pvalue
from tests.test_greedy import PROMPTS

ALPHA = 1e-4
SAMPLES = 3000
# Letters, spaces and a few signs the tiny pairs' character tokenizer writes: a grammar that
# keeps several tokens open at each position, and one that branches and ends.
WORDS = StructuredOutput(regex=r"[a-p ]{3,40}")
ENDS = StructuredOutput(regex=r"(cab|bad|ace)( (cab|bad|ace)){0,3}\.")


def matcher(generator, structured: StructuredOutput):
    """llguidance's own matcher over the generator's tokenizer: the reference."""
    eos = tuple(sorted(generator.eos_token_ids))
    tokenizer = generator.tokenizer.guidance(eos, generator.target.vocab_size)
    return llguidance.LLMatcher(tokenizer, structured.spec, log_level=0)


def allowed_after(generator, structured: StructuredOutput, tokens: list[int]) -> np.ndarray | None:
    """The tokens the grammar allows after ``tokens`` (a fresh matcher fed them one by one);
    None where ``tokens`` break it."""
    reference = matcher(generator, structured)
    for token in tokens:
        if reference.is_stopped():
            break
        if not reference.consume_token(token):
            return None
    bits = np.frombuffer(reference.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[: generator.target.vocab_size].astype(bool)


@pytest.fixture(scope="module")
def generators(llama_bundle):
    return generator_paths(llama_bundle)


@pytest.mark.parametrize("structured", [WORDS, ENDS], ids=["words", "ends"])
def test_each_position_is_masked_as_the_grammar_says(generators, structured):
    """`GrammarState.apply` over a verification pass: row j -inf exactly where the grammar
    refuses a token after the row's tokens and the proposal's first j (a fresh matcher fed
    them one by one), rows past a refused proposed token untouched; its calls in any order
    (a round rolled back, a row's next round) as if each were its first."""
    generator = generators["one row"]
    vocab = generator.target.vocab_size
    config = GenerationConfig(structured_output=structured)
    state = row_grammar(config, generator.tokenizer, generator.eos_token_ids, vocab)
    rng = np.random.default_rng(4)
    pieces = generator.tokenizer._tokenizer.token_to_id  # a character a token (no "▁" first)
    texts = ["cab bad ace.", "cab ba", "ace", "hello world", "bad cab ace bad."]
    checked = 0
    for trial in range(60):
        text = texts[trial % len(texts)]
        ids = [pieces("▁" if c == " " else c) for c in text]
        cut = int(rng.integers(0, len(ids)))
        generated, proposal = ids[:cut], ids[cut : cut + int(rng.integers(0, 5))]
        if rng.random() < 0.3 and proposal:  # a proposed token the grammar may refuse
            proposal[-1] = int(rng.integers(3, vocab))
        if allowed_after(generators["one row"], structured, generated) is None:
            continue
        logits = rng.normal(size=(len(proposal) + 1, vocab)).astype(np.float32)
        given = logits.copy()
        state.apply(given, generated, proposal)
        for j in range(len(proposal) + 1):
            allowed = allowed_after(generator, structured, generated + proposal[:j])
            if allowed is None:  # past a refused token: left as it was
                assert np.array_equal(given[j], logits[j]), (trial, j)
                break
            assert np.array_equal(np.isfinite(given[j]), allowed), (trial, j)
            assert np.array_equal(given[j][allowed], logits[j][allowed])
            checked += 1
    assert checked > 100


def reference_greedy(portable, prompt: list[int], steps: int, structured) -> list[int]:
    """Greedy tokens of the target under the grammar: a full pass without cache per step, each
    step's logits masked by llguidance's matcher, the chosen token fed to it; EOS ends."""
    spec, session, vocab = portable.target.spec, portable.target.session, portable.target.vocab_size
    reference, tokens = matcher(portable, structured), list(prompt)
    empty = np.zeros((1, spec.num_kv_heads, 0, spec.head_dim), np.float32)
    for _ in range(steps):
        feed = {
            spec.io.input_ids: np.array([tokens], dtype=np.int64),
            spec.io.attention_mask: np.ones((1, len(tokens)), np.int64),
            spec.io.position_ids: np.arange(len(tokens))[None],
        }
        feed.update({name: empty for name in spec.io.past_keys + spec.io.past_values})
        logits = session.run([spec.io.logits], feed)[0][0, -1, :vocab]
        bits = np.frombuffer(reference.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)
        token = int(np.where(allowed, logits, -np.inf).argmax())
        tokens.append(token)
        if token in portable.eos_token_ids:
            break
        assert reference.consume_token(token)
    return tokens[len(prompt) :]


@pytest.mark.parametrize("structured", [WORDS, ENDS], ids=["words", "ends"])
def test_greedy_output_is_the_targets_under_the_grammar(generators, structured):
    """Under a grammar, greedy output is the target's under its masks, token for token: the
    target alone and speculative decoding (the draft model, prompt lookup and the hybrid, one
    row, and rows sharing calls beside rows without a grammar), as the decode written out here
    gives it; its text matches the grammar where it ends, and differs from the output without
    one (the test has power). Rows draft the tokens the grammar forces (kept, greedy or
    seeded), the target alone never."""
    prompts = PROMPTS[:4]
    encoded = generators["one row"].encode_prompts(prompts)
    expected = [reference_greedy(generators["portable"], ids, 24, structured) for ids in encoded]
    base = GenerationConfig(max_new_tokens=24, structured_output=structured)
    plain = generators["one row"].generate(prompts, replace(base, structured_output=None))
    assert any(p.token_ids != e for p, e in zip(plain, expected))
    for path in ("one row", "batched"):
        for proposer, k in (("model", 0), ("model", 3), ("lookup", 3), ("hybrid", 4)):
            config = replace(base, proposer=proposer, num_draft_tokens=k)
            got = generators[path].generate(prompts, config)
            assert [r.token_ids for r in got] == expected, (path, proposer, k)
            for result in got:
                pattern = structured.regex
                if result.finish_reason == "stop":
                    assert re.fullmatch(pattern, result.text), result.text
    if structured is ENDS:  # the grammar ends every answer: EOS right after its full stop
        assert all(e[-1] in generators["one row"].eos_token_ids for e in expected)
        # rows draft what the grammar forces ("ab" after "c"), alone or batched: all kept
        for path in ("one row", "batched"):
            ran = generators[path].generate(prompts, replace(base, num_draft_tokens=3))
            forced = [r.stats.proposers.get("grammar") for r in ran]
            assert any(forced) and all(f["accepted"] == f["proposed"] for f in forced if f)
        seeded = replace(base, temperature=1.0, seed=5)
        drafted = generators["one row"].generate(prompts, seeded)
        alone = generators["one row"].generate(prompts, replace(seeded, num_draft_tokens=0))
        assert [r.token_ids for r in drafted] == [r.token_ids for r in alone]
        assert not any("grammar" in r.stats.proposers for r in alone)  # the baseline's own
    requests = [Request(i, ids, base if i % 2 else replace(base, structured_output=None))
                for i, ids in enumerate(encoded)]  # fmt: skip
    ran = dict(generators["batched"].run(requests))
    assert [ran[i].token_ids for i in (1, 3)] == [expected[1], expected[3]]
    assert [ran[i].token_ids for i in (0, 2)] == [plain[0].token_ids, plain[2].token_ids]


def test_lark_grammar_and_choices(generators):
    """A Lark grammar and a list of choices hold the answer to them, speculative or not."""
    generator = generators["batched"]
    lark = StructuredOutput(grammar='start: "ab" ("c" | "d")+ "."')
    choices = StructuredOutput(choice=["cab", "cabbage", "ace"])
    for structured, check in (
        (lark, re.compile(r"ab[cd]+\.").fullmatch),
        (choices, {"cab", "cabbage", "ace"}.__contains__),
    ):
        for k in (0, 3):
            config = GenerationConfig(
                max_new_tokens=24, num_draft_tokens=k, structured_output=structured
            )
            for result in generator.generate(PROMPTS[:3], config):
                assert check(result.text) or result.finish_reason == "length", result.text


def test_json_schema_answers_parse(demo_bundle):
    """On the demo pair (a byte-level tokenizer that writes any text), a JSON schema's answer
    parses and has its fields, the same speculative or not; JSON mode's answer is an object
    as far as it goes. (The schema asks llguidance for no free whitespace: a model of Python
    code goes on indenting otherwise.)"""
    generator = SpeculativeGenerator.from_bundle(demo_bundle, threads=1)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }
    prompts = ["def main():\n    return ", "import json\n\nconfig = "]
    for structured in (StructuredOutput(json=schema), StructuredOutput(json_object=True)):
        outputs = {}
        for k in (0, 4):
            config = GenerationConfig(
                max_new_tokens=48, num_draft_tokens=k, structured_output=structured
            )
            results = generator.generate(prompts, config)
            outputs[k] = [r.token_ids for r in results]
            for result in results:
                if structured.json_object:
                    assert result.text.lstrip().startswith("{"), result.text
                    continue
                assert result.finish_reason == "stop", result.text
                answer = json.loads(result.text)
                assert set(answer) == {"n", "ok"} and isinstance(answer["ok"], bool)
                assert isinstance(answer["n"], int) and answer["n"] <= 99
        assert outputs[0] == outputs[4]


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory):
    bundle = build_bundle(
        tmp_path_factory.mktemp("grammar"), "pair", arch="llama", seed=5, peak=45, draft_noise=0.45
    )
    return {
        "one row": SpeculativeGenerator.from_bundle(bundle, threads=1),
        "batched": SpeculativeGenerator.from_bundle(bundle, threads=1, max_batch=8),
        "portable": SpeculativeGenerator.from_bundle(bundle, threads=1, engine="portable"),
    }


def law_under(portable, prompt: list[int], structured, temperature: float) -> list[np.ndarray]:
    """The exact marginal law of the first three new tokens under the grammar: every prefix of
    up to two tokens the grammar allows, one batched pass each, masked as llguidance says."""
    spec, session, vocab = portable.target.spec, portable.target.session, portable.target.vocab_size

    def following(prefixes: list[list[int]]) -> np.ndarray:
        rows = np.array([prompt + p for p in prefixes], dtype=np.int64)
        empty = np.zeros((len(rows), spec.num_kv_heads, 0, spec.head_dim), np.float32)
        feed = {
            spec.io.input_ids: rows,
            spec.io.attention_mask: np.ones(rows.shape, np.int64),
            spec.io.position_ids: np.tile(np.arange(rows.shape[1]), (len(rows), 1)),
        }
        feed.update({name: empty for name in spec.io.past_keys + spec.io.past_values})
        logits = session.run([spec.io.logits], feed)[0][:, -1, :vocab].astype(np.float64)
        for row, prefix in zip(logits, prefixes):
            row[~allowed_after(portable, structured, prefix)] = -np.inf
        return warp(logits, temperature)

    p1 = following([[]])[0]
    laws = [p1, np.zeros(vocab), np.zeros(vocab)]
    for t1 in np.flatnonzero(p1):
        p2 = following([[t1]])[0]
        laws[1] += p1[t1] * p2
        seconds = np.flatnonzero(p2)
        p3 = following([[t1, t2] for t2 in seconds])
        laws[2] += p1[t1] * (p2[seconds] @ p3)
    return laws


@pytest.mark.parametrize("path", ["one row", "batched"])
def test_sampled_tokens_follow_the_target_under_the_grammar(sampling_pair, path):
    """Sampled rows (rejection sampling against the masked distribution, the draft drafting
    under the same masks) follow the target's law under the grammar at each of the first
    three positions, with the draft model and the target alone; the grammar moves that law
    (the test has power), and seeded rows are the target alone's, one for one."""
    generator = sampling_pair[path]
    prompt = generator.encode_prompts(["Simple is"])[0]
    structured = StructuredOutput(regex=r"[a-p ]{4,40}")
    expected = law_under(sampling_pair["portable"], prompt, structured, 1.0)
    free = law_under(
        sampling_pair["portable"], prompt, StructuredOutput(regex=r"(?s:.{4,40})"), 1.0
    )
    assert max(np.abs(e - f).sum() for e, f in zip(expected, free)) > 0.3
    assert all(law.max() > 0.2 for law in expected)
    settings = dict(max_new_tokens=3, temperature=1.0, structured_output=structured,
                    proposer="model", draft_schedule="fixed")  # fmt: skip
    for k in (0, 2):
        config = GenerationConfig(num_draft_tokens=k, **settings)
        streams = [np.random.default_rng([7, k, i]) for i in range(SAMPLES)]
        ran = dict(generator.run(Request(i, prompt, config, s) for i, s in enumerate(streams)))
        samples = np.array([ran[i].token_ids for i in range(SAMPLES)])
        if k:
            accepted = sum(r.stats.accepted_tokens for r in ran.values())
            assert 0.2 < accepted / sum(r.stats.drafted_tokens for r in ran.values()) < 0.95
        for position in range(3):
            counts = np.bincount(samples[:, position], minlength=len(expected[position]))
            pvalue = chi_square_pvalue(counts, expected[position])
            assert pvalue > ALPHA, (k, position, pvalue)
    seeded = GenerationConfig(num_draft_tokens=0, seed=9, **settings)
    alone = generator.generate([prompt] * 200, seeded)
    drafted = generator.generate([prompt] * 200, replace(seeded, num_draft_tokens=2))
    assert [r.token_ids for r in alone] == [r.token_ids for r in drafted]


def test_a_grammar_the_vocabulary_cannot_write_fails_its_row_alone(generators):
    """The tiny tokenizer has no "{": a JSON answer has no way on. Its row fails with one line
    saying so; a row beside it without a grammar runs to its end."""
    generator = generators["batched"]
    json_mode = GenerationConfig(max_new_tokens=8, structured_output={"json_object": True})
    with pytest.raises(NumericalError, match="the structured output cannot go on"):
        generator.generate(PROMPTS[:1], json_mode)
    encoded = generator.encode_prompts(PROMPTS[:2])
    plain = replace(json_mode, structured_output=None)
    ran = dict(generator.run([Request(0, encoded[0], json_mode), Request(1, encoded[1], plain)]))
    assert ran[0].finish_reason == "error" and "cannot go on" in ran[0].error
    assert ran[1].finish_reason == "length" and len(ran[1].token_ids) == 8


def test_bad_structured_outputs_are_refused_naming_the_field(generators):
    cases = [
        (dict(regex="[a-", json_object=True), "give one of json, json_object, regex"),
        (dict(), "give one of json"),
        (dict(regex="[a-"), "does not compile"),
        (dict(grammar="start: missing_rule"), "does not compile"),
        (dict(choice=["a", ""]), "give non-empty strings"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(shape="x"), r"structured output with \[.shape.\]"),
    ]
    for given, words in cases:
        with pytest.raises(InvalidInputError, match=words) as caught:
            GenerationConfig(structured_output=given)
        assert caught.value.field == "structured_output", given
    for name, value in (("ignore_eos", True), ("min_tokens", 2)):
        with pytest.raises(InvalidInputError, match="cannot be combined with structured") as caught:
            GenerationConfig(structured_output={"regex": "a+"}, **{name: value})
        assert caught.value.field == name
    config = GenerationConfig(structured_output={"json": {"type": "object"}})
    assert config.structured_output == StructuredOutput(json='{"type": "object"}')
    assert hash(config)  # a config stays hashable


def test_the_command_line_takes_a_grammar_and_refuses_a_bad_one_in_one_line(llama_bundle, tmp_path):
    """`specrt generate --regex/--choice/--grammar/--json-schema`: the answer follows it, as the
    library's; a regex that does not compile, or a schema file that is not there, is a usage
    error (status 2) of one line."""
    from click.testing import CliRunner

    from specrt.cli import main

    base = ["generate", "--bundle", str(llama_bundle), "--prompt", "Simple is", "--json"]
    lark = tmp_path / "answer.lark"
    lark.write_text('start: "ab" ("c" | "d")+ "."\n')
    for option, pattern in [
        (["--regex", ENDS.regex], ENDS.regex),
        (["--choice", "cab", "--choice", "ace"], "cab|ace"),
        (["--grammar", str(lark)], r"ab[cd]+(\.|$)"),  # (it may run to the length)
    ]:
        result = CliRunner().invoke(main, [*base, *option, "--max-new-tokens", "24"])
        assert result.exit_code == 0, result.output
        record = json.loads(result.output)
        assert re.fullmatch(pattern, record["text"]), record
    for option, words in [
        (["--regex", "[a-"], "does not compile"),
        (["--json-schema", str(tmp_path / "none.json")], "no such file"),
        (["--regex", "a+", "--choice", "a"], "give one of json, json_object, regex"),
    ]:
        result = CliRunner().invoke(main, [*base, *option])
        assert result.exit_code == 2 and words in result.output, result.output
        assert "Traceback" not in result.output
        assert len([line for line in result.output.splitlines() if line.startswith("Error")]) == 1


def test_a_match_is_cut_where_the_grammar_refuses_a_token(generators):
    """Prompt lookup's match is verified only as far as the grammar allows: a refused token
    would be rejected, so verifying it (and the rest) is work for nothing."""
    from specrt.runtime.lookup import NgramIndex
    from specrt.runtime.planning import _match
    from specrt.runtime.requests import Row

    generator = generators["one row"]
    pieces = generator.tokenizer._tokenizer.token_to_id
    ids = [pieces("▁" if c == " " else c) for c in "cab bad. cab bax"]
    prompt, output = ids[:9], ids[9:12]  # "cab bad. ", then "cab" written
    config = GenerationConfig(max_new_tokens=24, structured_output=ENDS)
    for structured, expected in ((ENDS, " bad."), (None, " bad. ca")):
        request = Request(0, prompt, replace(config, structured_output=structured))
        row = Row(request, prompt + output, 64, True, None, 0.0)
        row.round.processors = request.config.processors_for(
            generator.eos_token_ids,
            row_grammar(request.config, generator.tokenizer, generator.eos_token_ids, 47),
        )
        row.index = NgramIndex(1, 3)
        row.index.prompt_length = len(prompt)
        found = _match(row, None, 8, 0)
        text = "".join(" " if t == pieces("▁") else generator.tokenizer._tokenizer.id_to_token(t)
                       for t in found.tokens)  # fmt: skip
        assert text == expected, (structured, text)
