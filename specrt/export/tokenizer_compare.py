"""Is the draft's tokenizer the target's? Compared on content, and the first difference named."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specrt.errors import ExportError

# The parts of tokenizer.json that decide which ids a text maps to and back.
COMPONENTS = ("model", "added_tokens", "normalizer", "pre_tokenizer", "post_processor", "decoder")


def load_tokenizer_json(checkpoint_dir: str | Path) -> dict:
    path = Path(checkpoint_dir) / "tokenizer.json"
    if not path.is_file():
        raise ExportError(
            f"{checkpoint_dir} has no tokenizer.json; specrt needs a fast (HF tokenizers) "
            "tokenizer: load it with transformers and `save_pretrained` it into that directory"
        )
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExportError(f"{path} is not valid JSON ({exc})") from exc


def canonical_hash(tokenizer_json: dict) -> str:
    content = {key: tokenizer_json.get(key) for key in COMPONENTS}
    blob = json.dumps(content, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()


def describe_difference(target: dict, draft: dict) -> str | None:
    """None when the tokenizers agree; else one sentence naming the first difference."""
    for key in COMPONENTS:
        a, b = target.get(key), draft.get(key)
        if a == b:
            continue
        if key == "model" and isinstance(a, dict) and isinstance(b, dict):
            return _describe_model_difference(a, b)
        if key == "added_tokens":
            ta = {t["id"]: t["content"] for t in a or []}
            tb = {t["id"]: t["content"] for t in b or []}
            for token_id in sorted(set(ta) | set(tb)):
                if ta.get(token_id) != tb.get(token_id):
                    return (
                        f"special/added token {token_id} is {ta.get(token_id)!r} in the target "
                        f"but {tb.get(token_id)!r} in the draft"
                    )
            return "the added tokens' settings differ"
        return f"the tokenizers' {key} settings differ"
    return None


def _describe_model_difference(a: dict, b: dict) -> str:
    if a.get("type") != b.get("type"):
        return f"tokenizer models differ: target {a.get('type')}, draft {b.get('type')}"
    va, vb = a.get("vocab"), b.get("vocab")
    if va != vb:
        if isinstance(va, dict) and isinstance(vb, dict):
            if len(va) != len(vb):
                return f"vocabulary sizes differ: target {len(va)} tokens, draft {len(vb)} tokens"
            for token, token_id in va.items():
                if vb.get(token) != token_id:
                    return (
                        f"vocabularies differ: token {token!r} has id {token_id} in the target "
                        f"and {vb.get(token)} in the draft"
                    )
        return "vocabularies differ"
    if a.get("merges") != b.get("merges"):
        return "BPE merges differ (same vocabulary, different segmentation)"
    return "tokenizer model settings differ"
