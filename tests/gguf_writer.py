"""Write a tiny Llama (or Qwen2) checkpoint as a GGUF file, as llama.cpp's converter lays one out.

Float32 tensors under llama.cpp's names (Llama's q/k rows permuted for its rotary layout), the
config under ``llama.*`` (``qwen2.*``) keys and the tokenizer under ``tokenizer.ggml.*``: what
transformers' GGUF reader takes back, so a test needs no download.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of a q or k projection's rows (the reader undoes it)."""
    rows = weights.shape[0]
    return weights.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weights.shape)


def write_llama_gguf(
    checkpoint: Path, path: Path, chat_template: str | None = None, arch: str = "llama"
) -> Path:
    """``checkpoint`` (a Llama or Qwen2 Hugging Face folder with a tokenizer.json) as the GGUF
    ``path``."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config.hidden_size // heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)

    vocab = json.loads((checkpoint / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_scores([0.0] * len(tokens))  # no merges: the reader builds none
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if chat_template:
        writer.add_chat_template(chat_template)

    names = gguf.get_tensor_name_map(
        getattr(gguf.MODEL_ARCH, arch.upper()), config.num_hidden_layers
    )
    for name, tensor in model.state_dict().items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        weights = tensor.numpy().astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            weights = _permute(weights, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            weights = _permute(weights, kv_heads)
        base, _, suffix = name.rpartition(".")
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
