"""The text side of a streaming round: each row's deltas and stop-string search, per round.

    .venv/bin/python bench/detokenize.py [--rows 16] [--lengths 256 1024 4096]

A service hands every running row its new text after each round (`streaming.TextDeltas`) and
searches rows with stop strings for them (`stopping.StopStrings`). Both take a ``decode``:
the full decode of the row's new tokens every round, or the incremental one
(`BundleTokenizer.incremental`), which decodes each token once. This replays rows growing by 1-5
tokens a round (the demo tokenizer, token ids of the held-out prompts' text) through both, side
by side, and prints the milliseconds a round of ``--rows`` rows spends on text as the rows grow.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from specrt.prompts import read_prompt_file
from specrt.runtime.stopping import StopStrings
from specrt.runtime.streaming import TextDeltas
from specrt.runtime.tokenizer import IncrementalDecode

REPO = Path(__file__).resolve().parents[1]
STOP = ["<|never|>"]  # searched every round, never found


def text_ms_per_round(
    ids: list[int], rows: int, decode_for_row: Callable[[], Callable], seed: int = 0
) -> list[tuple[int, float]]:
    """``(row length, milliseconds)`` for each round of ``rows`` rows growing through ``ids``."""
    rng = np.random.default_rng(seed)
    states = [
        (TextDeltas(decode_for_row(), STOP), StopStrings(STOP, decode_for_row()))
        for _ in range(rows)
    ]
    times, count = [], 0
    while count < len(ids):
        count = min(len(ids), count + int(rng.integers(1, 6)))
        started = time.perf_counter()
        for deltas, stopper in states:
            assert stopper.check(ids[:count]) is None
            deltas.update(ids[:count])
        times.append((count, (time.perf_counter() - started) * 1e3))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default=str(REPO / "models/demo/tokenizer"))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    args = parser.parse_args()

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    text = "".join(read_prompt_file(REPO / "models/demo/heldout_prompts.jsonl"))
    ids = tokenizer.encode(text).ids
    ids = (ids * (1 + max(args.lengths) // len(ids)))[: max(args.lengths)]

    def full():
        return lambda row_ids: tokenizer.decode(row_ids, skip_special_tokens=True)

    def incremental():
        return IncrementalDecode(tokenizer)

    runs = {"full": text_ms_per_round(ids, args.rows, full)}
    runs["incremental"] = text_ms_per_round(ids, args.rows, incremental)
    for length in args.lengths:
        row = {"rows": args.rows, "tokens_per_row": length}
        for name, times in runs.items():  # the rounds of the last 32 tokens up to `length`
            near = [ms for count, ms in times if length - 32 < count <= length]
            row[f"{name}_ms_per_round"] = round(float(np.median(near)), 3)
        row["ratio"] = round(row["full_ms_per_round"] / row["incremental_ms_per_round"], 1)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
