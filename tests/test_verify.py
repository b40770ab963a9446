"""`specrt verify`: the audit passes on the demo bundle, and fails when a verification bug is put
into the runtime (greedy identity catches a greedy bug; the chi-square check a bug that only
touches unseeded sampling); its chi-square survival function against scipy's; bad input.

False-alarm rate: the runs expected to pass have 2 + 1 + 1 + 1 sampled-law checks at alpha
1e-3 (the default, in the first) and 1e-4, so a correct runtime fails this module with
probability at most 2.3e-3 (unseeded rows draw from fresh entropy: a failure is not
reproducible by seed).
Power against the wrong residual, computed exactly from the demo pair's target and draft laws
(noncentral chi-square; CHANGELOG.md, 2026-12-04): the default run's two law checks miss it
with probability 0.021 and 0.00066, and the test needs only one of them to see it (1.4e-5)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.stats
from click.testing import CliRunner

import specrt.runtime.round as round_module
import specrt.runtime.verification as verification
from specrt.cli import main
from specrt.runtime import GenerationConfig
from specrt.runtime.chi_square import chi2_sf, goodness_of_fit

DEMO = Path(__file__).resolve().parents[1] / "engines" / "demo"


@pytest.fixture(scope="module")
def demo(request) -> Path:
    """The shipped demo bundle (`make engines`), else the same pair exported here."""
    if (DEMO / "manifest.json").is_file():
        return DEMO
    return request.getfixturevalue("demo_bundle")


def verify(bundle: Path, *args: str):
    result = CliRunner().invoke(main, ["verify", "--bundle", str(bundle), *map(str, args)])
    assert "Traceback" not in result.output, result.output
    return result


def checks(output: str) -> dict[str, str]:
    """Each check's line by its name (the summary and the header left out)."""
    lines = [line for line in output.splitlines() if line.endswith((" PASS", " FAIL"))]
    return {line.split(":")[0]: line for line in lines}


def test_verify_passes_on_the_demo_bundle_with_the_defaults(demo):
    result = verify(demo)
    assert result.exit_code == 0, result.output
    lines = checks(result.output)
    assert list(lines) == [
        "greedy identity, in batches of up to 16 rows",
        "greedy identity, one at a time",
        "seeded identity (temperature 0.8, seed 0), in batches of up to 16 rows",
        "seeded identity (temperature 0.8, seed 0), one at a time",
        "sampled law, prompt 1",
        "sampled law, prompt 2",
    ]
    for name, line in lines.items():
        assert line.endswith(" PASS"), line
        assert "draft tokens kept" in line, line  # something was drafted: the check has teeth
        if "identity" in name:
            assert "6/6 prompts identical to the target alone (64 tokens each;" in line, line
    law = lines["sampled law, prompt 1"]
    assert "over 2000 samples" in law and "false-alarm rate 0.001" in law
    assert result.output.splitlines()[-1].startswith("PASS: 6 of 6 checks passed")


@pytest.mark.parametrize(
    "options",
    [
        ("--proposer", "lookup"),
        ("--proposer", "model", "--draft-schedule", "heuristic", "--top-k", "20"),
    ],
    ids=["lookup", "model-heuristic-topk"],
)
def test_verify_passes_with_other_proposers(demo, options):
    result = verify(demo, *options, "--samples", 500, "--law-prompts", 1, "--alpha", 1e-4)
    assert result.exit_code == 0, result.output
    lines = checks(result.output)
    assert len(lines) == 5 and all(line.endswith(" PASS") for line in lines.values())
    assert "draft tokens kept" in lines["sampled law, prompt 1"]


def test_verify_audits_the_logits_processors(demo, monkeypatch):
    """With penalties the audit's law is the processed target's: it passes, and a runtime
    whose rounds verify against the raw logits (the processing dropped there, the first token
    still processed) fails the sampled law (the target alone runs the same rounds, so the
    identities cannot see it)."""
    penalties = ("--repetition-penalty", 1.3, "--frequency-penalty", 0.5, "--presence-penalty", 0.3)
    options = (*penalties, "--samples", 500, "--law-prompts", 1, "--alpha", 1e-4)
    result = verify(demo, *options)
    assert result.exit_code == 0, result.output
    assert "repetition penalty 1.3, frequency penalty 0.5, presence penalty 0.3" in result.output
    assert all(line.endswith(" PASS") for line in checks(result.output).values())
    monkeypatch.setattr(round_module, "_processed", lambda out, rows, *_: (out, {}))
    result = verify(demo, *penalties)  # 2000 samples of each of two prompts
    assert result.exit_code == 1, result.output
    laws = [line for name, line in checks(result.output).items() if "law" in name]
    assert any(line.endswith(" FAIL") for line in laws), result.output


