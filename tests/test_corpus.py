"""A bundle's corpus (`specrt corpus`): the table its proposals come from, checked against
counting by hand; where it is asked (after the row's own longer matches); its guard; and real
bundles given a corpus by the real command, whose greedy output stays the target's alone and
whose losslessness `specrt verify` audits."""

from __future__ import annotations

import json
import shutil
from collections import Counter, defaultdict

import numpy as np
import pytest
from click.testing import CliRunner

from specrt.cli import main
from specrt.errors import BundleError
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from specrt.runtime.corpus import CORPUS_FILE, DEPTH, CorpusTable, confidence_bin
from specrt.runtime.lookup import NgramIndex, find_match
from specrt.runtime.schedules.constants import (
    GUARD_CORPUS_ROUNDS,
    GUARD_PLAIN_SAMPLES,
    GUARD_PROBE_MATCH,
)
from specrt.runtime.schedules.guard import CORPUS, PLAIN, UNCAPPED, SpeculationGuard
from tests.conftest import drafts_keep_the_targets_output


def by_hand(documents: list[list[int]]) -> dict[tuple[int, ...], Counter]:
    """What followed each context of 1 to DEPTH tokens, counted."""
    counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for document in documents:
        for j in range(len(document) - 1):
            for n in range(1, min(DEPTH, j + 1) + 1):
                counts[tuple(document[j - n + 1 : j + 1])][document[j + 1]] += 1
    return counts


def propose_by_hand(counts, tokens: list[int], k: int) -> tuple[list[int], int, int]:
    """(tokens, first context's length, first token's confidence bin), as the module says."""
    context, out, first = list(tokens[-DEPTH:]), [], (0, 0)
    while len(out) < k:
        n = next((n for n in range(len(context), 0, -1) if tuple(context[-n:]) in counts), 0)
        if not n:
            break
        seen = counts[tuple(context[-n:])]
        token = min(seen, key=lambda t: (-seen[t], t))  # the most frequent, smallest id on ties
        if not out:
            first = (n, confidence_bin(seen[token], sum(seen.values())))
        out.append(token)
        context = (context + [token])[-DEPTH:]
    return out, *first


def test_the_table_proposes_what_counting_by_hand_does():
    rng = np.random.default_rng(0)
    # Few distinct tokens: contexts recur, with ties and every confidence bin
    documents = [rng.integers(0, 12, size=int(rng.integers(2, 60))).tolist() for _ in range(80)]
    documents.append([5])  # too short to teach anything
    table = CorpusTable.build(documents)
    counts = by_hand(documents)
    assert len(table) == len(counts) and table.documents == 80
    bins = Counter()
    for _ in range(500):
        tokens = rng.integers(0, 14, size=int(rng.integers(1, 8))).tolist()  # 12, 13: unseen
        expected, n, confidence = propose_by_hand(counts, tokens, 3)
        found = table.propose(tokens, 3)
        assert found.tokens == expected, tokens
        if expected:
            assert (found.match, found.confidence, found.source) == (n, confidence, "corpus")
            bins[confidence] += 1
    assert set(bins) == {1, 2, 3, 4}, bins
    assert table.propose([13, 13], 2).tokens == []  # a token the corpus never saw
    # each token's count, a token after it (what a draft's reduced vocabulary is chosen by)
    occurrences = Counter(token for document in documents for token in document[:-1])
    assert table.token_counts(14).tolist() == [occurrences[token] for token in range(14)]


def test_a_corpus_belongs_to_its_tokenizer_and_a_bad_file_is_named(tmp_path):
    table = CorpusTable.build([[1, 2, 3, 1, 2, 4]])
    path = tmp_path / "ngrams.npz"
    table.save(path, "sha-a")
    again = CorpusTable.load(path, "sha-a")
    assert again.propose([1, 2], 2).tokens == table.propose([1, 2], 2).tokens == [3, 1]
    with pytest.raises(BundleError, match="another tokenizer"):
        CorpusTable.load(path, "sha-b")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(BundleError, match="not a corpus table specrt can read"):
        CorpusTable.load(path, "sha-a")


