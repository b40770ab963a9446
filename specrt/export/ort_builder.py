"""What every onnxruntime engine graph is built with: the names of its inputs and outputs, the
`DecoderShape` its builders read, `_GraphBuilder` (nodes and initializers, weights cast to the
engine's precision), and the two ends every decoder shares: `_lm_head`, which writes the logits
and what the host reads instead of them, and `_save`, which declares the inputs and outputs and
writes the model with its weights as external data.

The decoders themselves are in `specrt.export.ort_graph` (see there for what the graph is) and
their attention in `specrt.export.ort_attention`; both build on this module, which imports
neither. It needs onnx and numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specrt.backends.base import PAIR_ROWS

OPSET = 21
BATCHED_OPSET = 23  # the Attention op
BY_LENGTH_OPSET = 24  # its nonpad_kv_seqlen input
IR_VERSIONS = {OPSET: 10, BATCHED_OPSET: 11, BY_LENGTH_OPSET: 12}
SEQLENS_K = "seqlens_k"  # int32 [batch]: valid positions after this call, minus one
TOTAL_LENGTH = "total_sequence_length"  # int32 scalar: valid positions after this call
PROBABILITIES = "probabilities"  # softmax of the logits, computed where onnxruntime's code is hot
ARGMAX = "argmax"  # int64 [1, n]: each kept row's best token (greedy_outputs)
MAX_LOGIT = "max_logit"  # float32 [1, n]: its logit, so the host can refuse NaN/inf
MAX_PROBABILITY = "max_probability"  # float32 [1, n]: its probability (the draft's confidence)
# An EAGLE head's input: the features it drafts from [B, S, hidden] (the target's, or its own
# output of the step before), and its output: the hidden state of the kept positions.
HIDDEN_STATES = "hidden_states"
HIDDEN_OUT = "hidden_out"
# The target's output for an EAGLE head: the head's input features at every position fed.
FEATURES = "eagle_features"
# The logit of a token an EAGLE head never proposes (outside its reduced vocabulary): finite, so
# NaN/inf checks pass, and its probability is 0 after any temperature.
UNPROPOSED = -1e30
# int64 [1]: -n, logits for the last n positions fed (prefill: -1). The Slice that keeps them
# reads its start on the host on CUDA: fed as it is, no node computes it on the device (a
# MemcpyToHost in every call, which also bars CUDA graphs).
LOGITS_START = "logits_start"
REDUCTION_CHUNK = 256  # columns per first-stage reduction of the chunked greedy outputs
# The batched engine's inputs, computed by the host from each row's length:
POSITION_IDS = "position_ids"  # int64 [B, S]: each new token's position
CACHE_INDICES = "cache_indices"  # int64 [B, S, 2]: (row, position) its k and v are written at
KV_LENGTHS = "kv_lengths"  # int64 [B]: keys each row holds after the call (`attend_by_length`)
ATTENTION_MASK = "attention_mask"  # bool [B, 1, S, L]: which cache slots each new token sees
# Models whose local (sliding-window) and global layers alternate: the local layers' mask.
LOCAL_ATTENTION_MASK = "attention_mask_local"
_MS = "com.microsoft"


@dataclass(frozen=True)
class DecoderShape:
    """What the builder needs from the HF config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    vocab_size: int  # logits width written (the tokenizer's vocabulary)
    # "float16" for GPU engines: weights, activations and KV cache; logits and their softmax
    # stay float32 (the sampler's precision, and fp16 would round close logits together).
    dtype: str = "float32"
    # Also output each kept row's argmax and max logit: a device backend copies back those few
    # numbers for greedy decoding instead of the logits.
    greedy_outputs: bool = False
    # Batched attention by each row's length (opset 24's nonpad_kv_seqlen, causal from the
    # bottom right) instead of under the mask: the CUDA provider's flash attention takes that
    # form, and no mask (models without sliding windows only).
    attend_by_length: bool = False
    # How the greedy outputs reduce the vocabulary: "direct" (one ArgMax / ReduceMax per row)
    # or "chunked" (`_chunked_greedy_outputs`; docs/gpu.md says why).
    greedy_reductions: str = "direct"
    # "batched": attention from standard ops over a cache indexed per row, so a call feeds
    # several tokens to each of several rows (GroupQueryAttention refuses batch > 1 when more
    # than one token follows a cached prefix).
    attention: str = "group_query"
    # Every call computing an even number of positions (`_even_rows`): onnxruntime's kernels
    # round a position computed alone (or last of an odd count) differently from one computed
    # beside another, and a quantised target's int8 activations magnify that into other tokens,
    # so its verification must compute what decoding alone does.
    even_rows: bool = False
    # A CPU target's attention computes at least two query rows (`_two_query_rows_attention`):
    # float32 matrix products give a row the same bits whatever rows come with it, so that
    # alone makes a float32 target verify what it computes decoding alone, and a quantised one
    # too where its weights' kernels do likewise (8-bit weights on AVX2), without `_even_rows`.
    two_query_rows: bool = False
    # Qwen3: each head's q and k RMS-normalised (weights ``self_attn.q_norm`` / ``k_norm``,
    # over head_dim) before the rotation.
    qk_norm: bool = False
    # Gemma: the embedding is scaled by sqrt(hidden) and the MLP's gate uses the tanh GELU.
    embedding_scale: float = 1.0
    activation: str = "silu"  # or "gelu_tanh"
    # Gemma 2/3: scores scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5),
    # cap * tanh(x / cap) on attention scores and on the logits (0: none), and norms after the
    # attention and the MLP as well as before them.
    attention_scale: float | None = None
    attention_softcap: float = 0.0
    logit_softcap: float = 0.0
    sandwich_norms: bool = False
    # Layers attending to the last ``window`` positions only (the others see all of them), and
    # layers rotating with tables of their own (Gemma 3's local layers: their own rope base,
    # whatever the window).
    local_layers: tuple[int, ...] = ()
    window: int | None = None
    local_rope_layers: tuple[int, ...] = ()
    # Partial rotary (Phi-4-mini): only the first ``rotary_dim`` of each head's dimensions
    # rotate (0: all of them).
    rotary_dim: int = 0

    @property
    def scale(self) -> float:
        return float(self.attention_scale or self.head_dim**-0.5)

    @property
    def two_masks(self) -> bool:
        """Local and global layers both: the batched graph takes a mask for each kind."""
        return 0 < len(self.local_layers) < self.num_layers


