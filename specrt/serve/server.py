"""Running the app: uvicorn on 127.0.0.1 by default; SIGTERM or Ctrl-C stops admitting,
lets in-flight requests finish within the deadline, cancels the rest, exits 0."""

from __future__ import annotations

import contextlib
import logging

import uvicorn

from specrt.runtime.config import GenerationConfig
from specrt.runtime.generator import SpeculativeGenerator
from specrt.runtime.service import Service
from specrt.serve.app import create_app

log = logging.getLogger("specrt")


def serve(
    generator: SpeculativeGenerator,
    model_name: str,
    defaults: GenerationConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_waiting: int = 64,
    shutdown_s: float = 30.0,
) -> None:
    """Serve ``generator`` until SIGTERM / SIGINT."""
    service = Service(generator, max_waiting=max_waiting)
    app = create_app(service, model_name, defaults)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        service.close(timeout=shutdown_s)  # uvicorn has stopped accepting connections

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=int(shutdown_s),
    )
    server = _Server(config)
    log.warning("specrt serve: %s on http://%s:%d/v1", model_name, host, port)
    server.run()


class _Server(uvicorn.Server):
    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises a captured signal once it has shut down (exit status -SIGTERM); a
        # shutdown that was asked for and went cleanly exits 0.
        getattr(self, "_captured_signals", []).clear()
