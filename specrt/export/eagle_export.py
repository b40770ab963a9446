"""export_bundle with an EAGLE-3 head as the draft: the target's CPU engine computes the head's
features (`ort_graph.EagleFeatures`), the head gets its own engine (`ort_eagle`), and both are
checked against PyTorch (`Eagle3Head`) before the bundle is published.

The bundle's ``draft`` is then the head (``architecture`` "LlamaForCausalLMEagle3"); the runtime
drafts with it through `specrt.backends.eagle.EagleDraft`, on the onnxruntime CPU engines or
(``--device cuda``) the float16 cuda engines of both.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from specrt.backends.base import NEED_LOGITS
from specrt.backends.eagle import EagleDraft
from specrt.backends.select import make_decoder
from specrt.backends.session import create_session
from specrt.bundle import (
    CUDA_ENGINE,
    EAGLE3_ARCHITECTURE,
    ONNXRUNTIME_ENGINE,
    EngineSpec,
    ModelIO,
    ModelSpec,
)
from specrt.checksums import sha256_file
from specrt.errors import ExportError
from specrt.export.checkpoint_hash import checkpoint_sha256
from specrt.export.eagle import (
    Eagle3Head,
    HeadCheckpoint,
    head_weights_numpy,
    target_features,
)
from specrt.export.ort_builder import (
    ARGMAX,
    ATTENTION_MASK,
    CACHE_INDICES,
    HIDDEN_OUT,
    HIDDEN_STATES,
    LOGITS_START,
    MAX_LOGIT,
    MAX_PROBABILITY,
    POSITION_IDS,
    PROBABILITIES,
    UNPROPOSED,
    DecoderShape,
)
from specrt.export.ort_eagle import build_head_graph, vocab_map
from specrt.export.ort_engine import rope_tables
from specrt.export.portable_eagle import export_portable_head
from specrt.export.quantize import quantize_weights

CHECK_TOKENS = 12
PORTABLE = "portable"  # `head_check` of the portable graphs


def export_head(
    head: HeadCheckpoint,
    head_dir: Path,
    model: torch.nn.Module,
    target: ModelSpec,
    bundle_root: Path,
    vocab: int,
    tokenizer_hash: str,
    atol: float = 1e-3,
    precision: str = "float32",
    fp16_atol: float | None = None,
    portable: bool = False,
) -> ModelSpec:
    """Write ``draft/onnxruntime/model.onnx``, the head's engine, check it with the target's
    engine against PyTorch, and return its spec. ``precision``: its weights', as a draft
    model's (`specrt.export.quantize`): checked in float32 first (within ``atol``: the graph
    is right), then quantised (its logits must only be numbers: a draft's guesses).
    ``fp16_atol``: also write ``draft/cuda/model.onnx``, the head in float16 for the CUDA
    provider beside the target's cuda engine, checked with it within that bound.
    ``portable``: also write ``draft/model.onnx``, the head's portable graph (standard ops, in
    float32, what TensorRT takes), checked with the target's portable graph within ``atol``;
    it is then the spec's own graph, as a draft model's is."""
    config = head.config
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    kv_heads = int(config.num_key_value_heads or heads)
    shape = DecoderShape(
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        norm_eps=float(config.rms_norm_eps),
        vocab_size=vocab,
        attention="batched",
    )
    positions = target.max_positions
    reference = Eagle3Head.from_checkpoint(head, model.get_input_embeddings().weight.detach())
    cos, sin = rope_tables(reference.rotary, positions)
    embedding = reference.embedding[:vocab].numpy()
    columns = vocab_map(head.weights["d2t"].numpy(), vocab)
    out = bundle_root / "draft" / ONNXRUNTIME_ENGINE / "model.onnx"
    graph = build_head_graph(
        shape,
        head_weights_numpy(head),
        embedding,
        cos,
        sin,
        columns,
        out,
        head.norm_before_residual,
    )
    io = ModelIO(
        input_ids="input_ids",
        attention_mask=ATTENTION_MASK,
        position_ids=POSITION_IDS,
        past_keys=["past_key_values.0.key"],
        past_values=["past_key_values.0.value"],
        logits="logits",
        present_keys=["present.0.key"],
        present_values=["present.0.value"],
        probabilities=PROBABILITIES,
        logits_start=LOGITS_START,
        cache_indices=CACHE_INDICES,
        hidden_states=HIDDEN_STATES,
        hidden_out=HIDDEN_OUT,
    )
    engine = EngineSpec(path=str(graph.relative_to(bundle_root)), files={}, io=io,
                        vocab_size=vocab, cache="batched")  # fmt: skip
    spec = ModelSpec(
        path=engine.path,
        files={},
        architecture=EAGLE3_ARCHITECTURE,
        model_type="eagle3",
        num_layers=1,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_positions=positions,
        dtype="float32",
        io=io,
        tokenizer_hash=tokenizer_hash,
        source=str(Path(head_dir).resolve()),
        source_sha256=checkpoint_sha256(Path(head_dir)),
        cache="batched",
        engines={ONNXRUNTIME_ENGINE: engine},
    )
    check = head_check(model, reference, head, spec, target, bundle_root, columns)
    check["atol"] = atol
    if not math.isfinite(check["max_abs_logit_diff"]) or check["max_abs_logit_diff"] > atol:
        raise ExportError(
            f"EAGLE head: ONNX logits differ from PyTorch by {check['max_abs_logit_diff']:.3g} "
            f"(> atol {atol}); the export is numerically wrong. Report it"
        )
    if precision != "float32":
        quantize_weights(graph, precision)
        check["float32_max_abs_logit_diff"] = check["max_abs_logit_diff"]
        check["max_abs_logit_diff"] = head_check(
            model, reference, head, spec, target, bundle_root, columns
        )["max_abs_logit_diff"]
        if not math.isfinite(check["max_abs_logit_diff"]):
            raise ExportError(
                f"EAGLE head: its {precision} engine gives NaN/inf logits; export it with "
                "--draft-precision float32"
            )
    files = {str(f.relative_to(bundle_root)): sha256_file(f) for f in sorted(out.parent.iterdir())}
    spec.files = engine.files = files
    engine.precision = precision
    spec.export_check = engine.export_check = check
    if fp16_atol is not None:
        half = replace(shape, dtype="float16", greedy_outputs=True, greedy_reductions="chunked")
        graph = build_head_graph(
            half, head_weights_numpy(head), embedding, cos, sin, columns,
            bundle_root / "draft" / CUDA_ENGINE / "model.onnx", head.norm_before_residual,
        )  # fmt: skip
        files = {
            str(f.relative_to(bundle_root)): sha256_file(f) for f in sorted(graph.parent.iterdir())
        }
        greedy = dict(argmax=ARGMAX, max_logit=MAX_LOGIT, max_probability=MAX_PROBABILITY)
        spec.engines[CUDA_ENGINE] = cuda = EngineSpec(
            path=str(graph.relative_to(bundle_root)), files=files, io=replace(io, **greedy),
            vocab_size=vocab, cache="batched", precision="float16",
            provider="CUDAExecutionProvider", dtype="float16",
        )  # fmt: skip
        cuda.export_check = head_check(
            model, reference, head, spec, target, bundle_root, columns, engine=CUDA_ENGINE
        )
        cuda.export_check["atol"] = fp16_atol
        if not cuda.export_check["max_abs_logit_diff"] <= fp16_atol:
            raise ExportError(
                f"EAGLE head: its float16 cuda engine's logits differ from PyTorch by "
                f"{cuda.export_check['max_abs_logit_diff']:.3g} (> fp16_atol {fp16_atol}); "
                "export it without --device cuda, or with a larger fp16_atol"
            )
    if portable:
        _add_portable_head(reference, columns, spec, target, model, head, bundle_root, atol)
    return spec


def _add_portable_head(reference, columns, spec: ModelSpec, target: ModelSpec, model, head,
                       bundle_root: Path, atol: float) -> None:  # fmt: skip
    """Write and check the head's portable graph, and make it ``spec``'s own graph."""
    graph = export_portable_head(reference, columns, bundle_root / "draft" / "model.onnx")
    files = {str(f.relative_to(bundle_root)): sha256_file(f) for f in sorted(graph.parent.glob("*"))
             if f.is_file()}  # fmt: skip
    io = ModelIO(
        input_ids="input_ids",
        attention_mask="attention_mask",
        position_ids="position_ids",
        past_keys=["past_key_values.0.key"],
        past_values=["past_key_values.0.value"],
        logits="logits",
        present_keys=["present.0.key"],
        present_values=["present.0.value"],
        hidden_states=HIDDEN_STATES,
        hidden_out=HIDDEN_OUT,
    )
    portable = replace(spec, path=str(graph.relative_to(bundle_root)), files=files, io=io,
                       cache="concat", engines={})  # fmt: skip
    check = head_check(model, reference, head, portable, target, bundle_root, columns,
                       engine=PORTABLE)  # fmt: skip
    check["atol"] = atol
    if not check["max_abs_logit_diff"] <= atol:
        raise ExportError(
            f"EAGLE head: its portable graph's logits differ from PyTorch by "
            f"{check['max_abs_logit_diff']:.3g} (> atol {atol}); the export is numerically "
            "wrong. Report it, or export with --no-portable"
        )
    spec.path, spec.files, spec.io, spec.cache = portable.path, files, io, "concat"
    spec.export_check = check


def head_check(
    model: torch.nn.Module,
    reference: Eagle3Head,
    head: HeadCheckpoint,
    spec: ModelSpec,
    target: ModelSpec,
    bundle_root: Path,
    columns: np.ndarray,
    seed: int = 0,
    engine: str = ONNXRUNTIME_ENGINE,
) -> dict[str, float]:
    """The head as the runtime runs it (`EagleDraft` over both models' ``engine``, on this
    machine's CPU) against PyTorch on random tokens: the target engine's features against
    PyTorch's (reported: a quantised target's are another model's), then the head on the
    engine's features, over the positions the target read (one call, as a round's catch-up)
    and one chained step from its own state."""
    vocab = spec.vocab_size
    ids = np.random.default_rng(seed).integers(0, vocab, size=CHECK_TOKENS).tolist()
    target_decoder = _open(bundle_root, target, engine, vocab)
    target_decoder.forward(ids, keep_last=1)
    computed = target_decoder.features[0, :CHECK_TOKENS].copy()
    feature_diff = float(np.abs(computed - target_features(model, ids, head).numpy()).max())
    features = torch.from_numpy(computed)  # [n, hidden]: the head's input, as the engine has it
    positions = torch.arange(CHECK_TOKENS)
    logits, hidden = reference(features[:-1], torch.tensor(ids[1:]), positions[:-1])
    chained = ids[-1]
    step_logits, _ = reference(
        torch.cat([features[:-1], hidden[-1:]]),
        torch.tensor(ids[1:] + [chained]),
        positions,
    )
    expected = _on_target_vocab(logits.numpy(), columns)
    expected_step = _on_target_vocab(step_logits[-1:].numpy(), columns)
    draft = EagleDraft(_open(bundle_root, spec, engine, vocab), target_decoder)
    tokens = np.array([ids[1:]], dtype=np.int64)
    got = draft.forward_rows(tokens, keep_last=len(ids) - 1, need=NEED_LOGITS).logits[0].copy()
    target_decoder.set_length(0, CHECK_TOKENS - 1)  # the next slot chains on the head's state
    got_step = draft.forward_rows(np.array([[chained]]), keep_last=1).logits[0].copy()
    proposed = columns < len(head.weights["d2t"])
    catch_up_diff = float(np.abs(got[:, proposed] - expected[:, proposed]).max())
    step_diff = float(np.abs(got_step[:, proposed] - expected_step[:, proposed]).max())
    return {
        "features_max_abs_diff": feature_diff,
        "prefill_max_abs_logit_diff": catch_up_diff,
        "step_max_abs_logit_diff": step_diff,
        "max_abs_logit_diff": float(np.max([catch_up_diff, step_diff])),
        "unproposed_logit": float(UNPROPOSED),
    }


def _open(bundle_root: Path, spec: ModelSpec, engine: str, vocab: int):
    """The decoder of ``spec``'s graph ``engine`` (`PORTABLE`: its own) on this CPU."""
    view = spec if engine == PORTABLE or engine not in spec.engines else spec.engine_view(engine)
    session = create_session(bundle_root / view.path, providers=["CPUExecutionProvider"])
    return make_decoder(session, view, vocab, "check")


def _on_target_vocab(head_logits: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """``[n, head vocab]`` logits at the target's ids (`UNPROPOSED` where the head has none)."""
    padded = np.concatenate(
        [head_logits, np.full((len(head_logits), 1), UNPROPOSED, dtype=np.float32)], axis=1
    )
    return padded[:, columns]
