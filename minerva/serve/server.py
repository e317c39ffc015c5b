"""`minerva serve`: the app under uvicorn, with a startup line that says what is served where."""

from __future__ import annotations

import logging
import sys

from minerva.serve.app import ServerConfig, build_app
from minerva.serve.connections import http_protocol


def describe(llm, config: ServerConfig, url: str) -> str:
    e = llm.engine
    blocks, size = e.blocks.num_blocks, e.blocks.block_size
    cache = e.cache
    return (f"serving {llm.path.name} as '{config.served_model_name}' on {llm.device} ({str(llm.dtype)[6:]}); "
            f"KV cache {blocks} blocks x {size} tokens = {blocks * size} tokens "
            f"({cache.nbytes / 1e6:.0f} MB, k={cache.k_format} v={cache.v_format}), "
            f"max model length {e.max_model_len}; at most {config.max_waiting} requests waiting; "
            f"OpenAI API at {url}/v1")


def uvicorn_options(config: ServerConfig) -> dict:
    """The uvicorn settings `config` implies: the HTTP protocol with its header deadline and
    connection cap (see `connections`), keep-alive and the graceful-shutdown wait."""
    return dict(http=http_protocol(config.header_timeout, config.max_connections), timeout_keep_alive=5,
                timeout_graceful_shutdown=config.shutdown_timeout or None)


def serve(llm, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          threads: int | None = None) -> None:
    import uvicorn

    app = build_app(llm, config, threads=threads)
    shown = f"[{host}]" if ":" in host else host
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    print(describe(llm, config, f"http://{shown}:{port}"), file=sys.stderr, flush=True)
    # uvicorn stops accepting on SIGTERM/SIGINT and waits shutdown_timeout for open requests;
    # the app's lifespan then aborts what is left and joins the engine thread.
    uvicorn.run(app, host=host, port=port, log_level="info", access_log=False, **uvicorn_options(config))