def _lm_head(
    b: _GraphBuilder,
    normed: str,
    matrix: np.ndarray,
    shape: DecoderShape,
    vocab_map: np.ndarray | None = None,
) -> None:
    """Logits ``[1, n, vocab]`` of the last n = ``-logits_start`` positions (``matrix``:
    ``[hidden, vocab]``) and their softmax, in float32. A prompt needs none of its logits, and
    on a large vocabulary the head is a good part of a prefill's work. ``vocab_map`` (an EAGLE
    head's reduced vocabulary): each token's column of ``matrix``, or its width for a token
    the head never proposes (logit `UNPROPOSED`: probability 0 after any warp)."""
    b.constant("positions_end", np.array([2**62], dtype=np.int64))
    b.constant("positions_axis", np.array([1], dtype=np.int64))
    b.node("Slice", [normed, LOGITS_START, "positions_end", "positions_axis"], ["head_in"])
    b.initializer("lm_head.MatMul", matrix)
    logits = "logits_uncapped" if shape.logit_softcap else "logits"
    own = logits if vocab_map is None else "head_logits"
    if shape.dtype == "float32":
        b.node("MatMul", ["head_in", "lm_head.MatMul"], [own])
    else:
        b.node("MatMul", ["head_in", "lm_head.MatMul"], ["logits_half"])
        b.node("Cast", ["logits_half"], [own], to=TensorProto.FLOAT)
    if vocab_map is not None:  # [.., head vocab] -> [.., vocab]
        _scatter_to_vocab(b, own, logits, vocab_map, matrix.shape[1])
    if shape.logit_softcap:  # Gemma 2: cap * tanh(logits / cap)
        b.constant("logit_softcap", np.array(shape.logit_softcap, dtype=np.float32))
        b.node("Div", [logits, "logit_softcap"], ["logits_scaled"])
        b.node("Tanh", ["logits_scaled"], ["logits_tanh"])
        b.node("Mul", ["logits_tanh", "logit_softcap"], ["logits"])
    b.node("Softmax", ["logits"], [PROBABILITIES], axis=-1)
    if shape.greedy_outputs:
        _greedy_outputs(b, shape.vocab_size, shape.greedy_reductions)


