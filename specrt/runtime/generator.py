"""The speculative loop: draft K, verify all K in ONE target pass, accept/reject, roll back."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specrt.bundle import Manifest, ModelSpec, read_manifest, verify_checksums
from specrt.engines.ort_session import create_session, default_providers
from specrt.errors import InvalidInputError, PairMismatchError
from specrt.runtime.config import GenerationConfig
from specrt.runtime.decoder import Decoder, make_decoder
from specrt.runtime.draft_length import (
    DraftLengthController,
    DraftSchedule,
    HeuristicController,
)
from specrt.runtime.drafters import Drafter, ModelDrafter
from specrt.runtime.rejection import greedy_accept, rejection_sample
from specrt.runtime.results import GenerationResult, GenerationStats
from specrt.runtime.sampling import LOOP_DTYPE, WarpedRows, greedy_choice
from specrt.runtime.tokenizer import BundleTokenizer

Prompt = str | Sequence[int]
ENGINE_CHOICES = ("auto", "portable", "onnxruntime")
DEFAULT_MAX_LENGTH = 8192  # positions of preallocated KV cache per engine model


class SpeculativeGenerator:
    """Generates with a target model, optionally sped up by a drafter; output as the target's.

    The models' caches and output arrays belong to the generator, so rows run one at a time: a
    lock serialises rows from several threads (load one generator per thread to run them in
    parallel)."""

    def __init__(
        self,
        target: Decoder,
        drafter: Drafter,
        tokenizer: BundleTokenizer | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._lock = threading.Lock()
        self._schedules: dict[tuple[str, int, bool], DraftSchedule] = {}

    @classmethod
    def from_bundle(
        cls,
        bundle_dir: str | Path,
        threads: int | None = None,
        providers: Sequence[str] | None = None,
        check_files: bool = True,
        draft_threads: int = 1,
        engine: str = "auto",
        max_length: int | None = DEFAULT_MAX_LENGTH,
    ) -> SpeculativeGenerator:
        """Load a bundle by its manifest; with ``check_files`` every file's sha256 is verified.

        ``threads``: the target's intra-op threads (default: all cores). ``draft_threads``: the
        draft's (default 1: see `specrt.engines.ort_session` for why). ``engine``: ``"auto"``
        runs each model's onnxruntime engine where the bundle has one, else its portable graph;
        ``"portable"`` or ``"onnxruntime"`` insist on one (the latter fails if it is missing).
        ``max_length``: the longest sequence (prompt + new tokens) the engines' preallocated KV
        caches hold, at most the model's max positions (None: the model's max positions)."""
        if max_length is not None and (not isinstance(max_length, int) or max_length < 2):
            raise InvalidInputError(f"max_length={max_length!r}: use an integer >= 2 (or None)")
        if engine not in ENGINE_CHOICES:
            raise InvalidInputError(f"engine={engine!r}: use one of {', '.join(ENGINE_CHOICES)}")
        root = Path(bundle_dir)
        manifest = read_manifest(root)
        if check_files:
            verify_checksums(manifest, root)
        _check_pair(manifest)
        decoders = {}
        for role, spec in manifest.models.items():
            view = _engine_view(spec, role, engine, list(providers or default_providers()))
            session = create_session(
                root / view.path,
                threads=draft_threads if role == "draft" else threads,
                providers=providers,
            )
            decoders[role] = make_decoder(session, view, manifest.vocab_size, role, max_length)
        tokenizer = BundleTokenizer(root / manifest.tokenizer.path, manifest.tokenizer)
        return cls(
            decoders["target"],
            ModelDrafter(decoders["draft"]),
            tokenizer,
            manifest.tokenizer.eos_token_ids,
        )

    # ----------------------------------------------------------------------------------------
    def encode_prompts(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """Tokenize and check every prompt before any work starts."""
        if isinstance(prompts, str):
            raise InvalidInputError("prompts must be a list of prompts, not a single string")
        if len(prompts) == 0:
            raise InvalidInputError("no prompts given")
        encoded = []
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise InvalidInputError("this generator has no tokenizer; pass token ids")
                ids = self.tokenizer.encode(prompt)
            else:
                ids = [int(t) for t in prompt]
                if not ids:
                    raise InvalidInputError(f"prompt {index} is empty; give at least one token")
                bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
                if bad:
                    raise InvalidInputError(
                        f"prompt {index} has token id(s) {bad[:5]} outside the vocabulary "
                        f"[0, {self.target.vocab_size})"
                    )
            limit = self.target.max_positions
            if len(ids) >= limit:
                raise InvalidInputError(
                    f"prompt {index} has {len(ids)} tokens; at most {limit} positions fit (the "
                    "model's max positions, or the max length the generator was loaded with), "
                    f"which leaves no room to generate. Shorten it to at most {limit - 1} tokens"
                    " or load with a larger max length (--max-length)"
                )
            encoded.append(ids)
        return encoded

    def generate(
        self, prompts: Sequence[Prompt], config: GenerationConfig | None = None
    ) -> list[GenerationResult]:
        """Generate for each prompt (a string or token ids). Rows run one after another."""
        return list(self.stream(prompts, config))

    def stream(self, prompts: Sequence[Prompt], config: GenerationConfig | None = None):
        """Like `generate`, yielding each row's result as soon as it is done."""
        config = config or GenerationConfig()
        encoded = self.encode_prompts(prompts)
        for row, ids in enumerate(encoded):
            rng = np.random.default_rng(None if config.seed is None else [config.seed, row])
            with self._lock:
                result = self._generate_row(ids, config, rng)
            yield result

    def _draft_schedule(self, k_max: int, config: GenerationConfig) -> DraftSchedule:
        """One per schedule, K limit and mode, kept across rows and calls: what it learns (the
        draft's calibration, the machine's costs) holds for the pair, not for one prompt."""
        key = (config.draft_schedule, k_max, config.greedy)
        if key not in self._schedules:
            if config.draft_schedule == "heuristic":
                self._schedules[key] = HeuristicController(k_max)
            else:
                self._schedules[key] = DraftLengthController(k_max)
        return self._schedules[key]

    # ----------------------------------------------------------------------------------------
    def _generate_row(
        self, prompt: list[int], config: GenerationConfig, rng: np.random.Generator
    ) -> GenerationResult:
        start = time.perf_counter()
        target, drafter = self.target, self.drafter
        k_max = config.num_draft_tokens
        stats = GenerationStats(prompt_tokens=len(prompt), accepted_per_position=[0] * k_max)
        tokens = list(prompt)
        limit = min(target.max_positions, len(prompt) + config.max_new_tokens)
        finish_reason = "length"

        # Prefill: both models see everything but the last prompt token, which every round feeds.
        target.reset()
        drafter.reset()
        if len(prompt) > 1:
            target.prefill(prompt[:-1])
            if k_max:
                drafter.prefill(prompt[:-1])

        schedule = None
        if config.draft_schedule != "fixed" and k_max:
            schedule = self._draft_schedule(k_max, config)
        keep_going = schedule.keep_drafting if schedule else None
        unwarped = config.unwarped  # the graphs' softmax is the sampling distribution
        while len(tokens) < limit:
            # A round emits at most k+1 tokens and every fed position must fit in each model.
            k = max(0, min(k_max, limit - len(tokens) - 1, drafter.max_positions - len(tokens)))
            if schedule:
                k = schedule.start_round(k)
            round_start = time.perf_counter()
            drafted, q = drafter.propose(tokens, k, config, rng, keep_going)
            drafted_at = time.perf_counter()
            k = len(drafted)
            drafted_ids = drafted.tolist()
            fed = tokens[target.length :] + drafted_ids
            logits = target.forward(fed)[-(k + 1) :]
            if config.greedy:  # the target's argmax per position
                choice = greedy_choice(logits, "target")
                n, next_token = greedy_accept(drafted_ids, choice)
            else:
                probabilities = target.probabilities
                p = WarpedRows(
                    logits,
                    config.temperature,
                    config.top_k,
                    config.top_p,
                    "target",
                    LOOP_DTYPE,
                    probabilities[-(k + 1) :] if probabilities is not None and unwarped else None,
                )
                n, next_token = rejection_sample(drafted, q, p, rng)
            if schedule:
                now = time.perf_counter()
                schedule.update(k, n, drafted_at - round_start, now - drafted_at)

            stats.rounds += 1
            stats.drafted_tokens += k
            stats.accepted_tokens += n
            for i in range(n):
                stats.accepted_per_position[i] += 1

            emitted = [*drafted_ids[:n], next_token]
            # Roll back: each cache keeps only what is still history (all but the newest token).
            target.rollback(len(tokens) + n)
            tokens.extend(emitted)
            drafter.rollback(len(tokens) - 1)

            if not config.ignore_eos and not self.eos_token_ids.isdisjoint(emitted):
                stop_at = next(i for i, t in enumerate(emitted) if t in self.eos_token_ids)
                del tokens[len(tokens) - len(emitted) + stop_at + 1 :]
                finish_reason = "stop"
                break

        new_ids = tokens[len(prompt) :]
        stats.new_tokens = len(new_ids)
        text = self.tokenizer.decode(new_ids) if self.tokenizer is not None else ""
        stats.finish(time.perf_counter() - start)
        return GenerationResult(text, new_ids, finish_reason, stats)


