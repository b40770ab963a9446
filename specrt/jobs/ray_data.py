"""Scale out on Ray Data: one generator per actor, rows mapped to results.

    import ray
    from specrt.jobs.ray_data import SpecrtPredictor

    rows = ray.data.read_json("rows.jsonl")  # or read_parquet: columns id, prompt, ...
    results = rows.map_batches(
        SpecrtPredictor,
        fn_constructor_kwargs={"bundle": "engines/demo", "max_new_tokens": 128},
        # 1 to 4 actors, each loading the bundle once and taking a CPU (a fixed size waits
        # forever where Ray has too few CPUs for it and the reading)
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=4),
        batch_size=16,
    )
    results.write_parquet("results/")

Rows are those of `specrt batch` (``id``, ``prompt``, optional ``max_new_tokens``,
``temperature``, ``top_k``, ``top_p``, ``seed``, ``num_draft_tokens``, ...); the dataset's other
columns come through to the results unchanged. A row that cannot run comes back with its
message in the ``error`` column instead of failing the job. Needs the ``ray`` extra;
`specrt.runtime` never imports Ray.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from specrt.chat import FIELDS as RENDERING_FIELDS
from specrt.errors import InvalidInputError
from specrt.jobs.batch import bundle_chat_template, make_request
from specrt.jobs.rows import ROW_OPTIONS, row_from_item
from specrt.runtime.config import GenerationConfig
from specrt.runtime.generator import SpeculativeGenerator
from specrt.runtime.lookup import SuffixCache

STATS = ("new_tokens", "rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate")
OUTPUT_COLUMNS = ("id", "text", "token_ids", "finish_reason", "error", *STATS)
# Where the predictor is given ``logprobs=N``: per row, a list an entry per new token
LOGPROBS_COLUMNS = ("logprobs", "top_token_ids", "top_logprobs")
# The columns a row is read from (`row_from_item`); the others pass through.
ROW_COLUMNS = {"id", "prompt", "messages", "custom_id", "body", *ROW_OPTIONS, *RENDERING_FIELDS}


class SpecrtPredictor:
    """A callable class for ``Dataset.map_batches``: ``bundle`` and load options (``threads``,
    default 1: actors share the machine's cores; ``engine``, ``max_length``) and the generation
    defaults (`GenerationConfig` fields) as constructor keywords; as with `specrt batch`, the
    hybrid proposer and the adaptive schedule unless given. ``max_batch``: rows of a Ray batch
    that share each model call (the onnxruntime engine and the portable graph).
    ``suffix_cache_tokens``: > 0 keeps a suffix cache of that many tokens per actor (rows then
    propose from earlier rows' text). ``chat_template``: rows of chat ``messages`` render with
    it in place of the bundle's (a Jinja file, or the template itself). ``logprobs=N`` adds
    the columns ``logprobs`` (each new token's), ``top_token_ids`` and ``top_logprobs`` (its N
    most likely tokens'): the columns are the predictor's, so a row cannot ask for them on its
    own."""

    def __init__(
        self,
        bundle: str,
        threads: int | None = 1,
        engine: str = "auto",
        max_length: int | None = None,
        max_batch: int = 8,
        suffix_cache_tokens: int = 0,
        chat_template: str | None = None,
        **generation: Any,
    ) -> None:
        options = {"threads": threads, "engine": engine, "max_batch": max_batch}
        if max_length is not None:
            options["max_length"] = max_length
        cache = SuffixCache(suffix_cache_tokens) if suffix_cache_tokens else None
        self.generator = SpeculativeGenerator.from_bundle(bundle, suffix_cache=cache, **options)
        self.defaults = GenerationConfig(**generation)
        self.chat_template = chat_template
        if chat_template is not None and self.generator.tokenizer is not None:  # now, not per row
            bundle_chat_template(self.generator.tokenizer.directory, chat_template)
        # The results' columns, one set for every batch (Arrow blocks must agree)
        self.columns = OUTPUT_COLUMNS + (
            LOGPROBS_COLUMNS if self.defaults.logprobs is not None else ()
        )

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        columns = {name: list(values) for name, values in batch.items()}
        count = len(next(iter(columns.values()))) if columns else 0
        out: dict[str, list] = {name: [] for name in self.columns}
        kept = [name for name in columns if name not in ROW_COLUMNS]  # the user's own columns
        clash = sorted(set(kept) & set(self.columns))
        if clash:
            raise InvalidInputError(
                f"the dataset's column(s) {clash} would be overwritten by the results; rename "
                "them (rows are read from id, prompt and the generation settings)"
            )
        cells = {name: _cells(batch[name]) for name in columns if name in ROW_COLUMNS}
        rows, records, requests = [], {}, []
        for index in range(count):
            item = {name: values[index] for name, values in cells.items()}
            item = {name: value for name, value in item.items() if value is not None}
            rows.append(row_from_item(item, f"row {index}"))
            request = make_request(
                self.generator, rows[-1], self.defaults, False, self.chat_template
            )
            if isinstance(request, dict):
                records[index] = request
            else:
                requests.append(replace(request, key=index))  # ids need not be unique here
        for index, result in self.generator.run(requests):
            records[index] = result.to_dict()
        for index, row in enumerate(rows):
            record = records[index]
            stats = record.get("stats", {})
            out["id"].append(str(row.id))  # one type for the column, whatever the lines
            out["text"].append(record.get("text", ""))
            out["token_ids"].append(record.get("token_ids", []))
            out["finish_reason"].append(record.get("finish_reason", "error"))
            out["error"].append(record["error"]["message"] if "error" in record else None)
            for name in STATS:
                out[name].append(stats.get(name, 0))
            if "logprobs" in out:  # each new token's, and its most likely ones' ids and values
                entries = record.get("logprobs", [])
                out["logprobs"].append([e["logprob"] for e in entries])
                out["top_token_ids"].append([[t for t, _ in e["top"]] for e in entries])
                out["top_logprobs"].append([[lp for _, lp in e["top"]] for e in entries])
        for name in kept:
            out[name] = columns[name]
        return out


def _cells(values: Any) -> list:
    """A column's cells as plain values. Ray hands an integer column with missing cells over
    as floats (NaN where missing): its whole numbers are integers again, as the lines gave
    them (ids, max_new_tokens)."""
    cells = [_plain(value) for value in values]
    if isinstance(values, np.ndarray) and values.dtype.kind == "f" and np.isnan(values).any():
        cells = [int(c) if isinstance(c, float) and c.is_integer() else c for c in cells]
    return cells


def _plain(value: Any) -> Any:
    """A dataset cell as a plain Python value; a missing one (null, NaN) as None."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, np.ndarray):  # a list column (stop strings)
        value = value.tolist()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value
