"""Loading a bundle: check its manifest, files and pair, open both models' decoders."""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specrt.backends import (
    DEFAULT_MAX_LENGTH,
    ENGINE_CHOICES,
    Decoder,
    RowsDecoder,
    open_decoder,
)
from specrt.backends.base import one_call_against_one_each
from specrt.backends.eagle import EagleDraft
from specrt.backends.session import (
    GPU_PROVIDERS,
    default_providers,
    provider_names,
    usable_providers,
)
from specrt.bundle import (
    MANIFEST_NAME,
    ONNXRUNTIME_ENGINE,
    Manifest,
    bundle_path,
    read_manifest,
)
from specrt.checksums import verify_checksums
from specrt.errors import BundleError, InvalidInputError, PairMismatchError
from specrt.runtime.corpus import CORPUS_FILE, CorpusTable
from specrt.runtime.tokenizer import BundleTokenizer
from specrt.validation import flag, integer

log = logging.getLogger("specrt")

MAX_THREADS_PER_CPU = 4  # threads a CPU takes at most (`load_pair`, the CLI's --threads)


@dataclass
class ModelPair:
    """What a bundle loads into: the target's and the draft's decoders and the tokenizer."""

    target: Decoder
    draft: Decoder
    tokenizer: BundleTokenizer
    eos_token_ids: list[int]
    corpus: CorpusTable | None = None  # the bundle's, where it has one (`specrt corpus`)


def load_pair(
    bundle_dir: str | Path,
    threads: int | None = None,
    providers: Sequence[str | tuple[str, dict]] | None = None,
    check_files: bool = True,
    draft_threads: int = 1,
    engine: str = "auto",
    max_length: int | None = DEFAULT_MAX_LENGTH,
    max_batch: int = 1,
    corpus: bool = True,
) -> ModelPair:
    """Load a bundle by its manifest; with ``check_files`` every file's sha256 is verified.

    ``threads``: the target's intra-op threads (default: all cores). ``draft_threads``: the
    draft's (default 1: see `specrt.backends.session` for why). ``providers``: onnxruntime's,
    first choice first (default: CUDA where available, else CPU). ``engine``: ``"auto"`` runs
    each model's engine for the provider where the bundle has one (the CPU engine on CPU, the
    cuda engine on CUDA), else its portable graph; ``"portable"``, ``"onnxruntime"``, ``"cuda"``
    or ``"tensorrt"`` insist on one (see `specrt.backends.select`). ``max_length``: the longest
    sequence (prompt + new tokens) the engines' preallocated KV caches hold, at most the
    model's max positions (None: the model's). ``max_batch``: rows the engines run per call
    (their caches hold that many sequences: the onnxruntime and cuda engines and the portable
    graph; the TensorRT engines and Gemma 2's cuda engine run one row). ``corpus``: load the
    bundle's corpus table where it has one (`specrt corpus`), which prompt lookup and the
    hybrid then draft from where a row's own text has no match."""
    if max_length is not None:
        max_length = integer("max_length", max_length, 2, rule="use an integer >= 2, or None")
    # onnxruntime starts every thread: thousands asked for by mistake hang the session's start
    cpus = os.cpu_count() or 1
    most = MAX_THREADS_PER_CPU * cpus
    machine = f"this machine has {cpus} CPUs; one a CPU is usually fastest"
    if threads is not None:
        rule = f"use 1 to {most} ({machine}), or None: all of them"
        threads = integer("threads", threads, 1, most, rule=rule)
    rule = f"use 1 to {most} ({machine})"
    draft_threads = integer("draft_threads", draft_threads, 1, most, rule=rule)
    max_batch = integer("max_batch", max_batch, 1, rule="use an integer >= 1")
    flag("check_files", check_files)
    flag("corpus", corpus)
    if engine not in ENGINE_CHOICES:
        raise InvalidInputError(f"engine={engine!r}: use one of {', '.join(ENGINE_CHOICES)}")
    providers = check_providers(providers)
    if not isinstance(bundle_dir, (str, os.PathLike)):
        raise InvalidInputError(
            f"bundle_dir={bundle_dir!r}: give the bundle directory's path (a str or Path)"
        )
    root = bundle_path(bundle_dir)
    options = dict(
        engine=engine,
        providers=providers,
        check_files=check_files,
        threads=threads,
        draft_threads=draft_threads,
        max_length=max_length,
        max_batch=max_batch,
        corpus=corpus,
    )
    try:
        return _load_once_more(root, options)
    except BundleError as exc:  # the engines' rebuild commands name this bundle
        if "--bundle DIR" not in str(exc):
            raise
        named = str(exc).replace("--bundle DIR", f"--bundle {shlex.quote(str(root))}")
        raise type(exc)(named) from exc