def test_verify_audits_structured_output(demo, monkeypatch):
    """Under a grammar the audit's law is the masked target's: it passes, and a runtime whose
    rounds verify against the unmasked logits (the first token still masked) fails the
    sampled law: its second tokens include ones the grammar refuses."""
    grammar = ("--regex", "[a-z_ ():=.\n]{2,80}")
    result = verify(demo, *grammar, "--samples", 500, "--law-prompts", 1, "--alpha", 1e-4)
    assert result.exit_code == 0, result.output
    assert "structured output)" in result.output
    assert all(line.endswith(" PASS") for line in checks(result.output).values())
    monkeypatch.setattr(round_module, "_processed", lambda out, rows, *_: (out, {}))
    result = verify(demo, *grammar, "--samples", 500, "--law-prompts", 1)
    assert result.exit_code == 1, result.output
    assert checks(result.output)["sampled law, prompt 1"].endswith(" FAIL"), result.output


def test_a_wrong_residual_fails_the_sampled_law_only(demo, monkeypatch):
    """After a rejection the token is drawn from p instead of norm(max(0, p - q)): greedy and
    seeded rows never use it, so only the chi-square check can see it."""
    monkeypatch.setattr(verification, "residual_distribution", lambda p, q: p)
    result = verify(demo)  # the defaults: 2000 samples of each of two prompts
    assert result.exit_code == 1, result.output
    lines = checks(result.output)
    identity = [line for name, line in lines.items() if "identity" in name]
    assert len(identity) == 4 and all(line.endswith(" PASS") for line in identity)
    laws = [line for name, line in lines.items() if name.startswith("sampled law")]
    assert any(line.endswith(" FAIL") for line in laws), result.output
    assert result.output.splitlines()[-1].startswith("FAIL: ")


def test_accepting_every_sampled_draft_fails_the_sampled_law(demo, monkeypatch):
    monkeypatch.setattr(verification, "acceptance_probability", lambda p, q: 1.0)
    result = verify(demo, "--proposer", "model", "--samples", 500, "--law-prompts", 1)
    assert result.exit_code == 1, result.output
    assert checks(result.output)["sampled law, prompt 1"].endswith(" FAIL")


def test_a_greedy_bug_fails_greedy_identity(demo, monkeypatch):
    """The batched round keeps one draft token more than the target's picks allow."""
    accept_greedy = round_module.accept_greedy

    def keeps_one_more(draft_tokens: list[int], choice: list[int]) -> tuple[int, int]:
        accepted, token = accept_greedy(draft_tokens, choice)
        if accepted < len(draft_tokens):
            return accepted + 1, choice[accepted + 1]
        return accepted, token

    monkeypatch.setattr(round_module, "accept_greedy", keeps_one_more)
    result = verify(demo, "--law-prompts", 0)
    assert result.exit_code == 1, result.output
    lines = checks(result.output)
    for way in ("in batches of up to 16 rows", "one at a time"):
        line = lines[f"greedy identity, {way}"]
        assert line.endswith(" FAIL") and "first differs at new token" in line, line
    assert "FAIL: " in result.output.splitlines()[-1]


def test_chi2_sf_matches_scipy():
    for df in (1, 2, 3, 5, 8, 13, 30, 47, 100, 250, 1000, 4000):
        grid = np.concatenate([np.linspace(0, 3 * df + 60, 45), [1e-9, df, 10 * df + 500]])
        for x in grid:
            expected = scipy.stats.chi2.sf(x, df)
            got = chi2_sf(float(x), df)
            assert got == pytest.approx(expected, rel=1e-9, abs=1e-300), (x, df)
    assert chi2_sf(float("inf"), 3) == 0.0
    with pytest.raises(ValueError):
        chi2_sf(1.0, 0)


def test_goodness_of_fit_matches_scipy_and_pools_small_cells():
    rng = np.random.default_rng(0)
    probs = rng.uniform(1, 3, 12)
    probs = probs / probs.sum()  # every cell expected at least 5000 / 36 times
    counts = rng.multinomial(5000, probs)
    fit = goodness_of_fit(counts, 5000 * probs)
    assert fit.cells == 12
    assert fit.pvalue == pytest.approx(scipy.stats.chisquare(counts, 5000 * probs).pvalue)
    # cells below 5 expected pooled into one, its counts summed (5 expected: a cell)
    observed = np.array([390, 590, 4, 6, 10])
    fit = goodness_of_fit(observed, np.array([400.0, 585.0, 2.0, 3.0, 10.0]))
    pooled = scipy.stats.chisquare([390, 590, 10, 10], [400.0, 585.0, 10.0, 5.0])
    assert fit.cells == 4 and fit.pvalue == pytest.approx(pooled.pvalue)
    # ... and a pooled cell still below 5 expected into the smallest other cell
    fit = goodness_of_fit(observed, np.array([400.0, 585.0, 1.0, 2.0, 12.0]))
    pooled = scipy.stats.chisquare([390, 590, 20], [400.0, 585.0, 15.0])
    assert fit.cells == 3 and fit.pvalue == pytest.approx(pooled.pvalue)
    # a count where nothing is expected: impossible under the law
    assert goodness_of_fit(np.array([5, 1]), np.array([6.0, 0.0])).impossible
    assert goodness_of_fit(np.array([5, 1]), np.array([6.0, 0.0])).pvalue == 0.0


