"""Generate from a bundle with speculative decoding, and compare with the target alone.

python examples/generate.py engines/demo 'def fibonacci(n):'
"""

import sys

from specrt import GenerationConfig, SpeculativeGenerator

bundle, prompt = sys.argv[1], sys.argv[2]
generator = SpeculativeGenerator.from_bundle(bundle)
config = GenerationConfig(max_new_tokens=64)  # the hybrid proposer, the adaptive schedule
[result] = generator.generate([prompt], config)
[alone] = generator.generate([prompt], GenerationConfig(max_new_tokens=64, num_draft_tokens=0))
print(result.text)
print(f"identical to the target alone: {result.token_ids == alone.token_ids}")
print(f"{result.stats.tokens_per_round:.2f} tokens per target pass")
