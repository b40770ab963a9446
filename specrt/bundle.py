"""The bundle contract: ``manifest.json`` and the files it names.

A bundle is a directory::

    manifest.json        this module's Manifest, as JSON
    target/model.onnx    (+ external data files, all listed with their sha256)
    draft/model.onnx
    */onnxruntime/       optional engine graphs (`ModelSpec.engines`), same contract
    tokenizer/           tokenizer.json and its config (HF tokenizers format)

Every stage reads and writes bundles only through this module; the runtime trusts the manifest and
never guesses input names or shapes. This module imports nothing beyond the standard library.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from specrt import json_text
from specrt.errors import BundleError
from specrt.staging import recover

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
ROLES = ("target", "draft")
# The architecture of a draft that is an EAGLE-3 head (config.architectures, its authors' name).
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
ONNXRUNTIME_ENGINE = "onnxruntime"  # the key of the onnxruntime CPU engine in ModelSpec.engines
CUDA_ENGINE = "cuda"  # the key of the fp16 onnxruntime engine for the CUDA provider
CORPUS_FILE = "corpus/ngrams.npz"  # `specrt corpus`'s table (`specrt.runtime.corpus`)


@dataclass
class ModelIO:
    """ONNX input/output names of one decoder graph, layer by layer."""

    input_ids: str
    attention_mask: str | None
    position_ids: str | None
    past_keys: list[str]
    past_values: list[str]
    logits: str
    present_keys: list[str]
    present_values: list[str]
    # In-place cache graphs take the valid lengths as numbers (GroupQueryAttention's inputs).
    seqlens_k: str | None = None
    total_length: str | None = None
    probabilities: str | None = None  # softmax of the logits, where the graph computes it
    # The trailing positions that get logits, where the graph can keep fewer than all: their
    # count n (engines of earlier releases), or -n, the start of their slice (engines now).
    logits_to_keep: str | None = None
    logits_start: str | None = None
    argmax: str | None = None  # each kept row's best token, where the graph computes it
    max_logit: str | None = None  # and that token's logit (NaN/inf checks without the logits)
    max_probability: str | None = None  # and its probability (the draft's confidence)
    # Batched cache graphs: where each new token's k and v go, (row, position) pairs.
    cache_indices: str | None = None
    # Batched graphs with local and global layers: the local (sliding-window) layers' mask.
    local_attention_mask: str | None = None
    # Batched graphs that attend by each row's length, not under the mask: the keys each row
    # holds after the call (its length + the tokens fed, padding included).
    kv_lengths: str | None = None
    # A target exported with an EAGLE head: the head's input features at every position fed.
    features: str | None = None
    # An EAGLE head: the features it drafts from (input), its hidden states (output).
    hidden_states: str | None = None
    hidden_out: str | None = None


@dataclass
class EngineSpec:
    """A backend-specific graph of the same model (e.g. ORT contrib ops), checked like the
    portable one. ``cache``: ``"concat"`` (present = past + new, fed back each call),
    ``"in_place"`` (past and present are one preallocated buffer of ``max_positions``; the valid
    length is fed as ``io.seqlens_k`` / ``io.total_length``; one row per call when more than one
    token is fed) or ``"batched"`` (one buffer ``[rows, positions, kv_heads * head_dim]``; each
    row's positions, cache indices and attention mask are fed: any rows, any tokens per call)."""

    path: str
    files: dict[str, str]
    io: ModelIO
    vocab_size: int
    cache: str = "in_place"
    precision: str = "float32"  # of the weights: float32, float16, int8, int4
    block_size: int | None = None  # a quantised target's: how many weights share a scale
    # Every call computes an even number of positions (a quantised target in blocks of 64 or
    # more): a call of an odd count costs what the next even count does.
    even_rows: bool = False
    export_check: dict[str, float | None] = field(default_factory=dict)
    provider: str = "CPUExecutionProvider"  # the onnxruntime provider it is built for
    dtype: str = "float32"  # of its activations and KV cache
    built_for: dict[str, str] = field(default_factory=dict)  # a TensorRT plan's GPU and version
    # Attention sees only the last ``sliding_window`` positions (Mistral; in models with local
    # and global layers, the local ones): a batched engine's host writes it into the mask
    # (``io.local_attention_mask`` where the graph has one). None: every position.
    sliding_window: int | None = None
    # Positions it is exact for, where fewer than the model's (longrope: its rotary table
    # changes past original_max_position_embeddings). None: the model's max_positions.
    max_positions: int | None = None


@dataclass
class ModelSpec:
    """One exported model (target or draft) as the runtime needs to know it."""

    path: str  # ONNX file, relative to the bundle root
    files: dict[str, str]  # every file of the model (graph + external data) -> sha256
    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # width of the model's logits (may include embedding padding)
    max_positions: int
    dtype: str  # "float32" or "float16"
    io: ModelIO
    tokenizer_hash: str = ""  # canonical hash of the tokenizer the model was trained with
    export_check: dict[str, float | None] = field(default_factory=dict)
    source: str = ""  # the checkpoint directory it was exported from
    source_sha256: str = ""  # of that checkpoint's config and weights, at export
    cache: str = "concat"
    engines: dict[str, EngineSpec] = field(default_factory=dict)
    sliding_window: int | None = None  # see EngineSpec; the portable graph applies its own
    even_rows: bool = False  # see EngineSpec
    block_size: int | None = None  # a quantised target engine's (EngineSpec): views only

    @property
    def eagle_head(self) -> bool:
        """Whether this model is an EAGLE-3 head (it drafts from the target's features)."""
        return self.architecture == EAGLE3_ARCHITECTURE

    def engine_view(self, name: str) -> ModelSpec:
        """This model as seen through engine ``name``'s graph (its path, files, I/O, cache)."""
        engine = self.engines[name]
        return replace(
            self,
            path=engine.path,
            files=engine.files,
            io=engine.io,
            vocab_size=engine.vocab_size,
            cache=engine.cache,
            dtype=engine.dtype,
            sliding_window=engine.sliding_window,
            even_rows=engine.even_rows,
            block_size=engine.block_size,
            max_positions=engine.max_positions or self.max_positions,
            export_check=engine.export_check,
            engines={},
        )

    def all_files(self) -> dict[str, str]:
        files = dict(self.files)
        for engine in self.engines.values():
            files.update(engine.files)
        return files


@dataclass
class TokenizerSpec:
    path: str  # directory relative to the bundle root
    sha256: str  # of tokenizer.json
    vocab_size: int  # with added tokens
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None = None


@dataclass
class Manifest:
    models: dict[str, ModelSpec]
    tokenizer: TokenizerSpec
    vocab_size: int  # logits are cut to this width: shared by draft and target
    schema_version: int = SCHEMA_VERSION
    specrt_version: str = ""

    def to_dict(self) -> dict:
        """As written to manifest.json: without the fields a graph has only where it differs
        from the default (a quantised target's ``block_size``, ``even_rows``), nor a model's
        ``even_rows`` and ``block_size`` (its engines say), so that older readers take the
        bundles they can run."""
        data = asdict(self)
        for model in data["models"].values():
            model.pop("even_rows", None)
            model.pop("block_size", None)
            for engine in model["engines"].values():
                for name, default in (("block_size", None), ("even_rows", False)):
                    if engine.get(name) == default:
                        engine.pop(name)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        """The manifest of ``data`` (parsed JSON), every field checked for its type: a wrong
        one is named in the error."""
        return _decode(cls, data, "manifest")


def _decode(cls: type, data: object, where: str):
    """Build dataclass ``cls`` from JSON ``data``, checking each field against its type hint."""
    if not isinstance(data, dict):
        raise _malformed(where, f"is {_kind(data)}, not an object")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise _malformed(where, f"has unknown field(s) {unknown[:3]}")
    values = {}
    for f in fields(cls):
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise _malformed(f"{where}.{f.name}", "is missing")
            continue
        values[f.name] = _value(data[f.name], hints[f.name], f"{where}.{f.name}")
    return cls(**values)


def _value(value: object, hint: object, where: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):  # X | None
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _value(value, hint, where)
    if origin is list:
        if not isinstance(value, list):
            raise _malformed(where, f"is {_kind(value)}, not a list")
        return [_value(item, args[0], f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _malformed(where, f"is {_kind(value)}, not an object")
        return {key: _value(item, args[1], f"{where}.{key}") for key, item in value.items()}
    if dataclasses.is_dataclass(hint):
        return _decode(hint, value, where)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        shown = "" if value is None else f" {value!r:.40}"
        raise _malformed(where, f"is {_kind(value)}{shown}, not {_kind_name(hint)}")
    return value


def _malformed(where: str, problem: str) -> BundleError:
    return BundleError(
        f"manifest.json is malformed: {where} {problem}; re-export the bundle with `specrt export`"
    )


def _kind(value: object) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def _kind_name(hint: type) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        hint, hint.__name__
    )


def write_manifest(bundle_dir: str | Path, manifest: Manifest) -> Path:
    path = Path(bundle_dir) / MANIFEST_NAME
    # allow_nan=False: NaN and Infinity are not JSON, and other languages' parsers refuse them
    path.write_text(
        json.dumps(manifest.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"
    )
    return path


def is_bundle(directory: Path) -> bool:
    """Whether ``directory`` holds a specrt manifest (of any schema version)."""
    try:
        data = json_text.loads((directory / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"schema_version", "models", "tokenizer"} <= set(data)


def bundle_path(bundle_dir: str | Path) -> Path:
    """``bundle_dir`` as a Path; an empty string refused (`Path("")` is the working dir)."""
    if isinstance(bundle_dir, str) and not bundle_dir.strip():
        raise BundleError("the bundle path is empty: give the bundle's directory")
    if "\0" in str(bundle_dir):  # no file system takes one; Python's own error names nothing
        raise BundleError(f"the bundle path {str(bundle_dir)!r} holds a NUL character")
    return Path(bundle_dir)


def read_manifest(bundle_dir: str | Path) -> Manifest:
    """Read and structurally validate a bundle's manifest (no file hashing)."""
    root = bundle_path(bundle_dir)
    recover(root)  # a swap killed halfway leaves the bundle parked beside it
    if root.exists() and not root.is_dir():
        raise BundleError(
            f"{str(root)!r} is a file, not a bundle directory; pass the directory that holds "
            f"{MANIFEST_NAME}"
        )
    if not root.is_dir():
        raise BundleError(
            f"bundle directory {str(root)!r} does not exist; build it with "
            "`specrt export --target DIR --draft DIR --out DIR` or `make engines`"
        )
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise BundleError(
            f"{str(root)!r} is not a bundle: it has no {MANIFEST_NAME}; "
            "re-export it with `specrt export` (an interrupted export leaves no manifest)"
        )
    manifest = parse_manifest(path.read_bytes(), path)
    validate_manifest(manifest, root)
    return manifest


def parse_manifest(content: bytes, path: Path) -> Manifest:
    """The manifest in ``content`` (the bytes of ``path``), its schema version and types checked."""
    try:
        # NaN and Infinity are not JSON: refused like any other parse error
        data = json_text.loads(content.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path} is not valid JSON ({exc}); re-export the bundle") from exc
    if not isinstance(data, dict):
        raise BundleError(f"{path} does not hold a JSON object; re-export the bundle")
    version = data.get("schema_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise BundleError(
            f"{path} has schema_version {version}, written by a newer specrt; this one reads "
            f"{SCHEMA_VERSION}: upgrade specrt (pip install -U specrt)"
        )
    if not isinstance(version, int) or isinstance(version, bool):
        raise BundleError(
            f"{path} has schema_version {json.dumps(version)}, not an integer (this specrt "
            f"reads {SCHEMA_VERSION}); re-export the bundle with this version of specrt"
        )
    if version != SCHEMA_VERSION:
        raise BundleError(
            f"{path} has schema_version {version!r}, this specrt reads {SCHEMA_VERSION}; "
            "re-export the bundle with this version of specrt"
        )
    return Manifest.from_dict(data)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")


def validate_manifest(manifest: Manifest, root: Path) -> None:
    """Ranges and cross-references the types cannot say; every file named must be there."""
    missing_roles = [r for r in ROLES if r not in manifest.models]
    extra_roles = [r for r in manifest.models if r not in ROLES]
    if missing_roles or extra_roles:
        raise BundleError(
            f"manifest in {root} has models {sorted(manifest.models)}, not {list(ROLES)}; "
            "re-export it"
        )
    _at_least("manifest.vocab_size", manifest.vocab_size, 1)
    tokenizer = manifest.tokenizer
    _at_least("tokenizer.vocab_size", tokenizer.vocab_size, 1)
    special = [("eos_token_ids", t) for t in tokenizer.eos_token_ids]
    special += [("bos_token_id", tokenizer.bos_token_id), ("pad_token_id", tokenizer.pad_token_id)]
    for name, token in special:
        if token is not None and not 0 <= token < manifest.vocab_size:
            _range_error(f"tokenizer.{name}", token, f"a token id in [0, {manifest.vocab_size})")
    _check_relative("tokenizer.path", tokenizer.path)
    for role in ROLES:
        spec = manifest.models[role]
        for name, view in [("", spec)] + [(n, spec.engine_view(n)) for n in spec.engines]:
            label = f"models.{role}" + (f".engines.{name}" if name else "")
            _validate_view(label, view, manifest.vocab_size)
        for rel in spec.all_files():
            if not (root / rel).is_file():
                raise BundleError(
                    f"{role}: file {rel!r} named in the manifest is missing from {root}; "
                    "the bundle is incomplete, re-export or re-copy it"
                )
    tok = root / manifest.tokenizer.path / "tokenizer.json"
    if not tok.is_file():
        raise BundleError(f"tokenizer file {tok} is missing; re-export or re-copy the bundle")
    if manifest.tokenizer.vocab_size > manifest.vocab_size:
        raise BundleError(
            f"tokenizer has {manifest.tokenizer.vocab_size} tokens but logits are cut to "
            f"{manifest.vocab_size}; re-export the bundle"
        )


CACHE_KINDS = ("concat", "in_place", "batched")
DTYPES = ("float32", "float16")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        _range_error(name, value, f"an integer >= {low}")


def _range_error(name: str, value: object, rule: str) -> None:
    raise BundleError(
        f"manifest.json is malformed: {name} is {value!r}, it must be {rule}; re-export the bundle"
    )


def _check_relative(name: str, rel: str) -> None:
    """Every path in a manifest stays inside the bundle."""
    path = Path(rel)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        _range_error(name, rel, "a path inside the bundle")


def _validate_view(label: str, spec: ModelSpec, vocab_size: int) -> None:
    for name, low in (("num_layers", 1), ("num_kv_heads", 1), ("head_dim", 1), ("vocab_size", 1)):
        _at_least(f"{label}.{name}", getattr(spec, name), low)
    _at_least(f"{label}.max_positions", spec.max_positions, 2)
    if spec.sliding_window is not None:
        _at_least(f"{label}.sliding_window", spec.sliding_window, 1)
    if spec.dtype not in DTYPES:
        _range_error(f"{label}.dtype", spec.dtype, f"one of {DTYPES}")
    if not spec.files:
        _range_error(f"{label}.files", spec.files, "the graph's files with their sha256")
    if spec.path not in spec.files:
        _range_error(f"{label}.path", spec.path, "one of the files listed (each is verified)")
    for rel in spec.files:
        _check_relative(f"{label}.files", rel)
    io, n = spec.io, spec.num_layers
    lengths = {len(io.past_keys), len(io.past_values), len(io.present_keys), len(io.present_values)}
    if lengths != {n}:
        raise BundleError(
            f"{label}: manifest lists {sorted(lengths)} cache names for {n} layers; re-export it"
        )
    if vocab_size > spec.vocab_size:
        raise BundleError(
            f"{label}: shared vocab_size {vocab_size} exceeds the model's logits width "
            f"{spec.vocab_size}; re-export the bundle"
        )
    if spec.cache not in CACHE_KINDS:
        raise BundleError(
            f"{label}: cache kind {spec.cache!r} is unknown to this specrt (knows {CACHE_KINDS}); "
            "re-export the bundle with this version"
        )