def _load_once_more(root: Path, options: dict) -> ModelPair:
    before = _manifest_bytes(root)
    try:
        return _load(root, **options)
    except (BundleError, OSError):
        # A concurrent re-export swaps the whole bundle at once; a load that read across the
        # swap (the old manifest, the new files) is done again, once, on the new bundle.
        if before is None or _manifest_bytes(root) in (None, before):
            raise
        log.warning("the bundle %s changed while it was loading (re-exported?): loaded again", root)
        return _load(root, **options)


def _load(
    root: Path,
    check_files: bool,
    threads,
    draft_threads,
    max_length,
    max_batch,
    corpus: bool,
    **select,
) -> ModelPair:
    manifest = read_manifest(root)
    if check_files:
        verify_checksums(manifest, root)
    check_pair(manifest)
    check_memory(manifest, max_length, max_batch, select.get("providers"))
    decoders = {
        role: open_decoder(
            root,
            spec,
            role,
            manifest.vocab_size,
            threads=draft_threads if role == "draft" else threads,
            max_length=max_length,
            max_batch=max_batch,
            **select,
        )
        for role, spec in manifest.models.items()
    }
    for decoder in decoders.values():
        check_cache_dtype(decoder)
    check_exact_rows(decoders["target"])
    warn_rounded_rows(manifest, decoders["target"], root)
    if manifest.models["draft"].eagle_head:
        decoders["draft"] = eagle_draft(decoders["draft"], decoders["target"])
    tokenizer = BundleTokenizer(root / manifest.tokenizer.path, manifest.tokenizer)
    table = None
    if corpus and os.path.lexists(root / CORPUS_FILE):  # a folder there is no table: said so
        table = CorpusTable.load(root / CORPUS_FILE, manifest.tokenizer.sha256, manifest.vocab_size)
    return ModelPair(
        decoders["target"], decoders["draft"], tokenizer, manifest.tokenizer.eos_token_ids, table
    )


EXACT_ROWS_TOKENS = 4  # positions verified in one call, then decoded one call each


def check_exact_rows(target: Decoder) -> None:
    """Refuse a quantised target whose verification would not compute what decoding alone does
    on this CPU: whether a position verified among others gets the bits of the same position
    decoded alone depends on the CPU's kernels (docs/cli.md), and the export measured the CPU
    it ran on, not this one. Where the graph can run without the copy that makes every count
    even (`BatchedDecoder.pair_rows`), it runs so if that is exact here: a one-position step
    then computes one row. Measured as the export does, on a few arbitrary tokens (tens of
    milliseconds for a small model), the cache left empty."""
    if getattr(target.spec, "block_size", None) is None:
        return  # float weights: the export's check (`warn_rounded_rows`)
    if getattr(target, "can_unpair_rows", False):
        target.pair_rows(False)
        if not rows_difference(target):
            return
        target.pair_rows(True)
    difference = rows_difference(target)
    if difference:
        raise BundleError(
            "the bundle's quantised target engine computes a position verified among others "
            f"otherwise than the same position decoded alone on this CPU (logits differ by "
            f"{difference:.1e}), so speculative output would not be its own output alone: "
            "rebuild it with this specrt (`specrt build --bundle DIR --target-precision int4`, "
            "or int8 as it was) or use a float32 target (`--target-precision float32`)"
        )


def rows_difference(target: Decoder) -> float:
    """The largest difference between positions verified in one call (2, 3 and 4 of them: odd
    counts and even) and the same positions decoded one call each; the cache left empty."""
    rng = np.random.default_rng(0)
    difference = 0.0
    for count in range(2, EXACT_ROWS_TOKENS + 1):
        ids = rng.integers(0, target.vocab_size, EXACT_ROWS_TOKENS + count).tolist()
        target.reset()
        target.prefill(ids[:EXACT_ROWS_TOKENS])
        difference = max(difference, one_call_against_one_each(target, ids[EXACT_ROWS_TOKENS:])[1])
    target.reset()
    return difference


def warn_rounded_rows(manifest: Manifest, target: Decoder, root: Path) -> None:
    """Say so where the target runs a float32 CPU engine whose verification the export found
    within rounding of decoding alone, not bit for bit (an engine built before its attention
    computed two query rows): its output may part from the target alone's at a near tie, and a
    rebuild makes it exact. Read from the manifest: nothing is run."""
    engine = manifest.models["target"].engines.get(ONNXRUNTIME_ENGINE)
    if engine is None or engine.path != target.spec.path or engine.precision != "float32":
        return
    difference = engine.export_check.get("step_vs_one_at_a_time_max_abs_diff")
    if difference:
        log.warning(
            "the bundle's float32 target engine verifies a position within %.1e of decoding it "
            "alone, not bit for bit (built by an older specrt): rebuild it with `specrt build "
            "--bundle %s` to make speculative output exactly the target alone's",
            difference,
            shlex.quote(str(root)),
        )


