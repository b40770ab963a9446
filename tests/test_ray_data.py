"""Ray Data: a real local Ray instance, two actors each loading the bundle, rows mapped to the
results a single process gives (ids kept, bad rows in the error column)."""

from __future__ import annotations

import pytest

from specrt.jobs.batch import run_row
from specrt.jobs.rows import row_from_item
from specrt.runtime import GenerationConfig, SpeculativeGenerator


def test_the_datasets_own_columns_come_through(llama_bundle):
    """The predictor is a plain callable (no Ray here): columns that are not a row's fields
    (a dataset's labels, sources) come back unchanged beside the results, where they used to
    make every row an error; a column the results would overwrite is named up front."""
    import numpy as np

    from specrt.errors import InvalidInputError
    from specrt.jobs.ray_data import SpecrtPredictor

    predictor = SpecrtPredictor(str(llama_bundle), max_new_tokens=4, ignore_eos=True)
    batch = {
        "id": np.array(["a", "b"]),
        "prompt": np.array(["Simple is", "def fibonacci(n):"]),
        "source": np.array(["x.py", "y.py"]),
        "label": np.array([1, 2]),
    }
    out = predictor(batch)
    assert out["error"] == [None, None] and [len(t) for t in out["token_ids"]] == [4, 4]
    assert list(out["source"]) == ["x.py", "y.py"] and list(out["label"]) == [1, 2]
    missing = predictor({"id": np.array(["c"]), "source": np.array(["z.py"])})
    assert missing["error"] == ['a line needs a "prompt" string (or chat "messages")']
    with pytest.raises(InvalidInputError, match=r"column\(s\) \['text'\] would be overwritten"):
        predictor({**batch, "text": np.array(["t", "u"])})


def test_log_probabilities_are_the_predictors_columns(llama_bundle):
    """``SpecrtPredictor(..., logprobs=N)``: columns of each new token's log-probability and
    its N most likely tokens, the values `generate` gives; a row asking on its own is told to
    give them to the predictor (the columns are the predictor's, the same for every batch)."""
    import numpy as np

    from specrt.jobs.ray_data import SpecrtPredictor

    predictor = SpecrtPredictor(str(llama_bundle), max_new_tokens=4, ignore_eos=True, logprobs=2)
    batch = {"id": np.array(["a", "b"]), "prompt": np.array(["Simple is", "def fibonacci(n):"])}
    out = predictor(batch)
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True, logprobs=2)
    for i, result in enumerate(generator.generate(["Simple is", "def fibonacci(n):"], config)):
        assert out["logprobs"][i] == pytest.approx([e.logprob for e in result.logprobs], abs=1e-4)
        assert out["top_token_ids"][i] == [[t for t, _ in e.top] for e in result.logprobs]
        assert [len(lps) for lps in out["top_logprobs"][i]] == [2] * 4
    plain = SpecrtPredictor(str(llama_bundle), max_new_tokens=4)
    asked = plain({"id": np.array(["c"]), "prompt": np.array(["x"]), "logprobs": np.array([1])})
    assert "logprobs" not in asked and "give SpecrtPredictor logprobs=N" in asked["error"][0]


def test_structured_output_from_the_predictor_or_a_row(llama_bundle):
    """A structured output given to the predictor holds every row to it, and a row's own
    ``structured_output`` column (a regex here) holds that row, as `generate` gives them."""
    import numpy as np

    from specrt.jobs.ray_data import SpecrtPredictor

    regex = r"(cab|bad|ace)( (cab|bad|ace)){0,3}\."
    predictor = SpecrtPredictor(
        str(llama_bundle), max_new_tokens=24, structured_output={"regex": regex}
    )
    prompts = ["Simple is", "def fibonacci(n):"]
    out = predictor({"id": np.array(["a", "b"]), "prompt": np.array(prompts)})
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    config = GenerationConfig(max_new_tokens=24, structured_output={"regex": regex})
    assert out["text"] == [r.text for r in generator.generate(prompts, config)]
    plain = SpecrtPredictor(str(llama_bundle), max_new_tokens=24)
    rows = {"id": np.array(["c"]), "prompt": np.array(prompts[:1]),
            "structured_output": np.array([{"choice": ["ace", "bad cab"]}])}  # fmt: skip
    assert plain(rows)["text"][0] in ("ace", "bad cab")


WORDS = ["Simple", "is", "better", "than", "def", "fibonacci(n):", "for", "i", "in", "range(10)"]


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip(
        "ray", reason="the ray extra is not installed (pip install 'specrt[ray]')"
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def test_map_batches_equals_a_single_process(local_ray, llama_bundle):
    from specrt.jobs.ray_data import SpecrtPredictor

    rows = [
        {
            "id": f"r{i}",
            "prompt": " ".join(WORDS[i % 10 : i % 10 + 1 + i % 3]),
            "max_new_tokens": 6 + i % 5,
        }
        for i in range(30)
    ]
    # Rows without a setting: Ray hands that integer column over as floats, NaN where missing
    # (a row's 6 became 6.0, refused as a decimal number)
    for i in (2, 13, 21):
        del rows[i]["max_new_tokens"]
    rows[4] = {"id": "r4", "prompt": "Simple is better than complex. " * 6, "max_new_tokens": 6}
    rows[9] = {"id": "r9", "prompt": "x", "max_new_tokens": 0}
    dataset = local_ray.data.from_items(rows)
    options = {"bundle": str(llama_bundle), "ignore_eos": True, "max_new_tokens": 5}
    mapped = dataset.map_batches(
        SpecrtPredictor,
        fn_constructor_kwargs=options,
        compute=local_ray.data.ActorPoolStrategy(size=2),
        batch_size=4,
    )
    got = {row["id"]: row for row in mapped.take_all()}
    assert sorted(got) == sorted(r["id"] for r in rows)  # every id, once

    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    defaults = GenerationConfig(ignore_eos=True, max_new_tokens=5)
    for item in rows:
        expected = run_row(generator, row_from_item(item, "?"), defaults)
        result = got[item["id"]]
        if "error" in expected:
            assert result["error"] == expected["error"]["message"], item["id"]
            assert result["finish_reason"] == "error"
        else:
            assert result["error"] is None
            assert list(result["token_ids"]) == expected["token_ids"], item["id"]
            assert result["text"] == expected["text"]
    assert "at most 128 positions fit" in got["r4"]["error"]
    assert all(len(got[f"r{i}"]["token_ids"]) == 5 for i in (2, 13, 21))  # the default
    assert "max_new_tokens=0" in got["r9"]["error"]