def _scatter_to_vocab(
    b: _GraphBuilder, head_logits: str, logits: str, columns: np.ndarray, head_vocab: int
) -> None:
    """``logits``: ``head_logits`` written at the target's ids, `UNPROPOSED` elsewhere. A
    scatter of the head's columns into a filled row, not a Gather of every target id: onnxruntime
    gathers along the last axis one element at a time, which took a third of SmolLM2's head step
    (docs/performance.md)."""
    ids = np.flatnonzero(columns < head_vocab)  # the target ids the head proposes
    used = columns[ids]  # their columns among the head's logits
    if not np.array_equal(np.sort(used), np.arange(head_vocab)):  # columns left out
        b.constant("head_columns", used.astype(np.int64))
        b.node("Gather", [head_logits, "head_columns"], ["head_logits_used"], axis=-1)
        head_logits = "head_logits_used"
    else:  # each head column once: scatter them in their own order
        ids = ids[np.argsort(used)]
    vocab = len(columns)
    b.constant("unproposed_row", np.full((1, 1, vocab), UNPROPOSED, dtype=np.float32))
    b.constant("proposed_ids", ids.reshape(1, 1, -1).astype(np.int64))
    b.constant("rows_axes_end", np.array([2], dtype=np.int64))
    b.constant("rows_axes_start", np.array([0], dtype=np.int64))
    b.constant("vocab_width", np.array([vocab], dtype=np.int64))
    b.node("Shape", [head_logits], ["head_logits_shape"])
    b.node("Slice", ["head_logits_shape", "rows_axes_start", "rows_axes_end"], ["logits_rows"])
    b.node("Concat", ["logits_rows", "vocab_width"], ["logits_shape"], axis=0)
    b.node("Expand", ["unproposed_row", "logits_shape"], ["unproposed_logits"])
    b.node("Expand", ["proposed_ids", "head_logits_shape"], ["proposed_ids_rows"])
    b.node(
        "ScatterElements",
        ["unproposed_logits", "proposed_ids_rows", head_logits],
        [logits],
        axis=-1,
    )


def _greedy_outputs(b: _GraphBuilder, vocab: int, reductions: str) -> None:
    """Each kept row's argmax, max logit and max probability, from ``logits`` and
    `PROBABILITIES`: one reduction a row ("direct") or two stages ("chunked")."""
    b.constant("vocab_axis", np.array([-1], dtype=np.int64))
    if reductions == "chunked":
        return _chunked_greedy_outputs(b, vocab)
    b.node("ArgMax", ["logits"], [ARGMAX], axis=-1, keepdims=0)
    b.node("ReduceMax", ["logits", "vocab_axis"], [MAX_LOGIT], keepdims=0)
    b.node("ReduceMax", [PROBABILITIES, "vocab_axis"], [MAX_PROBABILITY], keepdims=0)