def eagle_draft(head: Decoder, target: Decoder) -> EagleDraft:
    """The head drafting from the target's features; both must be decoders of rows (the
    batched engines, or the portable graphs)."""
    if not (isinstance(head, RowsDecoder) and isinstance(target, RowsDecoder)):
        raise BundleError(
            "the bundle's draft is an EAGLE head, which runs on the batched onnxruntime "
            "engines (CPU or cuda) or the portable graphs, not on TensorRT plans: load it "
            "without engine='tensorrt'"
        )
    return EagleDraft(head, target)


# How onnxruntime names the element types a manifest's dtype stands for.
ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)"}


def check_cache_dtype(decoder: Decoder) -> None:
    """Refuse a graph whose KV cache is not of the manifest's dtype: the decoder would feed it
    caches of the wrong type, and onnxruntime fail on the first call."""
    session, spec = getattr(decoder, "session", None), getattr(decoder, "spec", None)
    if not isinstance(session, ort.InferenceSession) or spec is None:
        return  # a TensorRT plan: checked by its own loader
    types = {value.name: value.type for value in (*session.get_inputs(), *session.get_outputs())}
    io = spec.io
    for name in (*io.past_keys, *io.past_values, *io.present_keys, *io.present_values):
        found = types.get(name)
        if found is not None and found != ORT_TYPES[spec.dtype]:
            graph = {v: k for k, v in ORT_TYPES.items()}.get(found, found)
            raise BundleError(
                f"{decoder.role}: the manifest says {spec.path} is {spec.dtype}, but that "
                f"graph's KV cache ({name}) is {graph}; the manifest and the graph come from "
                "different exports: re-export the bundle"
            )


def check_memory(
    manifest: Manifest,
    max_length: int | None,
    max_batch: int,
    providers: Sequence[str | tuple[str, dict]] | None,
) -> None:
    """Refuse a ``max_batch`` whose rows' KV caches (float32, on the CPU) could grow past this
    machine's memory: the kernel would kill the process without a word, at load or later."""
    if set(provider_names(providers or default_providers())) & set(GPU_PROVIDERS):
        return  # the caches live on the GPU
    per_row = 0
    for spec in manifest.models.values():
        positions = min(max_length or spec.max_positions, spec.max_positions)
        per_row += 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * positions * 4
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if max_batch * per_row > memory:
        raise InvalidInputError(
            f"max_batch={max_batch}: that many rows' KV caches grow to "
            f"{max_batch * per_row / 2**30:.1f} GiB ({per_row / 2**20:.1f} MiB a row at "
            f"{positions} positions), more than this machine's {memory / 2**30:.1f} GiB; "
            f"give at most {memory // per_row} rows, or a shorter max_length"
        )


def _manifest_bytes(root: Path) -> bytes | None:
    try:
        return (root / MANIFEST_NAME).read_bytes()
    except OSError:
        return None


def check_providers(providers: Sequence[str | tuple[str, dict]] | None) -> list | None:
    """The onnxruntime providers asked for (names, or (name, options) pairs as onnxruntime
    takes them), each one this onnxruntime has."""
    if providers is None:
        return None
    listed = isinstance(providers, Sequence) and not isinstance(providers, str)
    if not listed or not providers or not all(map(_is_provider, providers)):
        raise InvalidInputError(
            f'providers={providers!r}: give a list of provider names, e.g. ["CPUExecutionProvider"]'
            " (or (name, options) pairs)"
        )
    names = provider_names(providers)
    available = ort.get_available_providers()
    unknown = [p for p in names if p not in available]
    if unknown:
        raise InvalidInputError(
            f"provider(s) {unknown} are not available in this onnxruntime (it has "
            f"{', '.join(available)}); install onnxruntime-gpu for CUDA"
        )
    no_gpu = [p for p in names if p not in usable_providers(available)]
    if no_gpu:
        raise InvalidInputError(
            f"provider(s) {no_gpu}: no NVIDIA GPU is visible here (the CUDA driver shows none; "
            "see CUDA_VISIBLE_DEVICES); use CPUExecutionProvider, or leave providers unset"
        )
    return list(providers)


def _is_provider(entry: object) -> bool:
    """A provider's name, or a (name, options) pair."""
    if isinstance(entry, tuple) and len(entry) == 2:
        return isinstance(entry[0], str) and isinstance(entry[1], dict)
    return isinstance(entry, str)


def check_pair(manifest: Manifest) -> None:
    """Refuse a bundle whose draft and target were exported with different tokenizers (the
    vocabulary widths are checked by `read_manifest`)."""
    target, draft = manifest.models["target"], manifest.models["draft"]
    if target.tokenizer_hash != draft.tokenizer_hash:
        raise PairMismatchError(
            "draft and target were exported with different tokenizers (hash "
            f"{draft.tokenizer_hash[:12]} vs {target.tokenizer_hash[:12]}); a draft must share the "
            "target's tokenizer: pick a draft from the same model family and re-export"
        )