@pytest.mark.parametrize(
    ("tamper", "why"),
    [
        (lambda t: t.next_ids.__setitem__(slice(None), 999_999), "outside the vocabulary of 50"),
        (lambda t: setattr(t, "next_ids", t.next_ids[:2]), "not of one length"),
        (lambda t: setattr(t, "keys", t.keys[::-1].copy()), "not sorted"),
        (lambda t: setattr(t, "counts", t.counts.astype(np.float32)), "not integers"),
        # a share of 0 / 0 raised ZeroDivisionError mid-generation
        (lambda t: t.totals.__setitem__(slice(None), 0), "not between 1 and their contexts'"),
    ],
)
def test_a_table_edited_by_hand_is_refused_at_load_not_mid_generation(tmp_path, tamper, why):
    """Its arrays are checked when read: a token id past the vocabulary failed in the
    target's embedding and an array cut short in the middle of a row."""
    table = CorpusTable.build([[1, 2, 3, 1, 2, 4, 7, 9, 1, 2]])
    tamper(table)
    path = tmp_path / "ngrams.npz"
    table.save(path, "sha-a")
    with pytest.raises(BundleError, match=f"not a corpus table specrt can read .*{why}"):
        CorpusTable.load(path, "sha-a", vocab=50)
    path.unlink()
    path.mkdir()  # a folder in its place was taken for no corpus at all
    with pytest.raises(BundleError, match="not a corpus table specrt can read"):
        CorpusTable.load(path, "sha-a", vocab=50)
    (tmp_path / "junk.npz").write_text("junk")
    with pytest.raises(BundleError, match=r"\(not an .npz archive\)"):
        CorpusTable.load(tmp_path / "junk.npz", "sha-a")


def test_the_rows_own_longer_match_comes_first_and_one_token_gives_way_to_the_corpus():
    corpus = CorpusTable.build([[7, 8, 9, 10], [3, 4, 50, 51]])

    def find(tokens: list[int], use_corpus: bool = True):
        index = NgramIndex(1, 3)  # one per row: it indexes the row's tokens as they grow
        index.corpus = corpus
        return find_match(index, None, tokens, 2, use_corpus)

    own = [1, 3, 4, 5, 6, 3, 4]  # "3 4" was followed by 5 in the row's own text
    assert (find(own).tokens, find(own).source) == ([5, 6], "lookup")
    one = [1, 2, 8, 3, 9, 8]  # only "8" matched in the row (followed by 3): the corpus has 9
    assert (find(one).tokens, find(one).source) == ([9, 10], "corpus")
    assert (find(one, use_corpus=False).tokens, find(one, False).source) == ([3, 9], "lookup")
    assert find([60, 61]).tokens == []  # nothing anywhere


def test_a_corpus_is_judged_on_longer_probes_with_no_margin():
    """A probe of the corpus runs its length even when its first rounds keep nothing (most of
    its rounds keep nothing, a third keep a token), and turns it on where its rounds beat plain
    ones by a little; a corpus that loses is turned off."""

    def run(kept_every: int) -> SpeculationGuard:
        guard = SpeculationGuard()
        for _ in range(GUARD_PLAIN_SAMPLES):
            guard.observe(PLAIN, 1, 0.02)
        guard.kinds["model"].state = guard.kinds["match"].state = "off"
        guard.kinds["model"].wait = guard.kinds["match"].wait = 10**6
        caps = []
        for i in range(GUARD_CORPUS_ROUNDS):
            guard.caps()
            caps.append(guard.corpus)
            kept = i % kept_every == kept_every - 1
            guard.observe(CORPUS, 1 + kept, 0.021)  # a round of one token: 5% more time
        guard.caps()
        assert caps == [GUARD_PROBE_MATCH] * GUARD_CORPUS_ROUNDS, caps
        return guard

    paying = run(3)  # a token kept every third round: 1.33 tokens for 1.05 plain rounds
    assert paying.kinds[CORPUS].state == "on" and paying.corpus == UNCAPPED
    losing = run(30)  # none kept
    assert losing.kinds[CORPUS].state == "off" and losing.corpus == 0


