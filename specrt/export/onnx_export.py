"""One HF checkpoint -> one ONNX decoder with explicit KV-cache inputs and all-position logits.

optimum-onnx does the tracing (task ``text-generation-with-past``): inputs ``input_ids``,
``attention_mask``, ``position_ids``, ``past_key_values.{i}.key/value`` (past length may be 0);
outputs ``logits`` ``[batch, seq, vocab]`` and ``present.{i}.key/value``. We check the result uses
standard ONNX ops only (TensorRT must take the same graph) and describe it for the manifest.
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import warnings
from pathlib import Path

import onnx
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from specrt.bundle import ModelIO, ModelSpec
from specrt.checksums import sha256_file
from specrt.errors import ExportError
from specrt.export.options import MIN_OPSET

STANDARD_DOMAINS = {"", "ai.onnx"}


def check_opset(opset: int | None) -> None:
    """Past the ceiling of torch's exporter (what optimum runs) an export fails only after a
    long dump of torch's graph: say so before any model is read."""
    from torch.onnx import _constants

    ceiling = getattr(_constants, "ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET", None)
    if opset is not None and ceiling is not None and opset > ceiling:
        raise ExportError(
            f"opset={opset}: torch's ONNX exporter, which optimum runs, goes up to {ceiling}; "
            f"give {MIN_OPSET} to {ceiling}, or leave it out"
        )


def export_onnx(
    checkpoint_dir: Path, out_dir: Path, opset: int | None = None, slim: bool = False
) -> Path:
    """Run optimum's exporter quietly into a scratch dir; move the graph files to ``out_dir``.

    ``slim`` runs onnxslim over the graph (standard ops still): fewer shape-computation nodes,
    which is what a small model's per-call time is mostly made of on CPU.
    """
    from optimum.exporters.onnx import main_export

    scratch = out_dir.parent / f"{out_dir.name}.optimum"
    chatter = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(chatter):
            warnings.simplefilter("ignore")
            logging.getLogger("optimum").setLevel(logging.ERROR)
            logging.getLogger("transformers").setLevel(logging.ERROR)
            main_export(
                str(checkpoint_dir),
                output=scratch,
                task="text-generation-with-past",
                opset=opset,
                no_post_process=True,
                do_validation=False,  # we run our own check: prefill AND a multi-token step
                library_name="transformers",
                local_files_only=True,
                slim=slim,
            )
    except Exception as exc:
        raise ExportError(
            f"optimum could not export {checkpoint_dir} to ONNX: {type(exc).__name__}: {exc}"
        ) from exc
    out_dir.mkdir(parents=True, exist_ok=True)
    graph = scratch / "model.onnx"
    if not graph.is_file():
        raise ExportError(f"optimum produced no model.onnx for {checkpoint_dir}")
    for name in _graph_files(graph):
        shutil.move(str(scratch / name), str(out_dir / name))
    shutil.rmtree(scratch, ignore_errors=True)
    return out_dir / "model.onnx"


def _graph_files(graph: Path) -> list[str]:
    """The graph file and every external-data file it references."""
    model = onnx.load(str(graph), load_external_data=False)
    names = {graph.name}
    for tensor in model.graph.initializer:
        if uses_external_data(tensor):
            names.add(ExternalDataInfo(tensor).location)
    return sorted(names)


def describe_model(graph: Path, bundle_root: Path, config, tokenizer_hash: str) -> ModelSpec:
    """Check the graph and build its manifest entry from the graph's own I/O and the HF config."""
    try:
        onnx.checker.check_model(str(graph))
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"the exported graph {graph} fails onnx's checker: {exc}") from exc
    model = onnx.load(str(graph), load_external_data=False)
    foreign = sorted({n.domain for n in model.graph.node} - STANDARD_DOMAINS)
    if foreign:
        raise ExportError(
            f"{graph} uses non-standard op domains {foreign}; TensorRT cannot take it"
        )

    inputs = {i.name: i for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    layers = int(config.num_hidden_layers)
    past_keys = [f"past_key_values.{i}.key" for i in range(layers)]
    past_values = [f"past_key_values.{i}.value" for i in range(layers)]
    present_keys = [f"present.{i}.key" for i in range(layers)]
    present_values = [f"present.{i}.value" for i in range(layers)]
    missing = [n for n in ["input_ids", *past_keys, *past_values] if n not in inputs]
    missing += [n for n in ["logits", *present_keys, *present_values] if n not in outputs]
    if missing:
        raise ExportError(f"{graph} lacks expected inputs/outputs {missing[:4]}")

    dims = [d.dim_value or None for d in inputs[past_keys[0]].type.tensor_type.shape.dim]
    heads = dims[1] or getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = dims[3] or config.hidden_size // config.num_attention_heads
    elem = inputs[past_keys[0]].type.tensor_type.elem_type
    dtype = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16"}.get(elem)
    if dtype is None:
        raise ExportError(
            f"{graph}: unsupported cache dtype {onnx.TensorProto.DataType.Name(elem)}"
        )

    files = {
        str((graph.parent / name).relative_to(bundle_root)): sha256_file(graph.parent / name)
        for name in _graph_files(graph)
    }
    return ModelSpec(
        path=str(graph.relative_to(bundle_root)),
        files=files,
        architecture=(config.architectures or [type(config).__name__])[0],
        model_type=config.model_type,
        num_layers=layers,
        num_kv_heads=int(heads),
        head_dim=int(head_dim),
        vocab_size=int(config.vocab_size),
        max_positions=int(config.max_position_embeddings),
        dtype=dtype,
        io=ModelIO(
            input_ids="input_ids",
            attention_mask="attention_mask" if "attention_mask" in inputs else None,
            position_ids="position_ids" if "position_ids" in inputs else None,
            past_keys=past_keys,
            past_values=past_values,
            logits="logits",
            present_keys=present_keys,
            present_values=present_values,
        ),
        tokenizer_hash=tokenizer_hash,
    )
