"""Loading a checkpoint as the causal language model specrt exports.

Multimodal checkpoints (Gemma 3 from 4B up: ``gemma3``, a vision tower beside the text decoder)
are exported as their text decoder alone: the language model is what drafts and verifies; the
vision tower and its projector are left out.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from specrt.bundle import EAGLE3_ARCHITECTURE

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
