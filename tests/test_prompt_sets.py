"""The prompt sets the shipped drafts and heads are trained on: a held-out prompt that leaked into
a training set would make every acceptance reported on it a measure of memory, not of drafting."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrt.prompts import read_prompt_file

SMOLLM2 = Path(__file__).resolve().parents[1] / "models" / "smollm2"
TRAINING_SETS = ["train_prompts.jsonl", "diverse_prompts.jsonl", "head_prompts.jsonl"]


def _normal(prompt: str) -> str:
    return " ".join(prompt.lower().split())


@pytest.mark.parametrize("name", TRAINING_SETS)
def test_training_set_never_holds_a_heldout_prompt(name):
    heldout = {_normal(p) for p in read_prompt_file(SMOLLM2 / "heldout_prompts.jsonl")}
    prompts = read_prompt_file(SMOLLM2 / name)
    assert prompts and heldout
    assert not heldout & {_normal(p) for p in prompts}


def test_diverse_sets_ask_each_prompt_once():
    """The head trains on both sets at once: a prompt in both would be weighed twice."""
    prompts = [
        _normal(p)
        for name in ["diverse_prompts.jsonl", "head_prompts.jsonl"]
        for p in read_prompt_file(SMOLLM2 / name)
    ]
    assert len(set(prompts)) == len(prompts)


def test_demo_head_never_trains_on_the_texts_it_is_measured_on():
    """The demo head is measured on click's source and on the pair's held-out standard library
    files (`bench/proposers.py`): none may be among its training prompts' sources."""
    import json

    demo = SMOLLM2.parent / "demo"
    lines = (demo / "head_train_prompts.jsonl").read_text().splitlines()
    files = {json.loads(line)["file"] for line in lines}
    heldout = {json.loads(line)["file"] for line in (demo / "heldout_prompts.jsonl").open()}
    assert len(lines) == 6000 and heldout
    assert not files & heldout
    assert not any(file.split("/")[0] == "click" for file in files)
