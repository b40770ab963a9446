"""Tiny random-weight draft/target pairs built from configs: for tests and the `tiny` recipe.

No download: the tokenizer is trained on a few lines embedded here. The target's output layer is
scaled so its distributions are peaked (as a trained model's are), and the draft is the target
with noise added to every weight, so the two agree often but not always.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

CORPUS = [
    "Beautiful is better than ugly. Explicit is better than implicit.",
    "Simple is better than complex. Complex is better than complicated.",
    "Flat is better than nested. Sparse is better than dense. Readability counts.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "    return fibonacci(n - 1) + fibonacci(n - 2)",
    "for i in range(10):\n    print(i, i * i)",
    "Errors should never pass silently, unless explicitly silenced.",
    "Now is better than never. Although never is often better than right now.",
]
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
TIED_SHRINK = 8.0  # tied models' embeddings are scaled down by this (see make_tiny_pair)


def make_tokenizer(extra_tokens: int = 0) -> PreTrainedTokenizerFast:
    """A deterministic character-level tokenizer of the corpus (spaces kept via Metaspace) that
    adds <s> like Llama's. ``extra_tokens`` appends made-up tokens: a different tokenizer."""
    chars = sorted({c for line in CORPUS for c in line.replace(" ", "\u2581")})
    extra = [f"<extra_{i}>" for i in range(extra_tokens)]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + chars + extra)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_config(
    arch: str,
    vocab_size: int,
    max_positions: int = 128,
    layers: int = 2,
    sliding_window: int | None = None,
    **dims,
):
    """A tiny config of ``arch``; ``dims`` override its sizes (``hidden_size``,
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ...)."""
    common = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2)
    if arch == "gpt2":
        shape = dict(
            n_embd=64,  # head_dim 16, as onnxruntime's GroupQueryAttention needs
            n_layer=layers,
            n_head=4,
            n_positions=max_positions,
            tie_word_embeddings=False,
        )
        return GPT2Config(**{**shape, **common, **dims})
    classes = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "mistral": MistralConfig,
        "phi3": Phi3Config,
        "gemma": GemmaConfig,
        "gemma2": Gemma2Config,
        "gemma3_text": Gemma3TextConfig,
    }
    if arch not in classes:
        raise ValueError(
            f"unknown tiny architecture {arch!r}; use one of gpt2, {', '.join(classes)}"
        )
    extra = {"sliding_window": sliding_window} if arch == "mistral" else {}
    if arch == "phi3":  # packed qkv and gate_up projections (in the model class)
        extra = {"pad_token_id": 0, "sliding_window": sliding_window}
    if arch == "gemma":  # head_dim set apart, one kv head, tied, tanh GELU (in its config)
        extra = {"head_dim": 32, "num_key_value_heads": 1, "tie_word_embeddings": True}
    if arch == "gemma2":  # as gemma, plus local layers, soft-capped attention and logits
        extra = {
            "head_dim": 32,
            "tie_word_embeddings": True,
            "sliding_window": sliding_window or max_positions,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 2.0,  # low enough to bend these small random scores
            "final_logit_softcapping": 100.0,  # bends the peaked logits, short of ties
        }
    if arch == "gemma3_text":  # local and global layers (own rope bases), q/k norms
        extra = {
            "head_dim": 32,
            "tie_word_embeddings": True,
            "sliding_window": sliding_window or max_positions,
            "layer_types": [("sliding", "full")[i % 2] + "_attention" for i in range(layers)],
            "query_pre_attn_scalar": 24,
            "rope_local_base_freq": 100.0,  # far from the global 10000: a mix-up shows
            "rope_theta": 10000.0,
        }
    if arch == "qwen3":  # its real checkpoints' features: head_dim set apart from hidden /
        # heads (32 here, not 16), tied embeddings, per-head q/k norms (in the model class)
        extra = {"head_dim": 32, "tie_word_embeddings": True}
    if arch in ("qwen2", "qwen3") and sliding_window:  # the window on layers from 1 up
        extra.update(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=1)
    shape = dict(
        hidden_size=64,  # head_dim 16: onnxruntime's GroupQueryAttention needs a multiple of 16
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )
    return classes[arch](**{**shape, **common, **extra, **dims})