@pytest.fixture(scope="module")
def corpus_bundle(llama_bundle, tmp_path_factory):
    """The tiny Llama bundle, copied, with a corpus of its target's own greedy answers to a few
    prompts, written by `specrt corpus` from a .jsonl file and a `specrt distill`-style answers
    folder."""
    root = tmp_path_factory.mktemp("corpus")
    bundle = root / "bundle"
    shutil.copytree(llama_bundle, bundle)
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    alone = GenerationConfig(max_new_tokens=48, ignore_eos=True, num_draft_tokens=0)
    prompts = ["the cat", "a b c", "one two three", "x y"]
    results = generator.generate(prompts, alone)
    texts = root / "answers.jsonl"
    lines = [{"prompt": p, "completion": r.text} for p, r in zip(prompts[:1], results)]
    # a line of `specrt batch`'s output (its token ids are taken), and one of its failed rows
    lines += [{"id": "b", **results[1].to_dict()}, {"id": "c", "error": {"message": "x"}}]
    texts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    answers = root / "answers-0"
    answers.mkdir()
    for i, (prompt, result) in enumerate(zip(prompts[2:], results[2:])):
        ids = generator.encode_prompts([prompt])[0]
        np.savez(answers / f"{i}.npz", prompt=np.array(ids), tokens=np.array(result.token_ids))
    out = CliRunner().invoke(
        main,
        ["corpus", "--bundle", str(bundle), "--text-file", str(texts)]
        + ["--answers-dir", str(answers)],
    )
    assert out.exit_code == 0, out.output
    assert out.output.startswith("corpus of 4 texts,") and CORPUS_FILE in out.output
    return bundle, prompts


def test_a_bundle_drafts_from_its_corpus_and_its_output_stays_the_targets(corpus_bundle):
    bundle, prompts = corpus_bundle
    settings = dict(max_new_tokens=48, ignore_eos=True)
    for max_batch in (1, 4):
        generator = SpeculativeGenerator.from_bundle(bundle, threads=1, max_batch=max_batch)
        assert generator.corpus is not None and len(generator.corpus)
        alone = generator.generate(prompts, GenerationConfig(num_draft_tokens=0, **settings))
        for options in (dict(proposer="lookup", draft_schedule="fixed"), {}):
            results = generator.generate(prompts, GenerationConfig(**options, **settings))
            assert [r.token_ids for r in results] == [r.token_ids for r in alone], options
            corpus = [r.stats.proposers.get("corpus", {}) for r in results]
            # The corpus holds these very answers: its proposals are made, and most are kept
            if options:
                assert (
                    sum(e.get("accepted", 0) for e in corpus)
                    > 0.5 * sum(e.get("proposed", 0) for e in corpus)
                    > 0
                ), corpus
    plain = SpeculativeGenerator.from_bundle(bundle, threads=1, corpus=False)
    assert plain.corpus is None
    results = plain.generate(prompts, GenerationConfig(proposer="lookup", **settings))
    assert not any("corpus" in r.stats.proposers for r in results)


def test_specrt_verify_passes_with_the_corpus_drafting(corpus_bundle):
    bundle, _ = corpus_bundle
    out = CliRunner().invoke(
        main,
        ["verify", "--bundle", str(bundle), "--proposer", "lookup", "--samples", "600"]
        + ["--max-new-tokens", "16", "--law-prompts", "1"],
    )
    assert out.exit_code == 0, out.output
    assert "PASS" in out.output


