"""Verification's math: exact enumeration (no sampling) of `verify`, the function the loop calls,
and its statistical behaviour."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from specrt.backends import Forward
from specrt.errors import NumericalError
from specrt.runtime import verification
from specrt.runtime.config import SamplingParams
from specrt.runtime.sampling import KeyedDraws, sample, warp
from specrt.runtime.verification import acceptance_probability, residual_distribution, verify
from tests.stats import chi_square_pvalue

V = 6
GREEDY = SamplingParams()
# Temperature 1, no filters: `verify` takes the target's given probabilities as they are, so the
# tests hand it exact float64 distributions (the logits are then only read for error messages).
PLAIN = SamplingParams(temperature=1.0)


def _random(rng, zeros=0):
    p = rng.dirichlet(np.full(V, 0.5))
    if zeros:
        p[rng.choice(V, zeros, replace=False)] = 0.0
        p /= p.sum()
    return p


def _cases():
    rng = np.random.default_rng(1234)
    cases = {f"random{i}": (_random(rng), _random(rng)) for i in range(20)}
    cases |= {f"q_zeros{i}": (_random(rng), _random(rng, zeros=3)) for i in range(10)}
    cases |= {f"p_zeros{i}": (_random(rng, zeros=3), _random(rng)) for i in range(10)}
    same = _random(rng)
    cases["p_equals_q"] = (same, same.copy())
    cases["disjoint"] = (np.array([0.5, 0.5, 0, 0, 0, 0]), np.array([0, 0, 0.2, 0.3, 0.5, 0]))
    cases["q_one_hot"] = (_random(rng), np.eye(V)[2])
    cases["p_one_hot"] = (np.eye(V)[4], _random(rng))
    return cases


class Branches:
    """Runs a function over every outcome of its random choices, with each outcome's exact
    probability: ``rng.random() < a`` takes both branches (probability a and 1 - a), and
    `sample(w, rng)`, patched to `Branches.sample`, every index with w > 0 (probability
    w / sum w: `sample` is the inverse CDF, tested exactly below)."""

    def __init__(self) -> None:
        self.path: list[int] = []  # the option taken at each choice of the current run
        self.sizes: list[int] = []  # how many options each choice had
        self.depth = 0
        self.probability = 1.0

    def choose(self, options: list[tuple[object, float]]):
        options = [(value, p) for value, p in options if p > 0]
        if self.depth == len(self.path):
            self.path.append(0)
            self.sizes.append(len(options))
        value, p = options[self.path[self.depth]]
        self.depth += 1
        self.probability *= p
        return value

    def random(self) -> _Uniform:
        return _Uniform(self)

    @staticmethod
    def sample(weights: np.ndarray, rng: Branches) -> int:
        total = float(np.sum(weights))
        return rng.choose([(i, float(w) / total) for i, w in enumerate(weights)])

    def outcomes(self, run) -> dict:
        """{result of ``run(rng)``: its probability} over every path of choices."""
        results: dict = defaultdict(float)
        while True:
            self.depth, self.probability = 0, 1.0
            result = run(self)
            results[result] += self.probability
            while self.path and self.path[-1] + 1 == self.sizes[-1]:
                self.path.pop()
                self.sizes.pop()
            if not self.path:
                return results
            self.path[-1] += 1


class _Uniform:
    """A uniform draw in [0, 1) whose comparison with a threshold branches."""

    def __init__(self, branches: Branches) -> None:
        self.branches = branches

    def __lt__(self, threshold: float) -> bool:
        a = float(threshold)
        return self.branches.choose([(True, a), (False, 1.0 - a)])


@pytest.fixture
def branches(monkeypatch) -> Branches:
    monkeypatch.setattr(verification, "sample", Branches.sample)
    return Branches()


def verify_outcomes(branches, drafted, q_rows, p_rows) -> dict[tuple[int, ...], float]:
    """{tokens a round emits: probability} for given draft tokens, by `verify` itself."""
    q_rows, p_rows = np.asarray(q_rows), np.asarray(p_rows)
    logits = np.zeros_like(p_rows)

    def run(rng):
        accepted, token = verify(drafted, q_rows, Forward(logits, p_rows), PLAIN, rng)
        return (*drafted[:accepted], token)

    return branches.outcomes(run)


def first_token_law(branches, p, q, bonus) -> np.ndarray:
    """P(first emitted token = y) with K = 1, enumerated over the draft token x ~ q and over
    every random choice `verify` makes."""
    law = np.zeros_like(p)
    for x in np.flatnonzero(q):
        for emitted, chance in verify_outcomes(branches, [int(x)], [q], [p, bonus]).items():
            law[emitted[0]] += q[x] * chance
    return law


@pytest.mark.parametrize("name", sorted(_cases()))
def test_one_position_emits_exactly_p(name, branches):
    p, q = _cases()[name]
    bonus = _random(np.random.default_rng(0))
    assert np.abs(first_token_law(branches, p, q, bonus) - p).max() < 1e-9


def test_two_positions_joint_is_exactly_target(branches):
    """Joint law of the first two emitted tokens when K = 2 and the target's second distribution
    depends on the first token. A round that stops after one token leaves the second to the next
    round, whose first token follows p exactly (previous test)."""
    rng = np.random.default_rng(7)
    for _ in range(10):
        p1, q1 = _random(rng), _random(rng, zeros=2)
        p2 = {x: _random(rng, zeros=x % 3) for x in range(V)}  # p2(. | x1)
        q2 = {x: _random(rng, zeros=(x + 1) % 3) for x in range(V)}
        bonus = _random(rng)
        joint = np.zeros((V, V))
        for x1 in np.flatnonzero(q1):
            for x2 in np.flatnonzero(q2[x1]):
                drafted = [int(x1), int(x2)]
                rows = [p1, p2[x1], bonus]
                outcomes = verify_outcomes(branches, drafted, [q1, q2[x1]], rows)
                for emitted, chance in outcomes.items():
                    weight = q1[x1] * q2[x1][x2] * chance
                    if len(emitted) >= 2:  # x1 accepted: the second token is this round's
                        joint[emitted[0], emitted[1]] += weight
                    else:  # rejected at x1: the second token is the next round's, p2(. | y1)
                        joint[emitted[0]] += weight * p2[emitted[0]]
        expected = p1[:, None] * np.stack([p2[x] for x in range(V)])
        assert np.abs(joint - expected).max() < 1e-9


def test_enumeration_detects_a_wrong_rule(branches, monkeypatch):
    """The exact checks above can fail: emitting from p instead of the residual, or accepting
    with min(1, q/p), moves the emitted law away from p."""
    p, q = _cases()["random0"]
    bonus = _random(np.random.default_rng(0))
    with monkeypatch.context() as patch:
        patch.setattr(verification, "residual_distribution", lambda p_i, q_i: p_i)
        assert np.abs(first_token_law(branches, p, q, bonus) - p).max() > 1e-3
    with monkeypatch.context() as patch:
        patch.setattr(verification, "acceptance_probability", lambda p_x, q_x: min(1, q_x / p_x))
        assert np.abs(first_token_law(branches, p, q, bonus) - p).max() > 1e-3


def test_guards(branches):
    p = np.array([0.2, 0.3, 0.5])
    # q(x) = 0 rejects instead of dividing by zero
    assert acceptance_probability(0.2, 0.0) == 0.0
    q = np.array([0.0, 0.5, 0.5])
    outcomes = verify_outcomes(branches, [0], [q], [p, p])
    assert all(len(emitted) == 1 for emitted in outcomes)  # never accepted
    # a residual without mass falls back to p
    assert np.array_equal(residual_distribution(p, p.copy()), p)
    assert np.allclose(residual_distribution(p, np.array([0.3, 0.3, 0.4])), [0, 0, 1])


# ---------------------------------------------------------------------------------------------
# The real `verify` (random draws included) against p. Each chi-square test below has
# a false-alarm rate of ALPHA; the seeds are fixed, so a pass is reproducible.
ALPHA = 1e-4
DRAWS = 20_000


def _first_tokens(p, q, draft_tokens_rng, seed):
    rng = np.random.default_rng(seed)
    k = q.shape[0]
    counts = np.zeros(p.shape[1])
    logits = np.zeros_like(p)
    for _ in range(DRAWS):
        drafted = [sample(q[i], draft_tokens_rng) for i in range(k)]
        n, token = verify(drafted, q, Forward(logits, p), PLAIN, rng)
        counts[drafted[0] if n > 0 else token] += 1
    return counts


def test_verify_first_token_follows_p():
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.full(V, 0.7), size=4)  # K = 3 positions + bonus
    q = rng.dirichlet(np.full(V, 0.7), size=3)
    counts = _first_tokens(p, q, np.random.default_rng(4), seed=5)
    assert chi_square_pvalue(counts, p[0]) > ALPHA


def test_statistical_check_detects_a_broken_residual(monkeypatch):
    """The check above can fail: emitting from p instead of the residual is caught."""
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.full(V, 0.7), size=4)
    q = rng.dirichlet(np.full(V, 0.7), size=3)
    monkeypatch.setattr(verification, "residual_distribution", lambda p_i, q_i: p_i)
    counts = _first_tokens(p, q, np.random.default_rng(4), seed=5)
    assert chi_square_pvalue(counts, p[0]) < ALPHA


def test_sample_never_draws_zero_probability_tokens():
    rng = np.random.default_rng(0)
    probs = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    draws = np.bincount([sample(probs, rng) for _ in range(5000)], minlength=5)
    assert draws[[0, 2, 4]].sum() == 0
    assert chi_square_pvalue(draws, probs) > ALPHA


# ---------------------------------------------------------------------------------------------
def test_warp_temperature_top_k_top_p_min_p_match_their_definitions():
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(50, 20)) * 3
    settings = [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.9, 0.0), (0.5, 8, 0.6, 0.0),
                (1.0, 0, 1.0, 0.1), (0.8, 6, 0.9, 0.3), (1.0, 0, 1.0, 1.0)]  # fmt: skip
    for temperature, top_k, top_p, min_p in settings:
        probs = warp(logits, temperature, top_k, top_p, min_p=min_p)
        assert np.allclose(probs.sum(-1), 1.0)
        for row, got in zip(logits, probs):
            scores = row / temperature
            keep = np.ones_like(scores, dtype=bool)
            if top_k:
                keep &= scores >= np.sort(scores)[-top_k]
            soft = np.where(keep, np.exp(scores - scores.max()), 0)
            soft /= soft.sum()
            if top_p < 1:
                order = np.argsort(-soft)
                kept, mass = [], 0.0
                for token in order:  # the smallest top set whose mass reaches top_p
                    kept.append(token)
                    mass += soft[token]
                    if mass >= top_p:
                        break
                mask = np.zeros_like(keep)
                mask[kept] = True
                soft = np.where(mask, soft, 0)
                soft /= soft.sum()
            if min_p:  # tokens less likely than min_p times the most likely one, after top-p
                soft = np.where(soft >= min_p * soft.max(), soft, 0)
                soft /= soft.sum()
            assert np.allclose(got, soft, atol=1e-12)
            if min_p == 1.0:  # only the best token (no ties in these random logits)
                assert np.count_nonzero(got) == 1
            # the loop's float32 warp: the same distribution to float32 rounding
            fast = warp(row.astype(np.float32), temperature, top_k, top_p, min_p=min_p,
                        dtype=np.float32)  # fmt: skip
            assert fast.dtype == np.float32 and np.abs(fast - soft).max() < 1e-6
            assert np.array_equal(fast == 0, soft == 0)  # the same tokens filtered out


def greedy_verify(drafted: list[int], logits: np.ndarray) -> tuple[int, int]:
    return verify(drafted, None, Forward(logits), GREEDY, np.random.default_rng(0))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_huge_temperature_with_a_masked_token_is_uniform_not_nan(dtype):
    """Any finite temperature is accepted: past ~1e45 its inverse underflowed to 0 in float32
    (the loop's dtype), -inf * 0 made every probability NaN, and the masked token was emitted
    every time (an audit's finding). The limit is uniform over the tokens that can be drawn."""
    logits = np.array([0.5, 0.0, 1.0, -np.inf], dtype=np.float32)
    for temperature in (1e30, 1e46, 1e300):
        probs = warp(logits, temperature, model="target", dtype=dtype)
        np.testing.assert_allclose(probs, [1 / 3, 1 / 3, 1 / 3, 0.0], atol=1e-6)
    sampling = SamplingParams(temperature=1e46)
    rng = np.random.default_rng(0)
    emitted = [verify([], None, Forward(logits[None]), sampling, rng)[1] for _ in range(300)]
    assert 3 not in emitted and set(emitted) == {0, 1, 2}


def test_greedy_verify():
    logits = np.full((4, 5), -1.0)
    logits[[0, 1, 2, 3], [2, 4, 1, 3]] = 5.0  # target argmax per position: 2, 4, 1, 3
    assert greedy_verify([2, 4, 1], logits) == (3, 3)  # all accepted, bonus 3
    assert greedy_verify([2, 0, 1], logits) == (1, 4)  # rejected at 1, correction 4
    assert greedy_verify([], logits[:1]) == (0, 2)


def test_nan_and_inf_logits_raise():
    logits = np.zeros((2, 5))
    logits[1, 3] = np.nan
    with pytest.raises(NumericalError, match="NaN/inf"):
        greedy_verify([0], logits)
    logits[1, 3] = np.inf
    with pytest.raises(NumericalError, match="NaN/inf"):
        greedy_verify([0], logits)
    logits[1] = -np.inf  # a row with nothing to choose
    with pytest.raises(NumericalError, match="NaN/inf"):
        greedy_verify([0], logits)
    # Sampling checks in the warp, row by row.
    for bad in (np.nan, np.inf):
        row = np.zeros(5)
        row[2] = bad
        with pytest.raises(NumericalError, match="the draft model produced 1 NaN/inf"):
            warp(row, 1.0, model="draft")
    with pytest.raises(NumericalError):
        warp(np.full(5, -np.inf), 1.0, model="target")
    masked = np.array([0.0, -np.inf, 1.0, -np.inf, 2.0])  # -inf here and there is a valid mask
    assert warp(masked, 1.0, model="target")[[1, 3]].tolist() == [0.0, 0.0]


def test_graph_softmax_of_bad_logits_is_refused():
    """The engines' in-graph softmax (onnxruntime's own kernel) turns a NaN or +inf logit, or a
    row of -inf, into a row `check_probabilities` refuses; a -inf here and there is a mask."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from specrt.runtime.sampling import check_probabilities

    graph = helper.make_graph(
        [helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1)],
        "softmax",
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", 64])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["rows", 64])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    logits = np.random.default_rng(0).normal(size=(5, 64)).astype(np.float32)
    logits[0, 40] = np.nan
    logits[1, 63] = np.inf
    logits[2] = -np.inf
    logits[3, ::2] = -np.inf  # a valid mask
    (probabilities,) = session.run(None, {"logits": logits})
    for row in range(3):
        with pytest.raises(NumericalError, match="the target model produced"):
            check_probabilities(probabilities[row], logits[row], "target")
    for row in (3, 4):
        check_probabilities(probabilities[row], logits[row], "target")
        expected = warp(logits[row], 1.0)
        assert np.abs(probabilities[row] - expected).max() < 1e-6


class FixedDraw:
    """An rng whose uniform draw is set by the test: sample() then has one right answer."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


@pytest.mark.parametrize("size", [1, 2, 5, 64, 65, 1000, 4096])
def test_sample_is_the_inverse_cdf(size):
    """For a grid of uniform draws u, `sample` returns the index whose CDF interval holds u x
    total (computed in float64 here); never a zero-weight one, even for u next to 1."""
    rng = np.random.default_rng(size)
    weights = rng.random(size).astype(np.float32)
    weights[rng.random(size) < 0.3] = 0.0
    weights[-1] = 0.0  # a zero-weight last entry: a clamp to the end must not reach it
    if not weights.any():
        weights[0] = 1.0
    cdf = np.cumsum(weights.astype(np.float64))
    for u in [*np.linspace(0, 1, 997, endpoint=False), 1 - 2**-53]:
        got = sample(weights, FixedDraw(u))
        assert weights[got] > 0
        target = u * cdf[-1]
        expected = int(np.searchsorted(cdf, target, side="right"))
        edges = cdf[max(expected - 1, 0) : expected + 1]
        if np.abs(edges - target).min() > 1e-5 * cdf[-1]:  # away from float32 rounding at edges
            assert got == expected, (u, got, expected)


def test_greedy_verify_with_the_backends_own_argmax():
    """A device backend brings back each row's argmax and max logit instead of the logits."""
    rng = np.random.default_rng(0)
    out = Forward(None, argmax=[2, 4, 1, 3], max_logit=np.full(4, 5.0, np.float32))
    assert verify([2, 4, 1], None, out, GREEDY, rng) == (3, 3)
    assert verify([2, 0, 1], None, out, GREEDY, rng) == (1, 4)
    for bad in (np.nan, np.inf, -np.inf):
        out.max_logit[1] = bad
        with pytest.raises(NumericalError, match="the target model produced NaN/inf"):
            verify([2, 4, 1], None, out, GREEDY, rng)


# -- seeded rows: draws keyed by position ------------------------------------------------------
@pytest.mark.parametrize("name", sorted(_cases()))
def test_keyed_verify_emits_the_targets_own_draws_whatever_was_drafted(name):
    """Coupled verification, enumerated over every draft of K = 2 tokens (each of V^2): the
    round emits the target's own draws at the row's positions (those of a target-only round,
    `KeyedDraws.token`), kept draft tokens and all, up to and including the first position
    whose draft differs from them; a draft equal to them is kept whole, then the bonus draw."""
    p, q = _cases()[name]
    p_rows = np.array([p, q, (p + q) / 2])  # three positions: two drafted, the bonus
    logits = np.zeros_like(p_rows)
    for seed in range(8):
        reference = KeyedDraws(np.random.default_rng([seed, 1]))
        own = [reference.token(p_rows[i], 40 + i) for i in range(3)]
        for drafted in np.ndindex(V, V):
            draws = KeyedDraws(np.random.default_rng([seed, 1]))
            draws.token(q, 40)  # the draft drew with the same noise first (as in a round)
            accepted, token = verify(list(drafted), None, Forward(logits, p_rows), PLAIN, draws, 40)
            kept = 0
            while kept < 2 and drafted[kept] == own[kept]:
                kept += 1
            assert (accepted, token) == (kept, own[kept]), (seed, drafted)


def test_keyed_draws_follow_the_weights():
    """`KeyedDraws.token` draws ``i`` with probability ``w_i`` (the exponential race), never a
    zero weight; the position's noise is the same for the draft and the target, and the next
    position's is new. Chi-square at false-alarm rate ALPHA per distribution."""
    rng = np.random.default_rng(9)
    for weights in (np.array([0.0, 0.25, 0.0, 0.75, 0.0]), rng.dirichlet(np.full(V, 0.5))):
        weights = weights.astype(np.float32)
        draws = KeyedDraws(np.random.default_rng(10))
        picks = [draws.token(weights, position) for position in range(5000)]
        counts = np.bincount(picks, minlength=len(weights))
        assert counts[weights == 0].sum() == 0
        assert chi_square_pvalue(counts, normalised(weights)) > ALPHA
    assert draws.token(weights, 4999) == picks[-1]  # the same noise at the same position


def normalised(weights: np.ndarray) -> np.ndarray:
    weights = weights.astype(np.float64)
    return weights / weights.sum()


def test_keyed_draws_check_can_fail():
    """The check above has power: uniform noise in place of exponential is caught."""

    class UniformNoise:
        def __init__(self) -> None:
            self.rng = np.random.default_rng(11)

        def standard_exponential(self, size: int, dtype: type) -> np.ndarray:
            return self.rng.random(size).astype(dtype)

    weights = np.array([0.1, 0.2, 0.7], np.float32)
    draws = KeyedDraws(UniformNoise())
    counts = np.bincount([draws.token(weights, i) for i in range(5000)], minlength=3)
    assert chi_square_pvalue(counts, normalised(weights)) < ALPHA


def test_keyed_noise_is_kept_only_ahead_of_the_row():
    """Verification at a position releases the noise of the positions before it (a long row
    keeps a few [V] blocks, not one per token); ahead of it, what a draft drew stays."""
    draws = KeyedDraws(np.random.default_rng(0))
    p = np.full(V, 1.0 / V)
    for position in range(100):
        for ahead in range(3):  # a draft of three tokens, then its verification
            draws.token(p, position + ahead)
        verify([], None, Forward(np.zeros((1, V)), p[None]), PLAIN, draws, position)
    assert sorted(draws._noise) == [99, 100, 101]
    with pytest.raises(ValueError, match="position 98 is behind"):
        draws.token(p, 98)