def with_vision_tower(text_model):
    """A multimodal Gemma 3 model whose text decoder is ``text_model``'s (a tiny random vision
    tower beside it): what a Gemma 3 4B+ checkpoint holds."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = Gemma3Config(
        text_config=text_model.config.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
    )
    model = Gemma3ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text_model.model.state_dict())
    model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    return model


def make_tiny_pair(
    arch: str,
    out_dir: str | Path,
    seed: int = 0,
    draft_noise: float = 0.3,
    peak: float = 20.0,
    max_positions: int = 128,
    extra_tokens: int = 0,
    target_vocab_pad: int = 0,
    draft_vocab_pad: int = 0,
    draft_max_positions: int | None = None,
    sliding_window: int | None = None,
    draft_dims: dict | None = None,
    config: dict | None = None,
) -> tuple[Path, Path]:
    """Write ``out_dir/target`` and ``out_dir/draft`` HF checkpoints sharing one tokenizer.

    ``*_vocab_pad`` adds embedding rows beyond the tokenizer's vocabulary, as real Qwen pairs have.
    ``sliding_window``: attention over the last that many positions only (all layers for
    mistral and phi3; the local layers of gemma2/gemma3_text; layers from 1 up for qwen2/qwen3).
    ``config``: other config values of both models (``rope_scaling``, ``attention_bias`` ...).
    ``arch`` "gemma3": the target is a multimodal Gemma 3 checkpoint (a tiny vision tower
    beside a gemma3_text decoder, as Gemma 3 4B and up), the draft a gemma3_text model (as
    Gemma 3 1B).
    ``draft_dims``: the draft is a model of its own with these sizes (`tiny_config`'s ``dims``,
    ``layers``), random, as a real pair's members differ; by default it is the target plus noise.
    """
    out = Path(out_dir)
    multimodal = arch == "gemma3"
    arch = "gemma3_text" if multimodal else arch
    tokenizer = make_tokenizer(extra_tokens)
    vocab = len(tokenizer)
    torch.manual_seed(seed)
    overrides = config or {}
    target_config = tiny_config(
        arch, vocab, max_positions, sliding_window=sliding_window, **overrides
    )
    target = AutoModelForCausalLM.from_config(target_config).eval()
    with torch.no_grad():
        # Tied: the residual stream starts as the input token's own embedding row, which also
        # scores the outputs, so the model repeats its input unless the layers' share of the
        # stream outweighs it (the Gemma families' scaled embedding and norms are set up below).
        tied = target.config.tie_word_embeddings
        gemma = target.config.model_type.startswith("gemma")
        shrink = TIED_SHRINK if tied and not gemma else 1.0
        embedding = target.model.embed_tokens.weight if tied else None
        if gemma:  # tied, norms scale by (1 + w)
            norm = target.model.norm.weight
            norm.copy_((1 + norm) * peak * shrink - 1)
            # It multiplies the embedding by sqrt(hidden): undone here, or the residual stream
            # is the input token alone and every model predicts the same.
            embedding.div_(target.config.hidden_size**0.5 * shrink)
        elif tied:  # the output layer is the input embedding: scale what feeds it instead
            target.model.norm.weight.mul_(peak * shrink)
            embedding.div_(shrink)
        else:
            target.get_output_embeddings().weight.mul_(peak)
    draft = copy.deepcopy(target)
    if draft_dims is not None:
        draft_config = tiny_config(
            arch, vocab, max_positions, sliding_window=sliding_window, **{**overrides, **draft_dims}
        )
        draft = AutoModelForCausalLM.from_config(draft_config).eval()
    if draft_max_positions is not None:  # rotary models: only the declared limit changes
        draft.config.max_position_embeddings = draft_max_positions
    with torch.no_grad():
        for param in draft.parameters() if draft_dims is None else ():
            param.add_(torch.randn_like(param) * param.std() * draft_noise)
    if multimodal:
        target = with_vision_tower(target)
    paths = []
    for role, model, pad in (
        ("target", target, target_vocab_pad),
        ("draft", draft, draft_vocab_pad),
    ):
        if pad:
            model.resize_token_embeddings(vocab + pad, mean_resizing=False)
        path = out / role
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


def make_tiny_head(
    target_dir: str | Path,
    out_dir: str | Path,
    seed: int = 0,
    head_vocab: int | None = None,
    layers: tuple[int, ...] | None = None,
    peak: float = 4.0,
    norm_before_residual: bool = False,
) -> Path:
    """Write a random EAGLE-3 head for the target at ``target_dir`` into ``out_dir``, in the
    layout its authors publish (config ``LlamaForCausalLMEagle3``; weights ``fc``,
    ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` in ``model.safetensors``).
    ``head_vocab``: the head proposes that many of the target's tokens (every other one first);
    ``layers``: the target layers it reads (``eagle_aux_hidden_state_layer_ids``; None: the
    authors' default, which needs 7 layers or more to name three); ``norm_before_residual``:
    the variant whose residual stream starts from the normed features."""
    import json

    from safetensors.torch import save_file

    target = LlamaConfig.from_pretrained(target_dir)
    hidden, vocab = target.hidden_size, target.vocab_size
    head_vocab = head_vocab or vocab
    heads, kv_heads = target.num_attention_heads, target.num_key_value_heads
    head_dim = hidden // heads
    proposed = sorted([*range(0, vocab, 2), *range(1, vocab, 2)][:head_vocab])
    generator = torch.Generator().manual_seed(seed)

    def random(*shape: int, std: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    count = 3 if layers is None else len(layers)
    weights = {
        "fc.weight": random(hidden, count * hidden, std=1 / (count * hidden) ** 0.5),
        "midlayer.self_attn.q_proj.weight": random(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": random(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": random(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": random(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": random(target.intermediate_size, hidden),
        "midlayer.mlp.up_proj.weight": random(target.intermediate_size, hidden),
        "midlayer.mlp.down_proj.weight": random(hidden, target.intermediate_size),
        "midlayer.hidden_norm.weight": 1 + random(hidden),
        "midlayer.input_layernorm.weight": 1 + random(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + random(hidden),
        "norm.weight": 1 + random(hidden),
        "lm_head.weight": random(head_vocab, hidden, std=peak / hidden**0.5),
        "d2t": torch.tensor(proposed) - torch.arange(head_vocab),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, torch.tensor(proposed), True),
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": target.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": getattr(target, "rope_theta", 10000.0),
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": vocab,
        "draft_vocab_size": head_vocab,
        "target_hidden_size": hidden,
        "tie_word_embeddings": False,
    }
    if layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layers)}
    if norm_before_residual:
        config["norm_before_residual"] = True
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out
