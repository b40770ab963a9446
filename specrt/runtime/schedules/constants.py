"""The tunable constants of the learners that pick what a round drafts, with their units: the
one-row schedules (adaptive, heuristic), the load schedule (rows sharing calls) and the hybrid
proposer's choice between a match and the draft model (`specrt.runtime.hybrid`).

In one place so that two learners' knobs of one name cannot drift apart unseen: where they
differ (the verify slope bounds, the exploration spacing) each name says its owner.
Measured values, dated: CHANGELOG.md (the current results: docs/performance.md).
"""

from __future__ import annotations

# -- shared --------------------------------------------------------------------------------------
# Prior acceptance of a draft token (a probability), before rounds are seen: the adaptive
# schedule's first token of a round, the load schedule's every draft position.
PRIOR_ACCEPTANCE = 0.6

# -- adaptive schedule (one row) -----------------------------------------------------------------
ADAPTIVE_BINS = 10  # confidence bins (a count): the draft's probabilities in [0, 1], cut evenly
ADAPTIVE_PRIOR_WEIGHT = 2.0  # tokens reached: what a bin's prior weighs against its counts
ADAPTIVE_DECAY = 0.995  # a share: what a drafting round keeps of the older acceptance counts
ADAPTIVE_SMOOTHING = 0.05  # a share: the newest round's weight in the moving averages and fits
# Of a verification pass's seconds (a share), per extra position fed: the most the fitted slope
# may add to the cost of one more draft token (measured on the demo target: 4-8%).
ADAPTIVE_MAX_VERIFY_SLOPE = 0.1
ADAPTIVE_EXPLORE_EVERY = 32  # rounds without drafting before one drafts anyway, to re-measure
ADAPTIVE_MAX_STEP = 3  # times the average draft step (a ratio): the longest step counted
# A share of ADAPTIVE_SMOOTHING, per round without drafting: how fast the first token's
# acceptance drifts back to PRIOR_ACCEPTANCE, so drafting is retried now and then.
ADAPTIVE_PRIOR_DRIFT = 0.1

# -- heuristic schedule (one row) ----------------------------------------------------------------
HEURISTIC_START = 4  # tokens drafted in the first round (then +2 after a full accept, else -1)

# -- load schedule (rows sharing calls) ----------------------------------------------------------
LOAD_EXPLORE_EVERY = 32  # rounds between re-measuring a neighbour of the best K, at first
LOAD_EXPLORE_MAX_SPACING = 16  # times LOAD_EXPLORE_EVERY (a ratio): the longest between checks
LOAD_DECAY = 0.98  # a share: what a drafting round keeps of the acceptance counts
LOAD_WINDOW = 24  # rounds: times kept per K and batch size
LOAD_MARGIN = 0.03  # a share: by which more drafting must beat less to be chosen
LOAD_EXPLORE_SHARE = 0.02  # of the rounds' time (a share), at most, spent re-measuring K
LOAD_PRIOR_WEIGHT = 2.0  # tokens reached: what a position's PRIOR_ACCEPTANCE weighs
LOAD_CATCH_UP_SMOOTHING = 0.5  # a share: the newest catch-up's weight in its seconds per token
# The cost of verifying one more token of matches in every row, as a share of a round without
# them, assumed until rounds of that width are measured (low, so that they are tried).
MATCH_PRIOR_COST = 0.25
# The fitted cost of one more token of matches is taken as at least this share of the average
# cost of a token of the widest measured width (a flat or noisy fit would make every wider one
# look free).
MATCH_MIN_SLOPE = 0.5

# -- hybrid proposer (a match or the draft model, per round) --------------------------------------
# Bounds of the fitted cost of one more verified position, as a share of a verification pass's
# seconds (at the fit's centre): it is assumed at the lower one until two lengths were measured.
# Not ADAPTIVE_MAX_VERIFY_SLOPE: a match costs no draft steps, so only the pass is bounded.
HYBRID_MIN_VERIFY_SLOPE = 0.02
HYBRID_MAX_VERIFY_SLOPE = 1.0
HYBRID_VERIFY_SMOOTHING = 0.05  # a share: the newest pass's weight in the verification line
# Prior acceptance (a probability) of a match's first token, and of the ones after it.
FIRST_PRIOR = 0.5
LATER_PRIOR = 0.8
# A corpus's proposals (`specrt.runtime.corpus`): the first token's prior by its confidence
# bin (1-4), and the ones after it; what a corpus of SmolLM2's answers kept of its held-out
# answers' tokens (CHANGELOG.md, 2026-12-06): a corpus backs a continuation less than a row's
# own repeat does.
CORPUS_FIRST_PRIORS = (0.15, 0.3, 0.45, 0.7)
CORPUS_LATER_PRIOR = 0.45
HYBRID_PRIOR_WEIGHT = 2.0  # tokens reached: what a position's prior weighs against its counts
# A share, per round of the kind, of the counts behind a rate: the text drifts, and what was
# learned on one kind of text must give way within some tens of rounds on another.
MATCH_DECAY = 0.98
MODEL_DECAY = 0.95
# The model's rate before it is measured, as (tokens, one-position passes) of a round: 1.5
# tokens a round at 1.2 passes, weighing as much as MODEL_PRIOR_ROUNDS rounds: one bad first
# round must not rule the model out. The model drafts the first FIRST_MODEL_ROUNDS rounds it is
# asked to (to be measured at all), and once after HYBRID_EXPLORE_EVERY rounds of matches, to
# measure again.
MODEL_PRIOR_RATE = (1.5, 1.2)
MODEL_PRIOR_ROUNDS = 2.0  # rounds
FIRST_MODEL_ROUNDS = 4  # rounds
HYBRID_EXPLORE_EVERY = 32  # rounds since the model last drafted
MATCH_BINS = 4  # match lengths told apart (tokens matched): 1, 2, 3, 4 and more

