"""Many prompts at once: rows share every model call, each with its own settings.

python examples/batch.py engines/demo
"""

import sys

from specrt import GenerationConfig, SpeculativeGenerator

generator = SpeculativeGenerator.from_bundle(sys.argv[1], max_batch=4)
prompts = ["def fibonacci(n):", "class Stack:", "import os\n", "for i in range(10):"]
config = GenerationConfig(max_new_tokens=32)  # the hybrid proposer, the adaptive schedule
for prompt, result in zip(prompts, generator.generate(prompts, config)):  # in prompt order
    print(f"{prompt!r} -> {result.text!r} ({result.finish_reason})")
