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
    def __init__(self, generator: SpeculativeGenerator, k: int, schedule: str = "fixed") -> None:
        self.generator, self.k, self.schedule = generator, k, schedule
        kind = (
            "target only" if k == 0 else (f"K={k}" if schedule == "fixed" else f"{schedule} K<={k}")
        )
        self.name = f"specrt {kind}"

    def run(self, prompt: list[int], temperature: float, max_new_tokens: int, seed: int) -> Run:
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            num_draft_tokens=self.k,
            draft_schedule=self.schedule,
            temperature=temperature,
            seed=seed,
            ignore_eos=True,
        )
        before = self.generator.model_time_s
        started = time.perf_counter()
        [result] = self.generator.generate([prompt], config)
        seconds = time.perf_counter() - started
        model = self.generator.model_time_s - before
        return Run(len(result.token_ids), seconds, result.stats.to_dict(), model)


class HFContender:
    """transformers `generate` on the PyTorch checkpoints, alone or with `assistant_model=`."""

    def __init__(self, target_dir: Path, draft_dir: Path | None, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        load = dict(dtype=torch.float32, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, **load).eval()
        self.assistant = (
            AutoModelForCausalLM.from_pretrained(draft_dir, **load).eval() if draft_dir else None
        )
        self.name = "transformers assisted" if draft_dir else "transformers target only"

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
                eos_token_id=None,  # like ignore_eos: always max_new_tokens
                pad_token_id=0,
                **options,
            )
        seconds = time.perf_counter() - started
        return Run(out.shape[1] - len(prompt), seconds)