# -- guard (a lone row: speculation only where it beats the target alone) -------------------------
GUARD_MIN_ROUNDS = 4  # rounds of a kind (model drafts, matches) in a probe, before its verdict
# Rounds of a kind before its first verdict: the schedules learn the pair in its first rounds
# (the adaptive one drafts short while its costs are measured on cold caches).
GUARD_FIRST_ROUNDS = 6
# Tokens a probe of matches verifies at most: a copy beats plain rounds with its first tokens
# already, and each position a match adds costs a real target's pass a share of a pass whether
# kept or not (what a poor probe costs: docs/performance.md). The model's probe drafts what its
# schedule chooses: a draft may pay only at its longer K (the demo pair's drafts cost about a
# target pass each: one or two tokens a round lose to plain rounds where four win).
GUARD_PROBE_MATCH = 1
# Rounds of a probe that keep nothing after which it ends: one, as a draft's prompt and steps
# can make a lost first round cost a fast (int4) target several plain rounds (the draft
# model's probe: only where those rounds lost `GUARD_EMPTY_LOSS`).
GUARD_EMPTY_ROUNDS = 1
# Plain rounds' worth (a count): what a model probe that kept nothing must have lost to end
# there. A cheaper empty start says little (the demo pair's draft, 1.4x the target alone, keeps
# nothing in half its first rounds, each losing 0.7 of a plain round); a draft catching up on a
# fast target loses more in one (SmolLM2's int4 one: 2.8).
GUARD_EMPTY_LOSS = 1.0
# A share: by how much a probe of matches must beat plain rounds to turn them on. Its rounds
# verify one token each, so one token kept in a probe's rounds looks like 1.1-1.2x plain ones
# while the match rounds after it keep nothing (SmolLM2's chat answers: turned on 2-3 times an
# answer, a few percent lost); a row that copies keeps its token every round (about 1.9x).
GUARD_MATCH_ON_MARGIN = 0.3
# Tokens of a match verified at most in the first round after a probe turned matches on again
# (they were judged a loss before), doubled after each round that keeps them all: a probe's
# one-token rounds can keep two tokens by luck, and a full-length match right after it cost
# SmolLM2's int4 target 2.7 plain rounds and kept nothing (docs/performance.md).
GUARD_MATCH_RAMP = 2
# A bundle's corpus: its probe's rounds (one token each), and by how much they must beat plain
# rounds. A corpus of SmolLM2's answers keeps 0.3-0.35 of its first tokens on held-out ones:
# rounds of one token then emit 1.3x a plain round's tokens for 1.05x its time on the float32
# target, so the matches' margin would turn it off, and four rounds say too little.
GUARD_CORPUS_ROUNDS = 12
GUARD_CORPUS_ON_MARGIN = 0.05
GUARD_DECAY = 0.9  # a share: what a kind's round keeps of the older tokens and seconds
# Plain rounds timed before any kind is judged: three, so that one the machine slowed (another
# process, a page fault) is the median's outlier, not half of a mean, and a poor draft is not
# judged a gain on it (then kept on until the next plain round, up to `GUARD_PLAIN_EVERY`).
GUARD_PLAIN_SAMPLES = 3
GUARD_PLAIN_KEPT = 8  # plain rounds whose median is the target alone's time per token
GUARD_PLAIN_EVERY = 32  # rounds: the longest without a plain one (the pass cost drifts)
GUARD_FIRST_WAIT = 4  # rounds of the others before a kind judged a loss is probed
GUARD_MAX_WAIT = 128  # rounds: the longest wait, doubled after each probe that still lost
# At most this share of the time goes to probing a kind that loses (both kinds and the first
# probes of a request must stay within 3% of the target alone): a probe that lost n plain
# rounds' worth of time waits n / GUARD_PROBE_BUDGET rounds (a draft catching up after many
# rounds off costs several passes of a fast target: SmolLM2's int4 one).
GUARD_PROBE_BUDGET = 0.01
GUARD_COPY_SPACING = 4  # rounds off, at least, between probes of matches where a row copies
GUARD_ROW_PROBE = 4  # a row's round at which a kind that is off is probed anyway
