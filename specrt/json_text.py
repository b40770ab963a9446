"""Reading JSON text a user or another program wrote (prompt files, manifests, caches): JSON
that Python's reader cannot hold (nested past its recursion limit, an integer past its digit
limit) is raised as the parse error it is to the reader, not as RecursionError or a bare
ValueError that no caller expects."""

from __future__ import annotations

import json


def loads(text: str | bytes, **options) -> object:
    """`json.loads`, where text Python cannot read raises `json.JSONDecodeError` (``msg``
    saying why) like any malformed text."""
    try:
        return json.loads(text, **options)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply to read", _text(text), 0) from None
    except ValueError as exc:
        if "digits" not in str(exc):
            raise
        raise json.JSONDecodeError("a number too long to read", _text(text), 0) from None


def _text(text: str | bytes) -> str:
    return text if isinstance(text, str) else text.decode("utf-8", "replace")
