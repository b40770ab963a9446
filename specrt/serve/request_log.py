"""`specrt serve`'s line per request, as it is queued and as it ends (as vLLM logs them)."""

from __future__ import annotations

import logging
import time

from specrt.openai_shapes import CHAT, COMPLETION
from specrt.runtime.handles import RequestHandle

ROUTES = {COMPLETION: "/v1/completions", CHAT: "/v1/chat/completions"}

log = logging.getLogger("specrt.serve")


def log_received(ident: str, kind: str, handle: RequestHandle, stream: bool) -> None:
    """A request's line as it is queued, as vLLM logs it (its prompt's text left out: it may
    be private)."""
    config = handle.request.config
    log.info(
        "received request %s: %s, %d prompt tokens, max_tokens %d, temperature %g, top_p %g, "
        "top_k %d, seed %s, stream %s",
        ident, ROUTES[kind], len(handle.request.prompt), config.max_new_tokens,
        config.temperature, config.top_p, config.top_k, config.seed, str(stream).lower(),
    )  # fmt: skip


def log_finished(ident: str, handle: RequestHandle) -> None:
    """A request's line as it ends (a done callback, from the service's thread)."""
    seconds = time.perf_counter() - handle.submitted_at
    result = handle._result
    if result is None:  # failed: the service has logged why
        log.warning("request %s failed after %.2f s", ident, seconds)
        return
    log.info(
        "finished request %s: %s, %d completion tokens, %d prompt tokens cached, %.2f s",
        ident, result.finish_reason, len(result.token_ids), result.stats.cached_tokens, seconds,
    )  # fmt: skip
