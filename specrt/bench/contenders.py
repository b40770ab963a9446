"""The contenders a user would pick instead of (or beside) specrt, behind one `run` call."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from specrt.runtime import GenerationConfig, SpeculativeGenerator


@dataclass
class Run:
    new_tokens: int
    seconds: float
    stats: dict = field(default_factory=dict)
    model_seconds: float | None = None  # time inside the model runtime, when known

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds


class SpecrtContender:
    def __init__(
        self,
        generator: SpeculativeGenerator,
        k: int,
        schedule: str = "fixed",
        proposer: str = "model",
    ) -> None:
        self.generator, self.k, self.schedule, self.proposer = generator, k, schedule, proposer
        kind = (
            "target only" if k == 0 else (f"K={k}" if schedule == "fixed" else f"{schedule} K<={k}")
        )
        self.name = f"specrt {kind}" if proposer == "model" else f"specrt {proposer} {kind}"

    def run(self, prompt: list[int], temperature: float, max_new_tokens: int, seed: int) -> Run:
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            num_draft_tokens=self.k,
            draft_schedule=self.schedule,
            proposer=self.proposer,
            temperature=temperature,
            seed=seed,
            ignore_eos=True,
        )
        self.generator.forget_kept_rows()  # each contender reads the prompt itself
        before = self.generator.model_time_s
        started = time.perf_counter()
        [result] = self.generator.generate([prompt], config)
        seconds = time.perf_counter() - started
        model = self.generator.model_time_s - before
        return Run(len(result.token_ids), seconds, result.stats.to_dict(), model)


class HFContender:
    """transformers `generate` on the PyTorch checkpoints, alone, with `assistant_model=`, or
    with prompt lookup (``prompt_lookup`` tokens: its ``prompt_lookup_num_tokens``)."""

    def __init__(
        self, target_dir: Path, draft_dir: Path | None, threads: int, prompt_lookup: int = 0
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch

        def load(checkpoint: Path):  # a GGUF file (its folder and name), or a folder
            where = dict(gguf_file=checkpoint.name) if checkpoint.is_file() else {}
            folder = checkpoint.parent if checkpoint.is_file() else checkpoint
            return AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, local_files_only=True, **where
            ).eval()

        self.model = load(target_dir)
        self.assistant = load(draft_dir) if draft_dir else None
        self.name = "transformers assisted" if draft_dir else "transformers target only"
        self.lookup = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
        # "Never stop at EOS": None, except where prompt lookup needs a token id (one past the
        # vocabulary, which is never generated).
        self.eos = self.model.config.vocab_size if prompt_lookup else None
        if prompt_lookup:
            self.name = f"transformers prompt lookup K={prompt_lookup}"

    def run(self, prompt: list[int], temperature: float, max_new_tokens: int, seed: int) -> Run:
        torch = self.torch
        torch.manual_seed(seed)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        options = sampling if temperature > 0 else dict(do_sample=False)
        ids = torch.tensor([prompt])
        started = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                assistant_model=self.assistant,
                max_new_tokens=max_new_tokens,
                eos_token_id=self.eos,  # like ignore_eos: always max_new_tokens
                pad_token_id=0,
                **self.lookup,
                **options,
            )
        seconds = time.perf_counter() - started
        return Run(out.shape[1] - len(prompt), seconds)
