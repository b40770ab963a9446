"""The draft a distillation starts from, and the weights that are its own.

The draft is the target cut to its first layers: the same family, tokenizer, embeddings, final
norm and output layer, so it predicts in the target's own space from the first step (a draft
of a target's first layers agrees with it more often than a random small model does). Training
changes only its layers and final norm; the embeddings and output layer stay the target's, so a
draft ships as its "own weights" alone and is put together again from the target.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING

from specrt.errors import ExportError

if TYPE_CHECKING:
    import torch

OWN_WEIGHTS = "own_weights.safetensors"


def decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder under a causal LM's output layer (Gemma 3's causal LM is its own
    ``base_model``; GPT-2's decoder is its ``base_model``, not its ``get_decoder()``)."""
    return model.base_model if model.base_model is not model else model.get_decoder()


def check_layers(config, layers: int) -> None:
    """A draft cut from the target keeps fewer layers than it has, and at least one."""
    total = int(config.num_hidden_layers)
    if total < 2:
        raise ExportError(
            f"the target has {total} layer: a draft cut from it needs a target of 2 or more "
            "(train an EAGLE-3 head instead: --kind eagle3)"
        )
    if not 1 <= layers < total:
        raise ExportError(
            f"--layers {layers}: the draft takes 1 to {total - 1} of the target's {total} layers"
        )


def truncated(target: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A copy of ``target`` with its first ``layers`` decoder layers only (float32, eval)."""
    import torch
    from transformers import AutoModelForCausalLM

    check_layers(target.config, layers)
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):  # per-layer kinds (sliding/full): the first ones
        config.layer_types = config.layer_types[:layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, _ = draft.load_state_dict(target.state_dict(), strict=False)  # later layers: unused
    if [name for name in missing if not _tied_copy(draft, name)]:
        raise ExportError(f"the target's weights do not fill a draft of its family: {missing[:3]}")
    return draft.eval()


def _tied_copy(model: torch.nn.Module, name: str) -> bool:
    """Whether parameter ``name`` is the output layer tied to the input embedding."""
    output = model.get_output_embeddings()
    return output is not None and name.startswith("lm_head") and model.config.tie_word_embeddings


def own_names(draft: torch.nn.Module) -> list[str]:
    """The draft's parameters that training changes: all but the input and output embeddings
    (the target's, kept as they are)."""
    shared = {id(draft.get_input_embeddings().weight)}
    output = draft.get_output_embeddings()
    if output is not None:
        shared.add(id(output.weight))
    return [name for name, param in draft.named_parameters() if id(param) not in shared]


def save_own(draft: torch.nn.Module, path: Path, metadata: dict) -> None:
    """Write the draft's own weights (float16: half the size; the draft is what they round to)
    with ``metadata`` (how it was made) beside them."""
    import torch
    from safetensors.torch import save_file

    params = dict(draft.named_parameters())
    tensors = {
        name: params[name].detach().to(torch.float16).contiguous() for name in own_names(draft)
    }
    save_file(tensors, str(path), metadata={"specrt": json.dumps(metadata, sort_keys=True)})


def round_own(draft: torch.nn.Module) -> None:
    """Round the draft's own weights to what `save_own` stores, so the draft written and
    reported is the one that ships."""
    import torch

    params = dict(draft.named_parameters())
    with torch.no_grad():
        for name in own_names(draft):
            params[name].copy_(params[name].to(torch.float16).to(torch.float32))


def load_own(draft: torch.nn.Module, path: Path) -> dict:
    """Put the own weights of ``path`` into ``draft`` (one cut from the same target to as many
    layers); return the metadata they were saved with."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as handle:
            metadata = json.loads((handle.metadata() or {}).get("specrt", "{}"))
    except (OSError, SafetensorError, json.JSONDecodeError) as exc:
        raise ExportError(f"--init-from {path}: not a draft's own weights ({exc})") from exc
    expected = set(own_names(draft))
    if "layers" not in metadata:  # a model's whole weights, or another tool's file
        raise ExportError(
            f"--init-from {path} is not the own_weights.safetensors `specrt distill` writes "
            "(its metadata names no draft): give that file of a draft folder"
        )
    if set(tensors) != expected:
        layers = metadata["layers"]
        raise ExportError(
            f"--init-from {path} holds the own weights of a {layers}-layer draft of another "
            f"model, not of this one cut to {draft.config.num_hidden_layers} layers: pass "
            "--layers and --target as it was made with"
        )
    params = dict(draft.named_parameters())
    with torch.no_grad():
        for name, tensor in tensors.items():
            if params[name].shape != tensor.shape:
                raise ExportError(
                    f"--init-from {path}: {name} has shape {tuple(tensor.shape)}, "
                    f"this draft's {tuple(params[name].shape)}: another target"
                )
            params[name].copy_(tensor.to(torch.float32))
    return metadata