def _chunked_greedy_outputs(b: _GraphBuilder, vocab: int) -> None:
    """The greedy outputs in two stages: over each chunk of `REDUCTION_CHUNK` columns, then
    over the chunks. The same numbers as one reduction (a maximum is exact; the argmax is the
    first chunk holding the row's maximum, and its first column there: numpy's first of equal
    maxima). On CUDA one reduction a row is a long serial scan in some onnxruntime kernels
    (docs/gpu.md); here each output reads at most a chunk or a row of chunk maxima."""
    chunks = -(-vocab // REDUCTION_CHUNK)
    b.constant("chunked_shape", np.array([0, 0, chunks, REDUCTION_CHUNK], dtype=np.int64))
    b.constant("chunk_width", np.array([REDUCTION_CHUNK], dtype=np.int64))
    pads = [0, 0, 0, 0, 0, chunks * REDUCTION_CHUNK - vocab]
    b.constant("vocab_pads", np.array(pads, dtype=np.int64))
    per_chunk = {}
    for source, pad in (("logits", np.finfo(np.float32).min), (PROBABILITIES, 0.0)):
        b.constant(f"{source}_pad", np.array(pad, dtype=np.float32))  # never above a real one
        b.node("Pad", [source, "vocab_pads", f"{source}_pad"], [f"{source}_padded"])
        b.node("Reshape", [f"{source}_padded", "chunked_shape"], [f"{source}_chunked"])
        per_chunk[source] = f"{source}_chunk_max"
        b.node("ReduceMax", [f"{source}_chunked", "vocab_axis"], [per_chunk[source]], keepdims=0)
    b.node("ReduceMax", [per_chunk["logits"], "vocab_axis"], [MAX_LOGIT], keepdims=0)
    b.node("ReduceMax", [per_chunk[PROBABILITIES], "vocab_axis"], [MAX_PROBABILITY], keepdims=0)
    b.node("ArgMax", ["logits_chunked"], ["in_each_chunk"], axis=-1, keepdims=0)  # [B, n, C]
    b.node("ArgMax", [per_chunk["logits"]], ["best_chunk"], axis=-1, keepdims=1)  # [B, n, 1]
    b.node("GatherElements", ["in_each_chunk", "best_chunk"], ["in_best_chunk"], axis=-1)
    b.node("Mul", ["best_chunk", "chunk_width"], ["best_chunk_start"])
    b.node("Add", ["best_chunk_start", "in_best_chunk"], ["argmax_kept"])
    b.node("Squeeze", ["argmax_kept", "vocab_axis"], [ARGMAX])


def _save(
    b: _GraphBuilder,
    shape: DecoderShape,
    out_path: Path,
    extra_inputs: tuple[onnx.ValueInfoProto, ...] = (),
    extra_outputs: tuple[onnx.ValueInfoProto, ...] = (),
) -> Path:
    """Declare the graph's inputs and outputs (``extra_*``: an EAGLE head's hidden states, the
    target's features for it) and write it with its weights as external data."""
    cache_type = TENSOR_TYPES[shape.dtype]
    kv_dims = ["batch", shape.num_kv_heads, "past_sequence_length", shape.head_dim]
    present_dims = ["batch", shape.num_kv_heads, "total_sequence_length", shape.head_dim]
    if shape.attention == "batched":
        kv_dims = present_dims = ["batch", "max_length", shape.num_kv_heads * shape.head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
        helper.make_tensor_value_info(SEQLENS_K, TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info(TOTAL_LENGTH, TensorProto.INT32, []),
        helper.make_tensor_value_info(LOGITS_START, TensorProto.INT64, [1]),
    ]
    if shape.attention == "batched":
        inputs[1:3] = [
            helper.make_tensor_value_info(POSITION_IDS, TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info(
                CACHE_INDICES, TensorProto.INT64, ["batch", "sequence", 2]
            ),
            helper.make_tensor_value_info(
                ATTENTION_MASK, TensorProto.BOOL, ["batch", 1, "sequence", "max_length"]
            ),
        ]
        if shape.two_masks:
            inputs.append(
                helper.make_tensor_value_info(
                    LOCAL_ATTENTION_MASK, TensorProto.BOOL, ["batch", 1, "sequence", "max_length"]
                )
            )
        if shape.attend_by_length:  # the mask stays an input (the runtime binds it), unread
            inputs.append(helper.make_tensor_value_info(KV_LENGTHS, TensorProto.INT64, ["batch"]))
    outputs = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "kept", shape.vocab_size])
        for name in ("logits", PROBABILITIES)
    ]
    if shape.greedy_outputs:
        outputs.append(helper.make_tensor_value_info(ARGMAX, TensorProto.INT64, ["batch", "kept"]))
        for name in (MAX_LOGIT, MAX_PROBABILITY):
            outputs.append(
                helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "kept"])
            )
    inputs += extra_inputs
    outputs += extra_outputs
    if shape.even_rows:
        _even_rows(b)
        inputs.append(helper.make_tensor_value_info(PAIR_ROWS, TensorProto.INT64, [1]))
    for i in range(shape.num_layers):
        for kind in ("key", "value"):
            inputs.append(
                helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", cache_type, kv_dims)
            )
            outputs.append(
                helper.make_tensor_value_info(f"present.{i}.{kind}", cache_type, present_dims)
            )
    graph = helper.make_graph(b.nodes, "specrt_decoder", inputs, outputs, b.initializers)
    opset = BATCHED_OPSET if shape.attention == "batched" else OPSET
    opset = BY_LENGTH_OPSET if shape.attend_by_length else opset
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(_MS, 1)],
        producer_name="specrt",
        # The oldest IR version with this opset, not the onnx package's newest: an older
        # onnxruntime refuses a newer IR version whatever ops the graph uses.
        ir_version=IR_VERSIONS[opset],
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(
        model,
        str(out_path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=out_path.name + ".data",
        size_threshold=1024,
    )
    return out_path


TENSOR_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
# The inputs with a position axis, and that axis.
_POSITION_AXES = {
    "input_ids": 1,
    POSITION_IDS: 1,
    CACHE_INDICES: 1,
    ATTENTION_MASK: 2,
    LOCAL_ATTENTION_MASK: 2,
}


def _even_rows(b: _GraphBuilder) -> None:
    """Rewrite the graph so that a call fed an odd number of positions computes one more: a
    copy of its last (the same token at the same position, seeing the same slots, its key and
    value written over the last's with the same numbers), left out of the outputs.

    onnxruntime's int8-compute MatMulNBits kernels multiply a row alone with a kernel of their
    own, which rounds differently: on AVX2 a call of one row, with AVX-512 and blocks of 64 or
    more the last row of an odd count (rows go two at a time); the Attention op likewise
    multiplies a single query row with a kernel of its own. With an even number of rows every
    row takes the kernel for several and gets the same bits whoever its partner is, so
    a position verified among others equals the same position decoded alone (checked bit for
    bit at export: `step_vs_one_at_a_time_max_abs_diff`). The copy is made where the input
    `PAIR_ROWS` is 1: a CPU that gives a row alone the same bits (blocks of 32 with AVX-512
    VNNI) runs without it, as loading measures."""
    used = {name for node in b.nodes for name in node.input}
    padded = {name: f"{name}.even" for name in _POSITION_AXES if name in used}
    for node in b.nodes:
        node.input[:] = [padded.get(name, name) for name in node.input]
        node.output[:] = [f"{FEATURES}.even" if name == FEATURES else name for name in node.output]
    front, b.nodes = b.nodes, []
    b.initializer("even.two", np.array([2], dtype=np.int64))
    b.initializer("even.zero", np.array([0], dtype=np.int64))
    b.initializer("even.position_axis", np.array([1], dtype=np.int64))
    b.node("Shape", ["input_ids"], ["fed_positions"], start=1, end=2)  # [1]
    # 1 where one is added: an odd count, unless the host says this CPU needs no pair (0)
    b.node("Mod", ["fed_positions", "even.two"], ["odd_fed"])
    b.node("Mul", ["odd_fed", PAIR_ROWS], ["odd_position"])
    b.node("Concat", ["even.zero", "odd_position"], ["even.pads"], axis=0)  # none before
    for name, out in padded.items():
        axis = b.initializer(f"even.axis.{name}", np.array([_POSITION_AXES[name]], np.int64))
        b.node("Pad", [name, "even.pads", "", axis], [out], mode="edge")
    b.node("Sub", [LOGITS_START, "odd_position"], ["even.logits_start"])
    b.node("Neg", [LOGITS_START], ["kept_positions"])  # logits for the last n positions fed
    b.node("Mod", ["kept_positions", "even.two"], ["odd_kept_count"])
    b.node("Mul", ["odd_kept_count", PAIR_ROWS], ["odd_kept"])
    b.node("Concat", ["even.zero", "odd_kept"], ["even.kept_pads"], axis=0)
    for node in front:
        b.nodes.append(node)
        if node.op_type == "Slice" and list(node.output) == ["head_in"]:  # before the one added
            node.input[1:3] = ["even.logits_start", "fed_positions"]
        if node.op_type == "MatMul" and node.input[0] == "head_in":  # an even count here too
            b.nodes.pop()
            axis = "even.position_axis"
            b.node("Pad", ["head_in", "even.kept_pads", "", axis], ["head_in.even"], mode="edge")
            out = node.output[0]
            node.input[0], node.output[0] = "head_in.even", f"{out}.even"
            b.nodes.append(node)
            b.node("Slice", [f"{out}.even", "even.zero", "kept_positions", axis], [out])
    if f"{FEATURES}.even" in {name for node in b.nodes for name in node.output}:
        b.node(
            "Slice",
            [f"{FEATURES}.even", "even.zero", "fed_positions", "even.position_axis"],
            [FEATURES],
        )
    for number, node in enumerate(b.nodes):  # unique again, in the new order
        node.name = f"{node.op_type}.{number}"


class _GraphBuilder:
    def __init__(self, weights: Mapping[str, np.ndarray], dtype: str = "float32") -> None:
        self.weights = weights
        self.float_type = np.dtype(dtype)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set()

    def node(self, op: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs):
        name = f"{op}.{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))

    def initializer(self, name: str, array: np.ndarray) -> str:
        if name not in self._names:
            array = np.ascontiguousarray(
                array, dtype=self.float_type if array.dtype.kind == "f" else None
            )
            self.initializers.append(numpy_helper.from_array(array, name))
            self._names.add(name)
        return name

    def constant(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(array, name))
        self._names.add(name)
        return name

    def weight(self, name: str) -> str:
        if name not in self.weights:
            raise KeyError(f"the checkpoint has no weight {name!r}")
        return self.initializer(name, self.weights[name])

    def conv1d(self, x: str, module: str, out: str) -> str:
        """GPT-2's Conv1D: x @ weight + bias, weight already ``[in, out]``."""
        self.node("MatMul", [x, self.weight(f"{module}.weight")], [f"{out}.matmul"])
        self.node("Add", [f"{out}.matmul", self.weight(f"{module}.bias")], [out])
        return out

    def linear(self, x: str, modules: list[str], out: str) -> str:
        """One MatMul for one or more Linear layers side by side (packed q/k/v), plus bias."""
        matrix = np.concatenate([self.weights[f"{m}.weight"] for m in modules], axis=0).T
        self.initializer(f"{out}.MatMul.weight", matrix)
        has_bias = [f"{m}.bias" in self.weights for m in modules]
        if not any(has_bias):
            self.node("MatMul", [x, f"{out}.MatMul.weight"], [out])
            return out
        bias = np.concatenate(
            [
                self.weights.get(f"{m}.bias", np.zeros(self.weights[f"{m}.weight"].shape[0]))
                for m in modules
            ]
        )
        self.initializer(f"{out}.bias", bias)
        self.node("MatMul", [x, f"{out}.MatMul.weight"], [f"{out}.matmul"])
        self.node("Add", [f"{out}.matmul", f"{out}.bias"], [out])
        return out
