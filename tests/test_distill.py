"""`specrt distill` on a tiny target: a real subprocess killed with SIGKILL mid-training and run
again ends with the very draft an uninterrupted run makes; the draft learns (held-out acceptance
rises), ships as its own weights alone, and exports as the draft of a lossless bundle."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from safetensors.torch import load_file
from tokenizers import Tokenizer

from specrt.bundle import read_manifest
from specrt.checksums import VOCAB_FILE, vocab_fingerprint
from specrt.cli import main
from specrt.distill import state_dir
from specrt.export.tiny import CORPUS, make_tiny_pair
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from specrt.runtime.tokenizer import BundleTokenizer
from tests.conftest import drafts_keep_the_targets_output

REPO = Path(__file__).resolve().parents[1]
STEPS = 300


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("distill")
    target, _ = make_tiny_pair("llama", root / "pair", seed=5, config={"num_hidden_layers": 4})
    prompts = root / "train.jsonl"
    lines = [json.dumps({"prompt": line[: 8 + i % 7]}) for i, line in enumerate(CORPUS * 3)]
    prompts.write_text("\n".join(lines) + "\n")
    heldout = root / "heldout.txt"
    heldout.write_text("Now is\ndef fib\nSparse is\n")
    return target, prompts, heldout


def command(target, prompts, heldout, out: Path, *extra) -> list[str]:
    args = ["distill", "--target", str(target), "--out", str(out), "--prompt-file", str(prompts)]
    args += ["--heldout-file", str(heldout), "--max-new-tokens", "24"]
    args += [] if "eagle3" in extra else ["--layers", "1"]  # a head is one layer of its own
    args += ["--seq-len", "48", "--steps", str(STEPS), "--save-every", "5"]
    return [sys.executable, "-m", "specrt.cli", *args, *extra]


def prompts_of(path: Path) -> set[str]:
    return {json.loads(line)["prompt"] for line in path.read_text().splitlines()}


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_a_killed_run_goes_on_to_the_draft_an_uninterrupted_run_makes(target, tmp_path):
    whole = run(command(*target, tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    report = json.loads((tmp_path / "whole" / "distill_report.json").read_text())
    before, after = report["heldout_before"], report["heldout_after"]
    assert after["acceptance_per_token"] > before["acceptance_per_token"] + 0.1
    assert len(after["acceptance_per_position"]) == 4 and after["prompts"] == 3
    assert report["loss_last_steps"] < report["loss_first_steps"]

    out = tmp_path / "resumed"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command(*target, out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if list(state_dir(out).glob("train-*.pt")):
            break
        time.sleep(0.01)
    assert process.poll() is None  # the kill hits a run still training
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not out.exists()  # nothing half-written at --out
    answers = sorted(state_dir(out).glob("answers-*/*.npz"))
    assert len(answers) == len(prompts_of(target[1]))  # all kept: the rerun does not ask again
    stamps = [path.stat().st_mtime_ns for path in answers]

    resumed = run(command(*target, out))
    assert resumed.returncode == 0, resumed.stderr
    assert [path.stat().st_mtime_ns for path in answers] == stamps
    mine, theirs = (
        load_file(str(d / "own_weights.safetensors")) for d in (out, tmp_path / "whole")
    )
    assert mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in mine)
    assert not list(state_dir(out).glob("train-*.pt"))  # done: the checkpoint is gone


def test_the_own_weights_rebuild_the_draft_and_it_exports_losslessly(target, tmp_path):
    trained = tmp_path / "trained"
    more = tmp_path / "more.txt"  # a second set of prompts: both are answered and trained on
    more.write_text("Beautiful is\nclass Stack\n")
    extra = ["--steps", "40", "--prompt-file", str(more), "--draft-vocab", "24"]
    result = run(command(*target, trained, *extra))
    assert result.returncode == 0, result.stderr
    report = json.loads((trained / "distill_report.json").read_text())
    assert report["train_prompts"] == len(target[1].read_text().splitlines()) + 2
    assert len(list(state_dir(trained).glob("answers-*/*.npz"))) == len(prompts_of(target[1])) + 2
    own = load_file(str(trained / "own_weights.safetensors"))
    assert not any(name.startswith(("model.embed_tokens", "lm_head")) for name in own)

    runner = CliRunner()
    again = tmp_path / "again"
    args = ["distill", "--target", str(target[0]), "--out", str(again), "--layers", "1"]
    result = runner.invoke(
        main, [*args, "--steps", "0", "--init-from", str(trained / "own_weights.safetensors")]
    )
    assert result.exit_code == 0, result.output
    rebuilt, original = (load_file(str(d / "model.safetensors")) for d in (again, trained))
    assert rebuilt.keys() == original.keys()
    assert all(rebuilt[k].equal(original[k]) for k in rebuilt)

    bundle = tmp_path / "bundle"
    args = ["export", "--target", str(target[0]), "--draft", str(again), "--out", str(bundle)]
    result = runner.invoke(main, [*args, "--no-portable"])
    assert result.exit_code == 0, result.output
    answers_are_the_bundles_alone(bundle, state_dir(trained), tmp_path)
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    prompt = [1, 5, 9, 12, 20, 7, 30]
    settings = dict(max_new_tokens=32, ignore_eos=True, proposer="model", draft_schedule="fixed")
    alone = generator.generate([prompt], GenerationConfig(num_draft_tokens=0, **settings))[0]
    drafted = generator.generate([prompt], GenerationConfig(num_draft_tokens=3, **settings))[0]
    assert drafted.token_ids == alone.token_ids
    assert drafted.stats.accepted_tokens > 0

    # the trained folder names the 24 tokens its answers use most: its engine proposes those
    proposed = json.loads((trained / "draft_vocab.json").read_text())["token_ids"]
    assert len(proposed) == 24 and report["draft_vocab"] == 24
    small = tmp_path / "small vocabulary"
    args = ["export", "--target", str(target[0]), "--draft", str(trained), "--out", str(small)]
    result = runner.invoke(main, [*args, "--no-portable"])
    assert result.exit_code == 0, result.output
    assert "proposes 24 of the" in result.output
    engine = read_manifest(small).models["draft"].engines["onnxruntime"]
    assert engine.export_check["proposed_tokens"] == 24
    graph = onnx.load(str(small / engine.path), load_external_data=False)
    assert "ScatterElements" in {node.op_type for node in graph.graph.node}
    generator = SpeculativeGenerator.from_bundle(small, threads=1)
    logits = generator.draft.forward(prompt, keep_last=1).logits[-1]
    assert set(np.flatnonzero(logits > -1e29)) == set(proposed)  # the others: never proposed
    drafts_keep_the_targets_output(generator, prompt)


def answers_are_the_bundles_alone(bundle: Path, state: Path, tmp_path: Path) -> None:
    """`specrt corpus` takes the answers distill made for the bundle's target, and refuses
    those of another target (the demo pair's tokenizer): their ids are other tokens."""
    [answers] = state.glob("answers-*")
    assert (answers / VOCAB_FILE).read_text().strip() == BundleTokenizer(
        bundle / "tokenizer", None
    ).vocab_fingerprint
    corpus = ["corpus", "--bundle", str(bundle), "--answers-dir"]
    result = CliRunner().invoke(main, [*corpus, str(state)])
    assert result.exit_code == 0 and result.output.startswith("corpus of"), result.output
    other = tmp_path / "answers-other"
    shutil.copytree(answers, other)
    demo = Tokenizer.from_file(str(REPO / "models" / "demo" / "target" / "tokenizer.json"))
    (other / VOCAB_FILE).write_text(vocab_fingerprint(demo.get_vocab(with_added_tokens=True)))
    result = CliRunner().invoke(main, [*corpus, str(other)])
    assert result.exit_code == 1 and "holds answers of another target" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("content", "message"),
    [("not json", "not a draft vocabulary"), ('{"token_ids": [3, 100000]}', "within the vocab")],
)
def test_a_bad_draft_vocabulary_is_one_line_and_writes_nothing(target, tmp_path, content,
                                                                message):  # fmt: skip
    draft = target[0].parent / "draft"  # the tiny pair's own draft, copied
    copy = tmp_path / "draft"
    shutil.copytree(draft, copy)
    (copy / "draft_vocab.json").write_text(content)
    out = tmp_path / "bundle"
    args = ["export", "--target", str(target[0]), "--draft", str(copy), "--out", str(out)]
    result = CliRunner().invoke(main, [*args, "--no-portable"])
    assert result.exit_code != 0 and message in result.output, result.output
    assert "Traceback" not in result.output and not out.exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--layers", "4"], "the draft takes 1 to 3 of the target's 4 layers"),
        (["--steps", "5"], "give --prompt-file"),
        (["--layers", "2", "--init-from", "OWN"], "pass --layers and --target as it was made"),
        (["--target-precision", "int4"], "use it with --kind eagle3"),
        (["--kind", "eagle3", "--layers", "3"], "an EAGLE-3 head is one layer of its own"),
        (["--target-block-size", "64"], "--target-block-size 64 is for a quantised target"),
        (["--top-k", "100000"], "--top-k 100000 is more than the target's vocabulary"),
        (["--state-dir", "OUT"], "is or is inside --out"),
        (["--steps", "5", "--prompt-file", "CHATS"], "holds chat messages, which this command"),
        (["--steps", "5", "--prompt-file", "GZ"], "is gzip-compressed: give the text itself"),
        (["--heldout-file", "LONG"], "no held-out prompt leaves room for an answer"),
        (["--init-from", "WHOLE"], "is not the own_weights.safetensors `specrt distill` writes"),
        (["--target", "BERT"], "is a BertModel, not a language model"),  # (was transformers')
    ],
)
def test_bad_settings_are_one_line_and_write_nothing(target, tmp_path, extra, message):
    own = tmp_path / "own.safetensors"
    if "OWN" in extra:
        trained = tmp_path / "one-layer"
        made = CliRunner().invoke(
            main,
            [
                "distill",
                "--target",
                str(target[0]),
                "--out",
                str(trained),
                "--layers",
                "1",
                "--steps",
                "0",
            ],
        )
        assert made.exit_code == 0, made.output
        own = trained / "own_weights.safetensors"
    if "BERT" in extra:
        from transformers import BertConfig

        BertConfig(architectures=["BertModel"]).save_pretrained(tmp_path / "bert")
    swap = {"OWN": str(own), "BERT": str(tmp_path / "bert"), "OUT": str(tmp_path / "out")}
    swap |= {"CHATS": str(tmp_path / "chats.jsonl"), "GZ": str(tmp_path / "prompts.txt.gz")}
    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "prompts.txt.gz").write_bytes(gzip.compress(b"hello\n"))
    swap["WHOLE"] = str(target[0] / "model.safetensors")  # a model's, not a draft's own
    swap["LONG"] = str(tmp_path / "long.txt")  # past the tiny target's 128 positions
    (tmp_path / "long.txt").write_text("the cat sat " * 100 + "\n")
    extra = [swap.get(arg, arg) for arg in extra]
    out = tmp_path / "out"
    args = ["distill", "--target", str(target[0]), "--out", str(out), "--steps", "0", *extra]
    if "--steps" in extra:
        args.remove("0"), args.remove("--steps")
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists() and not (tmp_path / ".out.distill").exists()


