"""The speculative decoding runtime: numpy + onnxruntime + tokenizers, nothing else.

from specrt.runtime import GenerationConfig, SpeculativeGenerator
gen = SpeculativeGenerator.from_bundle("engines/demo")
[result] = gen.generate(["def fibonacci(n):"], GenerationConfig(max_new_tokens=64))
"""

from specrt.runtime.config import GenerationConfig, SamplingParams
from specrt.runtime.generator import SpeculativeGenerator
from specrt.runtime.logprobs import TokenLogprob
from specrt.runtime.lookup import SuffixCache
from specrt.runtime.results import GenerationResult, GenerationStats
from specrt.structured import StructuredOutput

__all__ = [
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "SamplingParams",
    "SpeculativeGenerator",
    "StructuredOutput",
    "SuffixCache",
    "TokenLogprob",
]
