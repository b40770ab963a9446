"""The portable (standard-op) graphs of a bundle drafted for by an EAGLE-3 head: what the TensorRT
provider compiles, and what runs where no engine does.

* The target's portable graph (optimum's) gains the head's features as an output
  (`add_features`): the residual stream entering each layer the head reads, side by side,
  through the head's ``fc``, at every position fed: the tensors are found by the names the
  exporter gives each layer's first norm, and the result is checked against PyTorch at export.
* The head's own portable graph (`export_portable_head`): its PyTorch reference (`Eagle3Head`)
  traced with an explicit cache fed back each call (``present = past + new``), as every
  portable graph's, and the same inputs and outputs as its engine (``hidden_states`` in,
  ``hidden_out`` out, logits at the target's ids).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specrt.bundle import ModelSpec
from specrt.errors import ExportError
from specrt.export.eagle import Eagle3Head, target_states
from specrt.export.ort_builder import FEATURES, HIDDEN_OUT, HIDDEN_STATES, UNPROPOSED
from specrt.export.ort_graph import EagleFeatures

# Where a layer's first norm lives in the graphs optimum writes (HF decoders; GPT-2).
CHECK_TOKENS = 12
FIRST_NORMS = ("/model/layers.{i}/input_layernorm/", "/transformer/h.{i}/ln_1/")


def add_features(graph_path: Path, features: EagleFeatures) -> None:
    """Give the portable graph at ``graph_path`` the output `FEATURES` ``[batch, sequence,
    hidden]`` (float32), in place."""
    model = onnx.load(str(graph_path), load_external_data=False)
    states = [layer_input(model.graph, i) for i in features.layers]
    fc = numpy_helper.from_array(np.ascontiguousarray(features.fc, np.float32), "eagle.fc.weight")
    model.graph.initializer.append(fc)
    model.graph.node.extend(
        [
            helper.make_node("Concat", states, ["eagle_states"], "eagle/Concat", axis=-1),
            helper.make_node("MatMul", ["eagle_states", fc.name], [FEATURES], "eagle/MatMul"),
        ]
    )
    width = features.fc.shape[1]
    model.graph.output.append(
        helper.make_tensor_value_info(FEATURES, TensorProto.FLOAT, ["batch", "sequence", width])
    )
    onnx.save(model, str(graph_path))


def layer_input(graph: onnx.GraphProto, i: int) -> str:
    """The tensor of the residual stream entering layer ``i`` (HF's ``hidden_states[i]``): what
    the layer's first norm reads from outside it (weights aside)."""
    producers = {out: node for node in graph.node for out in node.output}
    weights = {tensor.name for tensor in graph.initializer}
    for pattern in FIRST_NORMS:
        scope = pattern.format(i=i)
        found = {
            name
            for node in graph.node
            if node.name.startswith(scope)
            for name in node.input
            if name in producers
            and name not in weights
            and not producers[name].name.startswith(scope)
            and producers[name].op_type not in ("Identity", "Constant")
        }
        if len(found) == 1:
            return found.pop()
    raise ExportError(
        f"cannot find the input of layer {i} in the target's portable graph (its exporter names "
        "its nodes otherwise), so it cannot compute the EAGLE head's features: export with "
        "--no-portable (the onnxruntime engines compute them)"
    )


def features_difference(
    model: torch.nn.Module, graph: Path, spec: ModelSpec, features: EagleFeatures, seed: int = 0
) -> dict[str, float]:
    """max |diff| between the features the portable graph computes on random tokens (through
    the runtime's decoder) and PyTorch's."""
    from specrt.backends.select import make_decoder
    from specrt.backends.session import create_session

    ids = np.random.default_rng(seed).integers(0, spec.vocab_size, size=CHECK_TOKENS).tolist()
    session = create_session(graph, providers=["CPUExecutionProvider"])
    decoder = make_decoder(session, spec, spec.vocab_size, "check")
    decoder.forward(ids, keep_last=1)
    states = target_states(model, torch.tensor([ids]), features.layers)[0].numpy()
    difference = np.abs(decoder.features[0, : len(ids)] - states @ features.fc).max()
    return {"features_max_abs_diff": float(difference)}


class _PortableHead(torch.nn.Module):
    """`Eagle3Head` over new slots after a cache of past ones: ``input_ids``, ``hidden_states``
    ``[B, S, hidden]``, ``attention_mask [B, P + S]`` (0 where a past slot is padding),
    ``position_ids [B, S]``, past k and v ``[B, kv_heads, P, head_dim]`` -> logits at the
    target's ids ``[B, S, vocab]``, present k and v ``[B, kv_heads, P + S, head_dim]``, the
    head's hidden states ``[B, S, hidden]``."""

    def __init__(self, head: Eagle3Head, columns: np.ndarray) -> None:
        super().__init__()
        self.head = head
        head_vocab = head.lm_head.weight.shape[0]
        identity = np.array_equal(columns, np.arange(len(columns))) and len(columns) == head_vocab
        self.register_buffer("columns", None if identity else torch.from_numpy(columns))

    def forward(self, input_ids, hidden_states, attention_mask, position_ids, past_key, past_value):
        head = self.head
        q, k, v, normed = head.midlayer.qkv(head.embedding[input_ids], hidden_states)
        cos, sin = head.rotary(hidden_states, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = torch.cat([past_key, k], dim=2), torch.cat([past_value, v], dim=2)
        groups = head.heads // head.kv_heads
        scores = q @ keys.repeat_interleave(groups, dim=1).transpose(-1, -2)
        scores = scores / float(np.sqrt(head.head_dim))
        total, new = keys.shape[2], q.shape[2]
        # slot j is seen by new slot i where j <= past + i and the mask keeps it
        causal = torch.arange(total)[None, :] <= torch.arange(new)[:, None] + (total - new)
        seen = causal[None, None] & attention_mask[:, None, None, :].bool()
        scores = scores.masked_fill(~seen, torch.finfo(torch.float32).min)
        attended = scores.softmax(-1) @ values.repeat_interleave(groups, dim=1)
        batch = attended.shape[0]
        attended = attended.transpose(1, 2).reshape(batch, new, -1)
        start = normed if head.norm_before_residual else hidden_states
        hidden = head.midlayer.rest(start, attended)
        logits = head.logits(hidden)
        if self.columns is not None:  # the head's vocabulary at the target's ids
            unproposed = torch.full_like(logits[..., :1], UNPROPOSED)
            logits = torch.cat([logits, unproposed], dim=-1)[..., self.columns]
        return logits, keys, values, hidden


INPUTS = [
    "input_ids",
    HIDDEN_STATES,
    "attention_mask",
    "position_ids",
    "past_key_values.0.key",
    "past_key_values.0.value",
]
OUTPUTS = ["logits", "present.0.key", "present.0.value", HIDDEN_OUT]


def export_portable_head(
    reference: Eagle3Head, columns: np.ndarray, out_path: Path, opset: int | None = None
) -> Path:
    """Trace the head's portable graph into ``out_path`` (standard ops only)."""
    module = _PortableHead(reference, columns).eval()
    hidden = int(reference.config.hidden_size)
    past = torch.zeros(1, reference.kv_heads, 2, reference.head_dim)
    example = (
        torch.zeros(1, 3, dtype=torch.long),
        torch.zeros(1, 3, hidden),
        torch.ones(1, 5, dtype=torch.long),
        torch.arange(2, 5)[None],
        past,
        past.clone(),
    )
    axes = {name: {0: "batch", 1: "sequence"} for name in INPUTS[:4]}
    axes["attention_mask"] = {0: "batch", 1: "total"}
    for name in (*INPUTS[4:], *OUTPUTS[1:3]):
        axes[name] = {0: "batch", 2: "past" if name.startswith("past") else "total"}
    axes.update({name: {0: "batch", 1: "sequence"} for name in (OUTPUTS[0], OUTPUTS[3])})
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module, example, str(out_path), input_names=INPUTS, output_names=OUTPUTS,
            dynamic_axes=axes, opset_version=opset or 17, dynamo=False,
        )  # fmt: skip
    model = onnx.load(str(out_path))
    onnx.checker.check_model(model)
    if {node.domain for node in model.graph.node} - {"", "ai.onnx"}:
        raise ExportError("the EAGLE head's portable graph uses non-standard ops; report it")
    return out_path