def test_bad_text_is_refused_in_one_line_and_the_corpus_is_left_as_it_was(corpus_bundle, tmp_path):
    bundle, _ = corpus_bundle
    before = (bundle / CORPUS_FILE).read_bytes()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"prompt": "no completion"}\n')
    alien = tmp_path / "alien.jsonl"  # `specrt batch` output of another model's vocabulary
    alien.write_text('{"id": 1, "token_ids": [1, 2, 100000, 3]}\n')
    empty = tmp_path / "empty.jsonl"  # was "the prompt is empty", naming no file
    empty.write_text('{"text": ""}\n\n')
    good = tmp_path / "good.txt"
    good.write_text("def f(x):\n    return x\n")
    cases = {
        "empty.jsonl holds no text": ["--text-file", str(good), "--text-file", str(empty)],
        "bad.jsonl:2: give": ["--text-file", str(bad)],
        "outside the bundle's vocabulary": ["--text-file", str(alien)],
        "does not exist": ["--text-file", str(tmp_path / "missing.jsonl")],
        "holds no answers": ["--answers-dir", str(tmp_path)],
        "give the text to learn": [],
    }
    for message, args in cases.items():
        out = CliRunner().invoke(main, ["corpus", "--bundle", str(bundle), *args])
        assert out.exit_code != 0 and message in out.output, out.output
        assert "Traceback" not in out.output
    assert (bundle / CORPUS_FILE).read_bytes() == before


def test_on_a_target_that_computes_pairs_a_one_token_proposal_costs_nothing():
    """An int4 target on AVX2 computes an even number of positions a call: a pass over one
    position takes what a pass over two does. The hybrid that knows it verifies a weakly
    backed one-token proposal of the corpus (it can only gain); fitted as a line over the
    positions fed, the same timings make that token look like a loss."""
    from specrt.runtime.hybrid import HybridChoice
    from specrt.runtime.lookup import Proposal

    choices = {}
    for even in (False, True):
        hybrid = HybridChoice(even_rows=even)
        for _ in range(8):  # passes as the paired engine takes them: 1-2 positions, 3-4
            for positions, seconds in ((1, 0.010), (2, 0.010), (3, 0.014), (4, 0.014)):
                hybrid.observe(None, 0, positions - 1, 0, 0.0, seconds)
        weak = Proposal([5], 2, "corpus", confidence=1)  # kept 0.15 of the time, a priori
        choices[even] = hybrid.match_length(weak, rival=1.0)
    assert choices == {False: 0, True: 1}


def test_the_command_line_drafts_from_the_corpus_unless_told_not_to(corpus_bundle):
    bundle, prompts = corpus_bundle
    args = ["generate", "--bundle", str(bundle), "--prompt", prompts[0], "--json"]
    args += ["--proposer", "lookup", "--draft-schedule", "fixed", "--max-new-tokens", "24"]
    runs = {}
    for flag in ("--corpus", "--no-corpus"):
        out = CliRunner().invoke(main, [*args, "--ignore-eos", flag])
        assert out.exit_code == 0, out.output
        runs[flag] = json.loads(out.output.splitlines()[-1])
    assert runs["--corpus"]["token_ids"] == runs["--no-corpus"]["token_ids"]
    assert "corpus" in runs["--corpus"]["stats"]["proposers"]
    assert "corpus" not in runs["--no-corpus"]["stats"]["proposers"]


def test_a_draft_proposes_the_tokens_its_bundle_s_corpus_uses_most(corpus_bundle, tmp_path):
    """`specrt build --draft-vocab N`: a user's own draft, whose folder names no vocabulary,
    proposes the N tokens of what its target wrote; the output stays the target's."""
    from specrt.bundle import read_manifest

    bundle = tmp_path / "bundle"
    shutil.copytree(corpus_bundle[0], bundle)
    result = CliRunner().invoke(main, ["build", "--bundle", str(bundle), "--draft-vocab", "24"])
    assert result.exit_code == 0, result.output
    assert "proposes 24 of the" in result.output and "the bundle's corpus" in result.output
    manifest = read_manifest(bundle)
    assert manifest.models["draft"].engines["onnxruntime"].export_check["proposed_tokens"] == 24
    table = CorpusTable.load(bundle / CORPUS_FILE, manifest.tokenizer.sha256)
    counts = table.token_counts(manifest.vocab_size)
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    prompt = generator.encode_prompts([corpus_bundle[1][0]])[0]
    logits = generator.draft.forward(prompt, keep_last=1).logits[-1]
    proposed = np.flatnonzero(logits > -1e29)  # the others: never proposed
    others = np.setdiff1d(np.arange(manifest.vocab_size), proposed)
    assert len(proposed) == 24 and counts[proposed].min() >= counts[others].max() > 0
    drafts_keep_the_targets_output(generator, prompt)
    # 0: the whole vocabulary again
    result = CliRunner().invoke(main, ["build", "--bundle", str(bundle), "--draft-vocab", "0"])
    assert result.exit_code == 0 and "draft: proposes" not in result.output, result.output
    check = read_manifest(bundle).models["draft"].engines["onnxruntime"].export_check
    assert "proposed_tokens" not in check


