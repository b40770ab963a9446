"""`specrt bench`: every contender on the same prompts, interleaved in one run."""
