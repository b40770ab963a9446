"""Running the app: uvicorn on 127.0.0.1 by default; SIGTERM or Ctrl-C stops admitting,
lets in-flight requests finish within the deadline, cancels the rest, exits 0."""

from __future__ import annotations

import contextlib
import copy
import errno
import logging
import socket
import sys

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from specrt.errors import InvalidInputError
from specrt.runtime.config import GenerationConfig
from specrt.runtime.generator import SpeculativeGenerator
from specrt.runtime.service import Service
from specrt.serve.app import create_app

log = logging.getLogger("specrt.serve")
LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def configure_logging(level: str = "info") -> logging.Logger:
    """specrt's log lines (the start, a line per request) to stdout at ``level``
    and above, as vLLM writes its own (the ready line with the address is printed whatever the
    level); errors that end the process stay on stderr (the command's). Returns the server's
    logger."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, "%m-%d %H:%M:%S"))
    root = logging.getLogger("specrt")
    root.handlers = [handler]
    root.setLevel(level.upper())
    root.propagate = False  # not twice where the root logger has a handler too
    return log


def _uvicorn_logging() -> dict:
    """uvicorn's own logging, its lines on stdout beside specrt's (it writes all but the
    access lines to stderr)."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["default"]["stream"] = "ext://sys.stdout"
    return config


_BIND_ADVICE = {
    errno.EADDRINUSE: "another process listens there: stop it, or choose another --port",
    errno.EACCES: "ports below 1024 need root: choose another --port",
    errno.EADDRNOTAVAIL: "not an address of this machine: use 127.0.0.1 or 0.0.0.0",
}


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not listening yet: connections are refused until the
    server starts). Bound before the bundle loads, which takes minutes for large engines, so
    a taken port or a bad host fails at once, in one line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidInputError(
            f"cannot listen on {host}:{port}: {exc.strerror}; give --host an address of this "
            "machine (127.0.0.1, 0.0.0.0)"
        ) from exc
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        advice = _BIND_ADVICE.get(exc.errno, "choose another --host or --port")
        raise InvalidInputError(
            f"cannot listen on {host}:{port}: {exc.strerror} ({advice})"
        ) from exc
    return sock


def serve(
    generator: SpeculativeGenerator,
    model_name: str,
    defaults: GenerationConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_waiting: int = 64,
    shutdown_s: float = 30.0,
    sock: socket.socket | None = None,
    api_key: str | None = None,
    log_level: str = "info",
    tool_parser: str | None = None,
    chat_template: str | None = None,
    scheduling_policy: str = "fcfs",
) -> None:
    """Serve ``generator`` until SIGTERM / SIGINT, on ``sock`` (from `listen`) or on a socket
    bound to ``host:port`` now; with ``api_key``, the /v1 routes want it as a bearer token.
    ``log_level``: uvicorn's (`configure_logging` sets specrt's); ``tool_parser``: the format
    ``tool_choice: "auto"`` reads calls in (None: refused); ``chat_template``: the one chats
    render with, in place of the bundle's (a Jinja file, or the template itself);
    ``scheduling_policy``: `Service`'s."""
    sock = sock or listen(host, port)
    service = Service(generator, max_waiting=max_waiting, scheduling_policy=scheduling_policy)
    app = create_app(service, model_name, defaults, api_key, tool_parser, chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        service.close(timeout=shutdown_s)  # uvicorn has stopped accepting connections

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        log_config=_uvicorn_logging(),
        timeout_graceful_shutdown=int(shutdown_s),
    )
    server = _Server(config)
    port = sock.getsockname()[1]  # --port 0: the one the system chose
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address, as a URL writes it
    server.ready_line = f"specrt serve: {model_name} on http://{shown}:{port}/v1"
    server.run(sockets=[sock])


class _Server(uvicorn.Server):
    ready_line = ""

    async def startup(self, sockets=None) -> None:
        # Said once the socket listens and SIGTERM is ours (a supervisor that reads the line
        # and stops the server at once must see a clean exit, not a signal's death).
        await super().startup(sockets)
        if self.started:  # whatever the log level: a client of --port 0 needs the address
            print(self.ready_line, flush=True)

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises a captured signal once it has shut down (exit status -SIGTERM); a
        # shutdown that was asked for and went cleanly exits 0.
        getattr(self, "_captured_signals", []).clear()