def test_a_draft_vocabulary_without_a_corpus_is_one_line_and_changes_nothing(
    llama_bundle, tmp_path
):
    bundle = tmp_path / "bundle"
    shutil.copytree(llama_bundle, bundle)
    before = (bundle / "manifest.json").read_bytes()
    result = CliRunner().invoke(main, ["build", "--bundle", str(bundle), "--draft-vocab", "24"])
    assert result.exit_code != 0 and "has no corpus" in result.output, result.output
    assert "specrt corpus --bundle" in result.output and "Traceback" not in result.output
    assert (bundle / "manifest.json").read_bytes() == before


def test_a_distill_state_folder_gives_its_answers_and_never_its_held_out_ones(
    corpus_bundle, tmp_path
):
    bundle, _ = corpus_bundle
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    state = tmp_path / ".draft.distill"
    for folder, count in (("answers-abc", 3), ("heldout-abc", 2)):
        (state / folder).mkdir(parents=True)
        for i in range(count):
            ids = np.arange(i, i + 10)
            np.savez(state / folder / f"{i}.npz", prompt=ids[:4], tokens=ids[4:])
    out = CliRunner().invoke(main, ["corpus", "--bundle", str(copy), "--answers-dir", str(state)])
    assert out.exit_code == 0, out.output
    assert out.output.startswith("corpus of 3 texts, 30 tokens"), out.output
    # the held-out folder itself is refused, and a folder given twice is read once
    heldout = ["--answers-dir", str(state / "heldout-abc")]
    out = CliRunner().invoke(main, ["corpus", "--bundle", str(copy), *heldout])
    assert out.exit_code == 1 and "answers to the held-out prompts" in out.output, out.output
    twice = ["--answers-dir", str(state), "--answers-dir", str(state / ".." / state.name)]
    out = CliRunner().invoke(main, ["corpus", "--bundle", str(copy), *twice])
    assert out.output.startswith("corpus of 3 texts, 30 tokens"), out.output


def test_openai_batch_output_gives_the_texts_of_its_choices(corpus_bundle, tmp_path):
    """`specrt batch` writes OpenAI's batch output format for OpenAI input lines; their
    "error": null made every line look like a failed row, and the corpus dropped them all."""
    bundle, _ = corpus_bundle
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)

    def line(custom_id, body, status=200, error=None):
        response = {"status_code": status, "request_id": "req_1", "body": body}
        return {"id": "batch_req_1", "custom_id": custom_id, "response": response, "error": error}

    completion = {"object": "text_completion", "choices": [{"index": 0, "text": "the cat sat"}]}
    message = {"role": "assistant", "content": "on the mat"}
    chat = {"object": "chat.completion", "choices": [{"index": 0, "message": message}]}
    failed = line("c", {"error": {"message": "x"}}, 400, {"code": "bad", "message": "x"})
    texts = tmp_path / "out.jsonl"
    lines = [line("a", completion), line("b", chat), failed]
    texts.write_text("".join(json.dumps(record) + "\n" for record in lines))
    out = CliRunner().invoke(main, ["corpus", "--bundle", str(copy), "--text-file", str(texts)])
    assert out.exit_code == 0 and out.output.startswith("corpus of 2 texts"), out.output


def test_a_file_where_the_corpus_folder_goes_is_named(llama_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(llama_bundle, copy)
    (copy / "corpus").write_text("mine")
    (tmp_path / "t.txt").write_text("def f(x):\n    return x\n")
    args = ["corpus", "--bundle", str(copy), "--text-file", str(tmp_path / "t.txt")]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 1 and "is a file where the corpus's folder goes" in out.output
    assert (copy / "corpus").read_text() == "mine"