def distill_to(target, out: Path, *extra) -> object:
    """`specrt distill` of an untrained one-layer draft (no prompts, no training) to ``out``."""
    args = ["distill", "--target", str(target), "--out", str(out), "--layers", "1"]
    return CliRunner().invoke(main, [*args, "--steps", "0", *extra])


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("where", ["a user's folder", "the target", "the working directory"])
def test_force_never_replaces_what_distill_did_not_write(target, tmp_path, monkeypatch, where):
    """`--force` replaces a draft this command wrote, never a user's folder, the target's own
    checkpoint or the working directory (each was swapped for the draft, and lost)."""
    folder = {"a user's folder": tmp_path / "notes", "the target": target[0]}.get(where)
    if folder is None:
        folder = tmp_path / "work"
        folder.mkdir()
        monkeypatch.chdir(folder)
    folder.mkdir(exist_ok=True)
    (folder / "notes.txt").write_text("mine")
    before = tree(folder)
    result = distill_to(target[0], Path(".") if where == "the working directory" else folder,
                        "--force")  # fmt: skip
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    message = {"a user's folder": "is not a draft or head specrt wrote (no distill_report.json)",
               "the target": "source checkpoint",
               "the working directory": "current directory"}[where]  # fmt: skip
    assert message in result.output, result.output
    assert tree(folder) == before
    assert not list(tmp_path.glob(".*distill")) and not list(folder.parent.glob("..distill"))


