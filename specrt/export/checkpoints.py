"""Loading a checkpoint as the causal language model specrt exports.

Multimodal checkpoints (Gemma 3 from 4B up: ``gemma3``, a vision tower beside the text decoder)
are exported as their text decoder alone: the language model is what drafts and verifies; the
vision tower and its projector are left out.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from specrt.bundle import EAGLE3_ARCHITECTURE
from specrt.errors import ExportError
from specrt.export.options import SUPPORTED_MODEL_TYPES

if TYPE_CHECKING:
    import torch

# A multimodal checkpoint's model type -> its text decoder's (what the bundle records).
MULTIMODAL_TEXT_TYPES = {"gemma3": "gemma3_text"}
TOKENIZER_FILES = (  # what a bundle takes of a checkpoint's tokenizer
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",  # where newer checkpoints keep their chat template
)


def is_head(path: Path) -> bool:
    """Whether ``path`` is an EAGLE-3 head's directory (by its config's architecture)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and any(
        a == EAGLE3_ARCHITECTURE for a in config.get("architectures") or []
    )


def is_multimodal(config) -> bool:
    return config.model_type in MULTIMODAL_TEXT_TYPES


def text_config(config):
    """The config of the model that is exported: a multimodal checkpoint's text decoder's."""
    return config.get_text_config() if is_multimodal(config) else config


def load_causal_lm(source: Path, config) -> torch.nn.Module:
    """The checkpoint at ``source`` as a float32 causal LM (a multimodal one's text decoder and
    its output layer, sharing the loaded weights), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.float32, local_files_only=True
    ).eval()
    if not is_multimodal(config):
        return model
    with torch.device("meta"):  # no weights of its own: it takes the loaded ones
        text = AutoModelForCausalLM.from_config(text_config(config), dtype=torch.float32)
    text.model = model.model.language_model
    text.lm_head = model.lm_head
    return text.eval()


def save_text_decoder(source: Path, config, dest: Path) -> Path:
    """Write a multimodal checkpoint's text decoder, with the tokenizer files, as a checkpoint
    of its own at ``dest`` (what optimum exports)."""
    load_causal_lm(source, config).save_pretrained(dest)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
    return dest


def load_config(path: Path, role: str):
    """The checkpoint's config, refused in one line where specrt cannot export it."""
    from transformers import AutoConfig

    if not os.path.lexists(path):
        raise ExportError(f"{role} checkpoint {str(path)!r} does not exist; check the path")
    if not (path / "config.json").is_file():
        raise ExportError(
            f"{role} checkpoint {str(path)!r} has no config.json; pass a Hugging Face model "
            "directory (the output of `save_pretrained`)"
        )
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # JSON errors are ValueErrors
        raise ExportError(
            f"{role} checkpoint {str(path)!r}: its config.json cannot be read "
            f"({type(exc).__name__}: {str(exc)[:200]}); repair it or save the model again with "
            "`save_pretrained`"
        ) from exc
    quantized = getattr(config, "quantization_config", None)
    if quantized:  # transformers would need the quantiser's package, then fail or mis-export
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise ExportError(
            f"{role} checkpoint {str(path)!r} is quantized ({method}); export the unquantized "
            "model (specrt quantizes the engines itself: --target-precision, --draft-precision)"
        )
    heads = [a for a in config.architectures or [] if a.endswith(LANGUAGE_MODEL_CLASSES)]
    if config.architectures and not heads:
        raise ExportError(
            f"{role} checkpoint {str(path)!r} is a {config.architectures[0]}, not a language "
            "model with its output layer; export the checkpoint saved from its ...ForCausalLM"
        )
    if text_config(config).model_type not in SUPPORTED_MODEL_TYPES:
        raise ExportError(
            f"{role} model type {config.model_type!r} is not supported yet; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (and gemma3 multimodal checkpoints' text "
            "decoders)"
        )
    # Found now, not after the other model's export (minutes for a large target).
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise ExportError(
            f"{role} checkpoint {str(path)!r} has no weights ({', '.join(WEIGHT_FILES)}); "
            "pass the directory `save_pretrained` wrote, weights included"
        )
    return config


# How a Hugging Face checkpoint's weights are named (one file, or shards and their index).
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")
# Classes (config.architectures) that end in a vocabulary's logits; a base model, classifier
# or reward model saved from the same family would get a random output layer at load.
LANGUAGE_MODEL_CLASSES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def load_checked(source: Path, role: str):
    """The checkpoint in PyTorch, refused where weights the model needs are missing."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # missing weights are reported below, in a line
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch.float32, local_files_only=True, output_loading_info=True
        )
    finally:
        transformers_logging.set_verbosity(verbosity)
    if loading["missing_keys"]:  # transformers fills them with random values
        missing = sorted(loading["missing_keys"])
        raise ExportError(
            f"{role} checkpoint {str(source)!r} lacks weights the model needs "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): they would be "
            "random; export the checkpoint saved whole from its ...ForCausalLM model"
        )
    return model.eval()