def _check_pair(manifest: Manifest) -> None:
    """Refuse a bundle whose draft and target were exported with different tokenizers (the
    vocabulary widths are checked by `read_manifest`)."""
    target, draft = manifest.models["target"], manifest.models["draft"]
    if target.tokenizer_hash != draft.tokenizer_hash:
        raise PairMismatchError(
            "draft and target were exported with different tokenizers (hash "
            f"{draft.tokenizer_hash[:12]} vs {target.tokenizer_hash[:12]}); a draft must share the "
            "target's tokenizer: pick a draft from the same model family and re-export"
        )


def _engine_view(spec: ModelSpec, role: str, engine: str, providers: list[str]) -> ModelSpec:
    has_engine = "onnxruntime" in spec.engines
    # The engine's in-place cache lives in host memory; on a GPU provider every call would copy
    # it across, so auto takes the portable graph there (not measured: no GPU in our CI).
    on_cpu = providers[0] == "CPUExecutionProvider"
    if engine == "portable" or (engine == "auto" and not (has_engine and on_cpu)):
        return spec
    if not on_cpu:
        raise InvalidInputError(
            f"the onnxruntime engine keeps its KV cache in host memory and runs on the CPU "
            f"provider only (asked for {providers[0]}); use engine 'portable' or 'auto' on GPU"
        )
    if not has_engine:
        raise InvalidInputError(
            f"the bundle's {role} has no onnxruntime engine (`specrt export` builds one for "
            "llama/qwen2/mistral); use engine 'auto' or 'portable', or re-export the bundle"
        )
    return spec.engine_view("onnxruntime")
