"""`minerva serve`: the app under uvicorn, with a startup line that says what is served where."""

from __future__ import annotations

import asyncio
import errno
import math
import logging
import resource
import socket
import sys
import time

import uvicorn

from minerva.errors import MinervaError
from minerva.serve.app import ServerConfig, build_app
from minerva.serve.connections import http_protocol
from minerva.serve.registry import local_url, registered
from minerva.serve.router import build_router_app

# After the drain, how long uvicorn waits for clients to read the ends of their responses.
CLOSE_GRACE = 5.0


class Server(uvicorn.Server):
    """uvicorn's server with Minerva's shutdown (SIGTERM, SIGINT).

    uvicorn alone waits for open connections and then cancels their tasks: a stream in flight
    ends with a cut connection and a CancelledError traceback. Here the listening sockets close
    first, the engine then drains (in-flight requests get --shutdown-timeout to finish, the rest
    end with finish_reason "abort" and [DONE]), and only then does uvicorn close connections.
    The process exits 0: a shutdown asked for by a signal is a clean exit, so the signal is not
    raised again after it (what uvicorn does by default).
    """

    def __init__(self, config: uvicorn.Config, drain_timeout: float):
        super().__init__(config)
        self.drain_timeout = drain_timeout

    async def startup(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(quiet_accept_errors())
        await super().startup(sockets)

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:
            server.close()  # no new connections while draining
        engine = self.config.app.state.engine
        await engine.drain(self.drain_timeout, give_up=lambda: self.force_exit)
        await super().shutdown(sockets)
        self._captured_signals.clear()  # read by uvicorn's capture_signals after this returns


def describe(llm, config: ServerConfig, url: str) -> str:
    e = llm.engine
    blocks, size = e.blocks.num_blocks, e.blocks.block_size
    cache = e.cache
    names = " and ".join(repr(n) for n in config.names)
    layout = cache.layout
    tables = "" if layout.num_groups == 1 else (
        f", {layout.num_groups} block tables of {layout.num_pools} layers, "
        f"{sum(w is not None for w in layout.group_windows)} of them sliding-window")
    return (f"serving {llm.path.name} as {names} on {llm.device} ({str(llm.dtype)[6:]}); "
            f"KV cache {blocks} blocks x {size} tokens{tables} "
            f"({cache.nbytes / 1e6:.0f} MB, k={cache.formats['k']} v={cache.formats['v']}), "
            f"max model length {e.max_model_len}; at most {config.max_waiting} requests waiting; "
            f"OpenAI API at {url}/v1")


def make_server(app, config: ServerConfig, log_level: str = "info", **options) -> Server:
    """The uvicorn server `minerva serve` runs `app` with (the tests run the same one): the HTTP
    protocol with its request-head deadline and connection cap (see `connections`), keep-alive,
    and the drain on shutdown."""
    return Server(uvicorn.Config(app, log_level=log_level, access_log=False, timeout_keep_alive=5,
                                 http=http_protocol(config.header_timeout, connection_cap(config.max_connections)),
                                 timeout_graceful_shutdown=CLOSE_GRACE, **options),
                  drain_timeout=config.shutdown_timeout)


def quiet_accept_errors():
    """An event-loop exception handler that logs accept() running out of file descriptors at
    most once in 10 s, without a traceback (asyncio retries and logs each failure, thousands a
    second), and passes anything else to asyncio's own handler."""
    last = [-math.inf]

    def handler(loop, context: dict) -> None:
        if "out of system resource" not in str(context.get("message", "")):
            loop.default_exception_handler(context)
        elif time.monotonic() - last[0] > 10:
            last[0] = time.monotonic()
            logging.getLogger("minerva.serve").warning(
                "cannot accept connections: %s (the open-files limit, ulimit -n; see --max-connections)",
                context.get("exception"))
    return handler


# File descriptors kept for the process's own files, pipes and threads beside its connections.
RESERVED_FILES = 128


def connection_cap(requested: int) -> int:
    """--max-connections within the open-files limit (its soft limit raised to the hard one
    first): past it accept() fails before the cap's 503 can answer, and asyncio retries it in
    a loop that logs each failure and starves every other request."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or requested <= soft - RESERVED_FILES:
        return requested
    cap = max(1, soft - RESERVED_FILES)
    logging.getLogger("minerva.serve").warning(
        "--max-connections %d lowered to %d: the open-files limit (ulimit -n) is %d", requested, cap, soft)
    return cap


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use is one clear error at
    once, not a traceback after a long load."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise MinervaError(f"--host {host!r} is not an address of this machine: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart may rebind at once
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise MinervaError(f"port {port} on {host} is already in use (another server?); stop it or pick "
                               f"another with --port") from None
        raise MinervaError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def serve(llm, config: ServerConfig, sock: socket.socket, threads: int | None = None,
          log_level: str = "info") -> None:
    """Serve `llm` on the bound socket `sock` (see `bind`) until a signal or a fatal engine error."""
    run(build_app(llm, config, threads=threads), config, sock, lambda url: describe(llm, config, url), log_level)


def serve_models(router, config: ServerConfig, sock: socket.socket, log_level: str = "info") -> None:
    """Serve the models of `router` (`minerva serve A B ...`), each loaded on its first request."""
    names = ", ".join(repr(n) for n in router.models)
    keep = "until stopped" if router.keep_alive is None else f"{router.keep_alive:g} s after their last request"
    pulls = " (clients may pull more: Ollama's /api/pull)" if router.allow_pull else ""
    run(build_router_app(router, config), config, sock,
        lambda url: (f"serving {names}, each loaded on its first request and kept {keep}, at most "
                     f"{router.max_loaded} at once{pulls}; OpenAI API at {url}/v1"), log_level)


def run(app, config: ServerConfig, sock: socket.socket, line, log_level: str) -> None:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(message)s")
    print(line(f"http://{shown}:{port}"), file=sys.stderr, flush=True)
    server = make_server(app, config, log_level=log_level)
    engine = app.state.engine
    engine.on_fatal = lambda: setattr(server, "should_exit", True)
    with registered(local_url(host, port), config.served_model_name):
        server.run(sockets=[sock])
    if engine.fatal is not None:  # e.g. a tensor-parallel rank died: the requests failed, exit non-zero
        raise MinervaError(f"the server stopped: {engine.fatal}")