def test_force_replaces_a_draft_it_wrote_and_keeps_what_a_user_put_in_it(target, tmp_path):
    out = tmp_path / "draft"
    assert distill_to(target[0], out).exit_code == 0
    (out / "NOTES.md").write_text("trained on Tuesday")
    again = distill_to(target[0], out)
    assert again.exit_code == 1 and "pass --force to replace it" in again.output
    replaced = distill_to(target[0], out, "--force")
    assert replaced.exit_code == 0, replaced.output
    assert (out / "NOTES.md").read_text() == "trained on Tuesday"
    assert (out / "distill_report.json").is_file() and (out / "own_weights.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".draft.") and
                not p.name.endswith(".distill")]  # fmt: skip


def test_an_eagle3_head_resumes_after_a_kill_learns_and_drafts_losslessly(target, tmp_path):
    """`--kind eagle3`: the same kill-and-resume promise, then the head exported with its
    target (`specrt export --eagle`) drafts what the target alone would say."""
    eagle = ["--kind", "eagle3", "--lr", "2e-3"]
    shared = tmp_path / "answers"  # --state-dir: where a draft's run left the answers, say
    whole = run(command(*target, tmp_path / "whole", *eagle, "--state-dir", str(shared)))
    assert whole.returncode == 0, whole.stderr
    assert len(list(shared.glob("answers-*/*.npz"))) == len(prompts_of(target[1]))
    assert not state_dir(tmp_path / "whole").exists()
    report = json.loads((tmp_path / "whole" / "distill_report.json").read_text())
    before, after = report["heldout_before"], report["heldout_after"]
    assert after["acceptance_per_token"] > before["acceptance_per_token"] + 0.3
    assert report["kind"] == "eagle3" and report["loss_last_steps"] < report["loss_first_steps"]

    out = tmp_path / "resumed"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command(*target, out, *eagle), env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if list(state_dir(out).glob("train-*.pt")):
            break
        time.sleep(0.01)
    assert process.poll() is None  # the kill hits a run still training
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not out.exists()
    resumed = run(command(*target, out, *eagle))
    assert resumed.returncode == 0, resumed.stderr
    mine, theirs = (load_file(str(d / "model.safetensors")) for d in (out, tmp_path / "whole"))
    assert mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in mine)
    assert {"fc.weight", "lm_head.weight", "d2t", "t2d"} <= mine.keys()

    bundle = tmp_path / "bundle"
    args = ["export", "--target", str(target[0]), "--eagle", str(out), "--out", str(bundle)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    prompts = target[2].read_text().splitlines()
    settings = dict(max_new_tokens=24, proposer="model", draft_schedule="fixed")
    alone = generator.generate(prompts, GenerationConfig(num_draft_tokens=0, **settings))
    drafted = generator.generate(prompts, GenerationConfig(num_draft_tokens=4, **settings))
    assert [r.token_ids for r in drafted] == [r.token_ids for r in alone]
    accepted = sum(r.stats.accepted_per_position[0] for r in drafted)
    rounds = sum(r.stats.drafted_tokens for r in drafted) / 4
    # the report replays the rounds a run makes: its first position's acceptance is the run's
    assert abs(accepted / rounds - after["acceptance_per_position"][0]) < 0.15


def test_prompts_go_through_the_chat_template_unless_told_not_to(target, tmp_path):
    """The target answers what it will be sent: chat prompts through its template, or with
    --no-chat-template the plain text a completion sends (each kept apart)."""
    from transformers import AutoTokenizer

    from specrt.distill.data import _path, load

    chat = tmp_path / "chat-target"
    shutil.copytree(target[0], chat)
    (chat / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tokenizer = AutoTokenizer.from_pretrained(chat)
    first = target[2].read_text().splitlines()[0]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": first}], add_generation_prompt=True, tokenize=False
    )
    expected = {
        "chat": tokenizer(text, add_special_tokens=False)["input_ids"],
        "plain": tokenizer(first)["input_ids"],
    }
    assert expected["chat"] != expected["plain"]
    state = tmp_path / "state"
    for name, flags in (("chat", []), ("plain", ["--no-chat-template"])):
        out, before = tmp_path / name, set(state.glob("heldout-*"))
        args = ["distill", "--target", str(chat), "--out", str(out), "--steps", "0"]
        args += ["--prompt-file", str(target[1]), "--heldout-file", str(target[2])]
        args += ["--max-new-tokens", "4", "--state-dir", str(state), *flags]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        report = json.loads((out / "distill_report.json").read_text())
        assert report["settings"]["chat_template"] == (name == "chat")
        [answers] = set(state.glob("heldout-*")) - before  # apart from the other kind's
        assert load(_path(answers, first)).prompt.tolist() == expected[name]


def test_a_head_reads_the_target_s_states_kept_once_and_only_missing_ones_are_made(
    target, tmp_path
):
    """Head training reads the target's states from disk (`features.states`), not from a pass
    of the target each step: a batch's rows of them are the target's own states of that
    batch's tokens; an answer whose states a killed run did not write is computed again to the
    same bits while the others are left as they are, and a grown set computes its new answers'
    states alone."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrt.distill import data, features, train

    model = AutoModelForCausalLM.from_pretrained(target[0]).eval()
    tokenizer = AutoTokenizer.from_pretrained(target[0])
    prompts = [json.loads(line)["prompt"] for line in target[1].read_text().splitlines()][:16]
    examples = data.answer(model, tokenizer, prompts, tmp_path / "answers", 16, 4, progress=False)
    folder = tmp_path / "states"
    kept = features.states(model, examples[:12], (1, 3), folder, progress=False)
    files = sorted(folder.glob("*.npy"))
    assert len(files) == len({features._path(folder, e) for e in examples[:12]}) > 2

    settings = train.TrainSettings(batch_size=4, seq_len=64)
    ids, mask, *_ = train.batch(examples[:12], settings, step=3)
    spans = train.spans(examples[:12], settings, step=3)
    rows = features.rows(examples[:12], kept, spans, ids.shape[1])
    with torch.no_grad():
        states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    expected = torch.cat([states.hidden_states[i] for i in (1, 3)], dim=-1) * mask[..., None]
    torch.testing.assert_close(rows, expected, rtol=2e-3, atol=2e-3)  # kept as float16

    lost, times = files[1], {f: f.stat().st_mtime_ns for f in files}
    made = np.load(lost)
    lost.unlink()
    grown = features.states(model, examples, (1, 3), folder, progress=False)
    assert np.array_equal(np.load(lost), made)
    assert all(f.stat().st_mtime_ns == t for f, t in times.items() if f != lost)
    assert len(list(folder.glob("*.npy"))) == len({features._path(folder, e) for e in examples})
    assert all(np.array_equal(a, b) for a, b in zip(kept, grown))


def test_a_grown_prompt_set_asks_the_target_for_its_new_prompts_alone(target, tmp_path):
    """Answers are kept a file per prompt: a prompt set grown by new prompts is answered for
    those alone (and a prompt given twice once). Answers made in bfloat16, for training, are
    kept apart from the float32 ones, which they never replace and which are taken where they
    exist."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrt.distill import data

    model = AutoModelForCausalLM.from_pretrained(target[0]).eval()
    tokenizer = AutoTokenizer.from_pretrained(target[0])
    prompts = sorted(prompts_of(target[1]))[:10]
    exact, rounded = tmp_path / "float32", tmp_path / "bfloat16"
    first = data.answer(model, tokenizer, prompts[:6], exact, 8, 4, progress=False)
    stamps = {path: path.stat().st_mtime_ns for path in exact.glob("*.npz")}
    assert len(stamps) == 6
    grown = data.answer(model, tokenizer, prompts + prompts[:2], exact, 8, 4, progress=False)
    assert len(list(exact.glob("*.npz"))) == 10
    assert all(path.stat().st_mtime_ns == stamp for path, stamp in stamps.items())
    assert [e.tokens.tolist() for e in grown[:6]] == [e.tokens.tolist() for e in first]
    assert [e.tokens.tolist() for e in grown[10:]] == [e.tokens.tolist() for e in grown[:2]]

    more = [*prompts, "def new_prompt"]
    trained = data.answer(
        model, tokenizer, more, rounded, 8, 4, progress=False, bf16=True, exact=exact
    )
    assert [path.name for path in rounded.glob("*.npz")] == [data._path(rounded, more[-1]).name]
    assert [e.tokens.tolist() for e in trained[:10]] == [e.tokens.tolist() for e in grown[:10]]
    assert len(list(exact.glob("*.npz"))) == 10


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_answers_made_in_batches_are_the_answers_made_one_prompt_at_a_time(
    target, tmp_path, family
):
    """Prompts of near lengths are answered together, padded: every answer, its tokens and its
    top-k, is the one the target gives the prompt alone (a padded row's positions start at its
    own first token, which GPT-2's learnt positions show where rotary ones would not). A batch
    holds fewer rows where their cache would pass the budget."""
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrt.distill import data

    model_dir, _ = make_tiny_pair(family, tmp_path / "pair", seed=3)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = sorted(prompts_of(target[1]))[:12]
    ids = {i: data.prompt_ids(tokenizer, p) for i, p in enumerate(prompts)}
    batches = data._batches(list(ids), ids, 4)
    assert [len(batch) for batch in batches] == [4, 4, 4]
    assert any(len({len(ids[i]) for i in batch}) > 1 for batch in batches)  # padded
    in_order = [len(ids[i]) for batch in batches for i in batch]
    assert in_order == sorted(in_order)
    two_rows = data._batches(list(ids), ids, 4, lambda length: data.CACHE_BUDGET // 2)
    assert [len(batch) for batch in two_rows] == [2] * 6
    together = data.answer(
        model, tokenizer, prompts, tmp_path / "a", 12, 4, batch_size=4, progress=False
    )
    alone = data.answer(
        model, tokenizer, prompts, tmp_path / "b", 12, 4, batch_size=1, progress=False
    )
    for one, other in zip(together, alone):
        assert one.tokens.tolist() == other.tokens.tolist()
        assert one.top_ids.tolist() == other.top_ids.tolist()
        assert np.allclose(one.top_probs, other.top_probs, atol=1e-5)


@pytest.mark.parametrize("family,window", [("llama", None), ("gpt2", None), ("gemma2", 6)])
def test_answers_are_the_targets_own_greedy_generation(target, tmp_path, family, window):
    """The answers' cache writes each step in place (`data._cache`): every answer is what HF's
    own `generate` gives the prompt with its own cache, past a sliding window (gemma2's local
    layers keep HF's cache beside the full ones written in place)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrt.distill import data

    model_dir, _ = make_tiny_pair(family, tmp_path / "pair", seed=4, sliding_window=window)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = sorted(prompts_of(target[1]))[:8]
    answers = data.answer(model, tokenizer, prompts, tmp_path / "a", 16, 4, progress=False)
    for prompt, answer in zip(prompts, answers):
        ids = torch.tensor([data.prompt_ids(tokenizer, prompt)])
        with torch.no_grad():
            own = model.generate(ids, max_new_tokens=16, do_sample=False)
        assert answer.tokens.tolist() == own[0, ids.shape[1] :].tolist()


def test_training_that_diverges_stops_and_replaces_nothing(target, tmp_path):
    """A learning rate that blows the weights up wrote a draft of NaN weights, exit 0 (the
    export failed on it later), and replaced a good draft under --force."""
    out = tmp_path / "draft"
    assert distill_to(target[0], out).exit_code == 0
    before = tree(out)
    args = ["--force", "--prompt-file", str(target[1]), "--max-new-tokens", "8", "--lr", "1e9"]
    result = distill_to(target[0], out, *args, "--steps", "5", "--save-every", "1")
    assert result.exit_code == 1 and "training diverged at step" in result.output, result.output
    assert "lower --lr (it is 1e+09)" in result.output and "Traceback" not in result.output
    assert tree(out) == before


def test_a_damaged_state_file_is_made_again(target, tmp_path, capsys):
    """An answer or a training checkpoint cut short (a crash before the disk had it, a full
    disk) ended the next run in a traceback; it is ours, so it is made again."""
    out = tmp_path / "draft"
    heldout = ["--heldout-file", str(target[2]), "--max-new-tokens", "24"]
    assert distill_to(target[0], out, *heldout).exit_code == 0
    [answer, *_] = sorted((tmp_path / ".draft.distill").glob("heldout-*/*.npz"))
    good = dict(np.load(answer))
    answer.write_bytes(b"garbage")
    result = distill_to(target[0], out, *heldout, "--force")
    assert result.exit_code == 0, result.output
    again = np.load(answer)  # answered again, as greedy answers the same
    for name, array in good.items():  # answered alone now, in a batch of three before
        assert np.allclose(again[name], array, atol=1e-5) and again[name].shape == array.shape

    import torch

    from specrt.distill.train import TrainSettings, checkpointed_steps

    model = torch.nn.Linear(3, 1)
    checkpoint = tmp_path / "train.pt"
    checkpoint.write_bytes(b"PK\x03\x04 cut short")
    step_loss = lambda step: model(torch.ones(1, 3)).pow(2).sum()  # noqa: E731
    trained = dict(model.named_parameters())
    losses = checkpointed_steps(model, trained, step_loss, TrainSettings(steps=3), checkpoint)
    assert len(losses) == 3 and "cannot be read" in capsys.readouterr().err
    assert torch.load(checkpoint, weights_only=True)["step"] == 3


def test_held_out_prompts_that_are_also_trained_on_are_left_out_of_the_measure(target, tmp_path):
    """The held-out measure is of text the draft never saw: the same file given for both was
    measured as if it were held out."""
    out = tmp_path / "draft"
    both = ["--prompt-file", str(target[2]), "--heldout-file", str(target[2])]
    result = distill_to(target[0], out, *both, "--steps", "1", "--max-new-tokens", "8")
    assert result.exit_code == 0, result.output
    assert "note: 3 held-out prompt(s) are also training prompts" in result.output
    assert json.loads((out / "distill_report.json").read_text())["heldout_prompts"] == 0


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "gemma3_text"])
def test_the_loss_over_the_proposed_tokens_is_the_loss_of_the_draft_s_own_forward(
    target, tmp_path, family
):
    """The draft trains on the tokens it will propose, its output layer computed for them
    alone: the loss and its gradients are those of its own forward's logits restricted to
    them (the target's share renormalised over them). Gemma 2 caps its logits, so it is scored
    through its forward (the shortcut would train another draft)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrt.distill import data, train
    from specrt.distill import draft as drafts

    model_dir, _ = make_tiny_pair(
        family, tmp_path / "pair", seed=3, config={"num_hidden_layers": 2}
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = data.answer(
        model, tokenizer, sorted(prompts_of(target[1]))[:8], tmp_path / "a", 16, 8, progress=False
    )
    draft = drafts.truncated(model, 1)
    vocab = int(model.config.vocab_size)
    settings = train.TrainSettings(batch_size=4, seq_len=40)
    ids, mask, (rows, cols), top_ids, top_probs = train.batch(examples, settings, 0)
    proposed = np.random.default_rng(0).permutation(vocab)[: vocab // 2]
    proposed = np.setdiff1d(proposed, top_ids[0].numpy())  # a position with none of its tokens
    sample = torch.from_numpy(examples[0].prompt.astype(np.int64))[None]
    scorer = train.Scorer(draft, proposed, sample)
    assert (scorer.rows is None) == (family == "gemma2")

    logits = draft(input_ids=ids, attention_mask=mask).logits[rows, cols][:, proposed]
    where = {int(token): i for i, token in enumerate(proposed)}
    index = torch.tensor([[where.get(int(t), -1) for t in row] for row in top_ids])
    share = top_probs * (index >= 0)
    usable = share.sum(-1) > 0
    assert 0 < int(usable.sum()) < len(usable)
    log_q = torch.log_softmax(logits[usable], -1).gather(-1, index[usable].clamp(0))
    share = share[usable] / share[usable].sum(-1, keepdim=True)
    expected = -(share * log_q).sum(-1).mean()
    params = dict(draft.named_parameters())
    own = [params[name] for name in drafts.own_names(draft)]  # what training changes
    reference = torch.autograd.grad(expected, own)

    loss = train.loss_of(scorer, examples, settings, 0)
    if family == "gemma2":  # over the whole vocabulary, as its forward gives it
        full = draft(input_ids=ids, attention_mask=mask).logits[rows, cols]
        whole = torch.log_softmax(full, -1).gather(-1, top_ids)
        assert torch.allclose(loss, -(top_probs * whole).sum(-1).mean(), atol=1e-5)
        return
    assert torch.allclose(loss, expected, atol=1e-5), (float(loss), float(expected))
    for one, other in zip(torch.autograd.grad(loss, own), reference):
        assert torch.allclose(one, other, atol=1e-6)


@pytest.mark.parametrize("kind", ["draft", "eagle3"])
@pytest.mark.parametrize(
    "family",
    ["gpt2", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gemma3_text", "gemma3"],
)
def test_distill_makes_a_draft_and_a_head_for_every_family(tmp_path, family, kind):
    """A target of any family the export takes gets a draft and a head, each proposing part of
    the vocabulary as on a real target (Gemma 3's causal LM is its own base model and GPT-2
    names its sizes otherwise: both stopped on a traceback). Llama's are made throughout this
    module."""
    target, _ = make_tiny_pair(family, tmp_path / "pair", seed=5, config={"num_hidden_layers": 2})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def fib(n):\nNow is the time\nimport os\nSparse is better\n")
    out = tmp_path / "out"
    args = ["--kind", "eagle3"] if kind == "eagle3" else ["--layers", "1"]
    result = CliRunner().invoke(
        main,
        ["distill", "--target", str(target), "--out", str(out), "--prompt-file", str(prompts)]
        + ["--max-new-tokens", "8", "--steps", "2", "--seq-len", "32", "--draft-vocab", "40"]
        + args,
    )
    assert result.exit_code == 0, result.output
    made = "model.safetensors" if kind == "eagle3" else "own_weights.safetensors"
    assert (out / made).is_file()