@pytest.mark.parametrize(
    "args, message",
    [
        (("--samples", "0"), "Invalid value for '--samples'"),
        (("--samples", "many"), "Invalid value for '--samples'"),
        (("--alpha", "1.5"), "Invalid value for '--alpha'"),
        (("--temperature", "0"), "Invalid value for '--temperature'"),
        (("--num-draft-tokens", "0"), "Invalid value for '--num-draft-tokens'"),
        (("--top-p", "0"), "--top-p 0.0 is out of range"),
        (("--prompt-file", "/nonexistent/prompts.txt"), "prompt file /nonexistent/prompts.txt"),
    ],
)
def test_bad_input_is_one_clear_line(demo, args, message):
    result = verify(demo, *args)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and message in errors[0], result.output
    assert "PASS" not in result.output


def test_samples_in_one_cell_test_nothing_and_are_not_a_pass(demo):
    """100 samples of a prompt whose first tokens are all but certain fall in one cell of the
    law: p = 1 there says nothing, and was printed as PASS."""
    result = verify(demo, "--prompt", "hi", "--samples", "100", "--max-new-tokens", "8")
    assert result.exit_code == 0, result.output
    [law] = [line for line in result.output.splitlines() if line.startswith("sampled law")]
    assert law.endswith(" NOT TESTED") and "sampled law, prompt 1" not in checks(result.output)
    assert "PASS: 2 of 2 checks passed" in result.output
    assert "1 not tested (each says why above)" in law + result.output
    assert "give more --samples" in law


@pytest.mark.parametrize("what", ["no drafts", "top-k 1"])
def test_checks_that_test_nothing_are_not_a_pass(demo, what):
    """One new token leaves nothing to draft: every check compared the target alone with
    itself, and the audit said PASS. At top-k 1 the law is one outcome, and more samples,
    which the message asked for, never help."""
    if what == "no drafts":
        result = verify(demo, "--max-new-tokens", "1", "--law-prompts", "0", "--prompt", "x = ")
        assert result.exit_code == 1 and "NOT TESTED: 0 of 0 checks passed" in result.output
        assert "nothing speculative is tested" in result.output and " PASS\n" not in result.output
        return
    result = verify(demo, "--prompt", "def f", "--samples", "200", "--top-k", "1",
                    "--max-new-tokens", "8")  # fmt: skip
    [law] = [line for line in result.output.splitlines() if line.startswith("sampled law")]
    assert law.endswith(" NOT TESTED") and "top-k 1 leaves one token a step" in law, law
    assert "give more --samples" not in law and result.exit_code == 0, result.output


def test_the_false_alarm_rate_said_is_at_most_one(demo):
    result = verify(demo, "--prompt", "def f", "--prompt", "import", "--samples", "100",
                    "--max-new-tokens", "4", "--law-prompts", "2", "--alpha", "0.9")  # fmt: skip
    assert "together <= 1)" in result.output, result.output  # not 1.8


def test_audit_refuses_one_string_for_its_prompts(demo):
    from specrt.errors import InvalidInputError
    from specrt.runtime.audit import audit

    with pytest.raises(InvalidInputError, match="not one string: give \\[prompt\\]"):
        audit(demo, "def f", 100, GenerationConfig(max_new_tokens=4), law_prompts=0)


def test_a_missing_bundle_is_one_clear_line(tmp_path):
    result = verify(tmp_path / "nothing")
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: bundle directory '{tmp_path / 'nothing'}' does not exist; build it with "
        "`specrt export --target DIR --draft DIR --out DIR` or `make engines`"
    ]


@pytest.mark.parametrize("schedule", ["adaptive", "heuristic", "fixed"])
def test_the_sampled_checks_draft_every_round_whatever_the_schedule(schedule):
    """In a batch of sampled rows any schedule but "fixed" leaves K to the load schedule, which
    drafted nothing on a busy host: the law check then audited the target alone."""
    from specrt.runtime.audit import sampled_config

    config = GenerationConfig(proposer="model", draft_schedule=schedule, num_draft_tokens=3)
    sampled = sampled_config(config)
    assert sampled.draft_schedule == "fixed" and sampled.num_draft_tokens == 3
    assert not sampled.greedy and sampled.seed is not None


def test_the_caller_hears_of_each_sampled_row(demo):
    """The sampled rows are most of an audit on a larger target (minutes on SmolLM2), so the
    caller hears of them as each batch ends: `specrt verify`'s bar."""
    from specrt.runtime.audit import AUDIT_BATCH, audit

    heard = []
    config = GenerationConfig(max_new_tokens=8)
    results = audit(demo, None, 100, config, law_prompts=1, progress=lambda *a: heard.append(a))
    assert results[-1].name == "sampled law, prompt 1"
    ends = [min(done, 100) for done in range(AUDIT_BATCH, 100 + AUDIT_BATCH, AUDIT_BATCH)]
    assert heard == [("sampled law, prompt 1", done, 100) for done in ends]
