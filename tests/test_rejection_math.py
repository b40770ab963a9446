"""The sampler's math: exact enumeration (no sampling) and its statistical behaviour."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.errors import NumericalError
from specrt.runtime import rejection
from specrt.runtime.rejection import (
    acceptance_probabilities,
    greedy_verify,
    rejection_sample,
    residual_distribution,
)
from specrt.runtime.sampling import sample, warp
from tests.stats import chi_square_pvalue

V = 6


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


def emitted_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """P(emitted token = y) for one drafted position, enumerated over the draft token x ~ q:
    accepted with probability a(x) (emit x), else emit from the residual."""
    emitted = np.zeros_like(p)
    residual = residual_distribution(p, q)
    for x in range(len(p)):
        accept = acceptance_probabilities(p[x : x + 1], q[x : x + 1])[0]
        emitted[x] += q[x] * accept
        emitted += q[x] * (1.0 - accept) * residual
    return emitted


@pytest.mark.parametrize("name", sorted(_cases()))
def test_one_position_emits_exactly_p(name):
    p, q = _cases()[name]
    assert np.abs(emitted_distribution(p, q) - p).max() < 1e-9


def test_two_positions_joint_is_exactly_target():
    """Joint law of the first two emitted tokens when K = 2 and the target's second distribution
    depends on the first token. A round that stops after one token leaves the second to the next
    round, whose first token follows p exactly (previous test)."""
    rng = np.random.default_rng(7)
    for _ in range(10):
        p1, q1 = _random(rng), _random(rng, zeros=2)
        p2 = {x: _random(rng, zeros=x % 3) for x in range(V)}  # p2(. | x1)
        q2 = {x: _random(rng, zeros=(x + 1) % 3) for x in range(V)}
        joint = np.zeros((V, V))
        residual1 = residual_distribution(p1, q1)
        for x1 in range(V):
            a1 = acceptance_probabilities(p1[x1 : x1 + 1], q1[x1 : x1 + 1])[0]
            # accepted x1: the second token comes from position 2 of the same round
            joint[x1] += q1[x1] * a1 * emitted_distribution(p2[x1], q2[x1])
            # rejected: y1 from the residual, y2 from the next round, i.e. p2(. | y1)
            for y1 in range(V):
                joint[y1] += q1[x1] * (1 - a1) * residual1[y1] * p2[y1]
        expected = p1[:, None] * np.stack([p2[x] for x in range(V)])
        assert np.abs(joint - expected).max() < 1e-9


def test_guards():
    p = np.array([0.2, 0.3, 0.5])
    # q(x) = 0 rejects instead of dividing by zero
    assert acceptance_probabilities(p, np.array([0.0, 0.5, 0.5]))[0] == 0.0
    # a residual without mass falls back to p
    assert np.array_equal(residual_distribution(p, p.copy()), p)
    assert np.allclose(residual_distribution(p, np.array([0.3, 0.3, 0.4])), [0, 0, 1])


# ---------------------------------------------------------------------------------------------
# The real `rejection_sample` (random draws included) against p. Each chi-square test below has
# a false-alarm rate of ALPHA; the seeds are fixed, so a pass is reproducible.
ALPHA = 1e-4
DRAWS = 20_000


def _first_tokens(p, q, draft_tokens_rng, seed):
    rng = np.random.default_rng(seed)
    k = q.shape[0]
    counts = np.zeros(p.shape[1])
    for _ in range(DRAWS):
        drafted = np.array([sample(q[i], draft_tokens_rng) for i in range(k)])
        n, token = rejection_sample(drafted, q, p, rng)
        counts[drafted[0] if n > 0 else token] += 1
    return counts


def test_rejection_sample_first_token_follows_p():
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
    monkeypatch.setattr(rejection, "residual_distribution", lambda p_i, q_i: p_i)
    counts = _first_tokens(p, q, np.random.default_rng(4), seed=5)
    assert chi_square_pvalue(counts, p[0]) < ALPHA


def test_sample_never_draws_zero_probability_tokens():
    rng = np.random.default_rng(0)
    probs = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    draws = np.bincount([sample(probs, rng) for _ in range(5000)], minlength=5)
    assert draws[[0, 2, 4]].sum() == 0
    assert chi_square_pvalue(draws, probs) > ALPHA


# ---------------------------------------------------------------------------------------------
def test_warp_temperature_top_k_top_p_match_their_definitions():
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(50, 20)) * 3
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (0.5, 8, 0.6)]:
        probs = warp(logits, temperature, top_k, top_p)
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
            assert np.allclose(got, soft, atol=1e-12)
            # the loop's float32 warp: the same distribution to float32 rounding
            fast = warp(row.astype(np.float32), temperature, top_k, top_p, dtype=np.float32)
            assert fast.dtype == np.float32 and np.abs(fast - soft).max() < 1e-6
            assert np.array_equal(fast == 0, soft == 0)  # the same tokens filtered out


def test_greedy_verify():
    logits = np.full((4, 5), -1.0)
    logits[[0, 1, 2, 3], [2, 4, 1, 3]] = 5.0  # target argmax per position: 2, 4, 1, 3
    assert greedy_verify(np.array([2, 4, 1]), logits) == (3, 3)  # all accepted, bonus 3
    assert greedy_verify(np.array([2, 0, 1]), logits) == (1, 4)  # rejected at 1, correction 4
    assert greedy_verify(np.array([], dtype=np.int64), logits[:1]) == (0, 2)


def test_nan_and_inf_logits_raise():
    logits = np.zeros((2, 5))
    logits[1, 3] = np.nan
    with pytest.raises(NumericalError, match="NaN/inf"):
        greedy_verify(np.array([0]), logits)
    logits[1, 3] = np.inf
    with pytest.raises(NumericalError, match="NaN/inf"):
        greedy_verify(np.array([0]), logits)
    logits[1] = -np.inf  # a row with nothing to choose
    with pytest.raises(NumericalError, match="NaN/inf"):
        greedy_verify(np.array([0]), logits)
    # Sampling checks in the warp, row by row.
    for bad in (np.nan, np.inf):
        row = np.zeros(5)
        row[2] = bad
        with pytest.raises(NumericalError, match="the draft model produced 1 NaN/inf"):
            warp(row, 1.0, who="draft")
    with pytest.raises(NumericalError):
        warp(np.full(5, -np.inf), 1.0, who="target")
    masked = np.array([0.0, -np.inf, 1.0, -np.inf, 2.0])  # -inf here and there is a valid mask
    assert warp(masked, 1.0, who="target")[[1, 3]].tolist() == [0.0, 0.0]


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
