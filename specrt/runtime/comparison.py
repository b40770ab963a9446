"""Speculative decoding measured against the target alone on the same prompts, in one run."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace

from specrt.runtime.config import GenerationConfig
from specrt.runtime.generator import Prompt, SpeculativeGenerator
from specrt.runtime.results import GenerationResult

WARM_UP_TOKENS = 8


@dataclass
class Comparison:
    target_only_tokens_per_second: float
    speedup: float  # speculative tokens/s over the target alone's
    identical_output: bool

    def to_dict(self) -> dict:
        return asdict(self)


def compare_with_target_only(
    generator: SpeculativeGenerator, prompts: Sequence[Prompt], config: GenerationConfig
) -> Iterator[tuple[GenerationResult, Comparison]]:
    """Each prompt generated with ``config``, then by the target alone with the same settings."""
    baseline = replace(config, num_draft_tokens=0)
    generator.encode_prompts(prompts)  # every prompt is checked before any work starts
    # First calls pay one-off costs: warm both modes up before timing either. What the
    # learners saw of those few cold rounds is then forgotten: the timed run starts as a
    # fresh process's first request would, one-off costs aside.
    for warm in (config, baseline):
        generator.generate(
            prompts[:1], replace(warm, max_new_tokens=min(WARM_UP_TOKENS, config.max_new_tokens))
        )
    generator.forget_learning()
    # Each mode reads each prompt itself (a finished row's kept copy would spare the second)
    generator.forget_kept_rows()
    for prompt, result in zip(prompts, generator.stream(prompts, config)):
        generator.forget_kept_rows()
        [alone] = generator.generate([prompt], baseline)
        generator.forget_kept_rows()
        yield (
            result,
            Comparison(
                target_only_tokens_per_second=alone.stats.tokens_per_second,
                speedup=result.stats.tokens_per_second / alone.stats.tokens_per_second,
                identical_output=alone.token_ids == result.token_ids,
            ),
        )
