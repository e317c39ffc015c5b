"""The HTTP side: a FastAPI app with the OpenAI routes, errors in OpenAI's shape, and guards.

`build_app(llm, config)` wires an `AsyncEngine` (the engine's own thread) into one handler
per API family over the shared base of `serving` (`serving_chat`, `serving_completion`,
`serving_embedding`) and the routes here that do not run the model (models, health, metrics,
tokenize, the chat page); what the handlers convert (bodies, results) lives in `convert`.
Every error a client can cause is a 4xx with `{"error": {...}}`; the guard middleware
(`guard`) answers 401 (missing key), 413 (body too large) and 408 (body too slow) before any
route runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST

from minerva.errors import MinervaError
from minerva.serve import anthropic, ollama, responses
from minerva.serve import protocol as P
from minerva.serve import response_bodies as R
from minerva.serve.async_engine import AsyncEngine
from minerva.serve.convert import APIError, clipped
from minerva.serve.guard import error_response, install
from minerva.serve.metrics import Metrics
from minerva.serve.serving import Serving, ServerConfig
from minerva.serve.serving_chat import ChatServing
from minerva.serve.serving_completion import CompletionServing
from minerva.serve.serving_embedding import EmbeddingServing

__all__ = ["ServerConfig", "build_app"]
STATIC = Path(__file__).parent / "static"  # the chat page


ERRORS = {code: {"model": R.ErrorResponse, "description": what} for code, what in [
    (400, "Invalid request: a field out of range, or a prompt beyond the context"),
    (401, "Missing or wrong API key (when the server runs with --api-key)"),
    (404, "Unknown model"),
    (408, "The request head or body took longer than --header-timeout / --body-timeout"),
    (413, "Request body too large"),
    (500, "The model's chat template exceeded its limits, or the engine failed on this request"),
    (503, "Waiting queue full (see Retry-After), too many connections, or shutting down"),
]}



def register_routes(app: FastAPI, *, chat, text, embed, models, model, health, metrics, page, tokenize,
                    detokenize, load, check, pull, keep_alive=None) -> None:
    """Every route of the API on `app`, each answered by the handler given for it (one model's,
    or a server of several's that hands each request to the model it names)."""
    app.post("/v1/chat/completions", response_model=R.ChatCompletionResponse, responses=ERRORS,
             summary="Chat completion (streamed as server-sent events with stream: true)")(chat)
    app.post("/v1/completions", response_model=R.CompletionResponse, responses=ERRORS,
             summary="Text completion (streamed as server-sent events with stream: true)")(text)
    app.post("/v1/embeddings", response_model=R.EmbeddingResponse, responses=ERRORS,
             summary="Embeddings: the final hidden state of each input's last token, L2-normalized")(embed)
    app.get("/v1/models", response_model=R.ModelList, responses={401: ERRORS[401]})(models)

    @functools.wraps(model)  # (its name in the OpenAPI schema)
    async def card(model_id: str):
        if not model_id:  # GET /v1/models/: the list's route with a '/' too many, answered as such (guard)
            raise StarletteHTTPException(404)
        return await model(model_id)

    app.get("/v1/models/{model_id:path}", response_model=R.ModelCard,
            responses={401: ERRORS[401], 404: ERRORS[404]})(card)
    app.get("/health", response_model=R.Health, responses={503: ERRORS[503]})(health)
    app.get("/metrics", response_class=PlainTextResponse,
            summary="Prometheus metrics (minerva:* names, like vLLM's vllm:*)")(metrics)
    app.get("/", response_class=HTMLResponse, include_in_schema=False)(page)
    app.mount("/ui", StaticFiles(directory=STATIC), name="ui")
    app.post("/tokenize", response_model=R.TokenizeResponse, responses=ERRORS)(tokenize)
    app.post("/detokenize", response_model=R.DetokenizeResponse, responses=ERRORS)(detokenize)
    anthropic.register(app, chat, tokenize)
    responses.register(app, chat)
    ollama.register(app, chat=chat, text=text, embed=embed, models=models, model=model, load=load, check=check,
                    pull=pull, keep_alive=keep_alive)


class Routes(Serving):
    """Every route: the handlers' (made over the same model and engine) and those here."""

    def __init__(self, llm, engine: AsyncEngine, metrics: Metrics, config: ServerConfig):
        super().__init__(llm, engine, metrics, config)
        self.chat, self.text, self.embed = (cls(llm, engine, metrics, config)
                                            for cls in (ChatServing, CompletionServing, EmbeddingServing))

    def register(self, app: FastAPI) -> None:
        register_routes(app, chat=self.chat.chat_completions, text=self.text.completions, embed=self.embed.embeddings,
                        models=self.models, model=self.model, health=self.health, metrics=self.prometheus,
                        page=self.page, tokenize=self.tokenize, detokenize=self.detokenize, load=self.load,
                        check=self.readable, pull=self.pull)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        """The engine thread runs while the app does. On shutdown (`minerva serve` drains before
        its connections close, see `server.Server`; this covers other hosts), in-flight requests
        get shutdown_timeout to finish before the rest are aborted."""
        self.engine.start()
        yield
        await self.engine.drain(self.config.shutdown_timeout)
        await asyncio.to_thread(self.engine.stop)

    # -------------------------------------------------------------- routes that do not run the model

    async def models(self):
        return {"object": "list", "data": [self.card(name) for name in (*self.config.names, *self.adapters)]}

    async def model(self, model_id: str):
        self.check_model(model_id)
        return self.card(model_id)

    async def load(self, name: str | None, raw=None) -> None:
        """Ollama's load of the model: it is loaded; a 404 for a name not served, a 503 where the
        engine is not running (as a request for it gets)."""
        self.check_model(name)
        if not self.engine.alive or not self.engine.accepting:
            raise APIError(503, "the engine is not running", type="server_unavailable", headers={"Retry-After": "5"})

    async def readable(self, name: str | None) -> None:
        """/api/show's check that the model can load: it is loaded; a 404 for a name not served."""
        self.check_model(name)

    async def pull(self, name: str) -> None:
        """Ollama's pull: nothing to fetch for a model served; no other can be served here."""
        if name not in (*self.config.names, *self.adapters):
            raise APIError(403, f"this server serves one model, '{self.config.served_model_name}', and does not "
                                f"fetch others; to pull models from a client, start `minerva serve --allow-pull` "
                                f"(or run `minerva pull {clipped(name)}` on the server's machine and serve it)",
                           "model", type="permission_error")

    def card(self, name: str) -> dict:
        adapter = self.llm.adapter_paths.get(name)
        card = {"id": name, "object": "model", "created": self.created, "owned_by": "minerva",
                "root": str(adapter or self.llm.path), "max_model_len": self.max_model_len}
        return card if adapter is None else {**card, "parent": self.config.served_model_name}

    async def page(self):
        """The chat page (static files under /ui, served from the package: it works offline)."""
        return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))

    async def health(self):
        if not self.engine.alive or not self.engine.accepting:
            return error_response(503, "the engine is not running", type="server_unavailable")
        return {"status": "ok"}

    async def prometheus(self):
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, body: P.TokenizeRequest):
        self.check_model(body.model)
        if body.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            ids = await self.encode(await self.chat_prompt(body.messages, body.add_generation_prompt, tools=tools,
                                                           continue_final_message=body.continue_final_message),
                                    "messages")
        else:
            ids = await self.encode(body.prompt, "prompt", body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    async def detokenize(self, body: P.DetokenizeRequest):
        self.check_model(body.model)
        try:
            return {"prompt": self.tokenizer.decode(body.tokens)}
        except MinervaError as exc:  # an id beyond the vocabulary
            where = next((i for i, t in enumerate(body.tokens) if t >= self.tokenizer.vocab_size), None)
            raise APIError(400, str(exc), "tokens" if where is None else f"tokens.{where}") from None


# ------------------------------------------------------------------ the app


def build_app(llm, config: ServerConfig, threads: int | None = None) -> FastAPI:
    """The app serving `llm`; `threads` is the engine thread's CPU thread count (default: the caller's)."""
    metrics = Metrics(config.served_model_name)
    engine = AsyncEngine(llm, metrics, max_waiting=config.max_waiting, threads=threads)
    routes = Routes(llm, engine, metrics, config)
    app = FastAPI(title="Minerva", version="0.1.0", lifespan=routes.lifespan,
                  description="OpenAI-compatible server of the Minerva inference engine.")
    app.state.engine, app.state.metrics, app.state.llm = engine, metrics, llm
    install(app, config, metrics.registry)
    routes.register(app)
    return app
