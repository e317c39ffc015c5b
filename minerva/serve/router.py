"""Several models behind one server (`minerva serve A B C`), as Ollama and llama.cpp's router
mode serve them: a request's `model` field picks one; a model loads on its first request
(the request waits for it) and unloads after `--keep-alive` seconds without requests, or
when another needs its place: `--max-loaded-models`, or the memory the next one needs,
least recently used first. A model with requests in flight is never unloaded; a model that
fails to load fails its requests with the reason and leaves the others serving.

Each loaded model is the single-model server's `Routes` (its own engine thread, handlers
and metrics under its `model_name` label in the one registry); `RouterRoutes` registers the
same API paths and hands each request to the routes of the model it names.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import gc
import logging
import threading
import time
from pathlib import Path
from typing import Awaitable, Callable

import torch
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from minerva.errors import MinervaError
from minerva.serve import ollama_pull
from minerva.serve import protocol as P
from minerva.serve.app import STATIC, Routes, register_routes
from minerva.serve.async_engine import AsyncEngine
from minerva.serve.convert import APIError, clipped
from minerva.serve.guard import ACCESS, error_response, install
from minerva.serve.metrics import Metrics
from minerva.serve.serving import ServerConfig
from minerva.store import resolve

log = logging.getLogger("minerva.serve")


RETRY_FAILED = 30.0  # seconds a model that failed to load answers 503 at once before it is tried again
PULLS_AT_ONCE = 4  # models downloading at once for /api/pull (each on a thread of its own)
WAIT_FOR_ROOM = 120.0  # seconds a request waits for a busy model to make room; then 503


@dataclasses.dataclass
class Served:
    """One model the server can serve: its name, the model argument, and what is loaded."""

    name: str
    model: str
    routes: Routes | None = None
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    last_used: float = 0.0
    active: int = 0  # handler calls in progress (a request not yet handed to the engine)
    load_seconds: float | None = None
    failed: tuple[float, str] | None = None  # when and why its last load failed
    keep_alive: float | None | bool = False  # a request's keep_alive (Ollama's): seconds, None forever; False: the server's
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def busy(self) -> bool:
        return self.active > 0 or (self.routes is not None and self.routes.engine.busy)

    def root(self) -> str:
        """Where the model is: the loaded model's path, else its argument resolved without fetching
        anything (a pulled name's file, a cached repo's), else the argument as given."""
        if self.routes is not None:
            return str(self.routes.llm.path)
        try:
            return str(resolve(self.model, auto_pull=False))
        except (MinervaError, OSError):  # (the model's own requests say why it cannot load)
            return self.model


class Router:
    """The models, loading and unloading them; `load(model)` makes an `LLM` and returns it with
    the CPU thread count it set (it runs on a worker thread)."""

    def __init__(self, models: list[tuple[str, str]], load: Callable, config: ServerConfig, *,
                 keep_alive: float | None = 300.0, max_loaded: int = 3,
                 available: Callable[[], int] | None = None, need: Callable[[str], int] | None = None,
                 check: Callable[[str], object] | None = None, fetch: Callable[[str], object] | None = None,
                 allow_pull: bool = False):
        """`check(model)` (on a worker thread) fetches and reads a model's header before other
        models are unloaded for it: one that cannot load fails without evicting anything.
        `fetch(model)` downloads a model a client pulls (Ollama's /api/pull): one listed, or with
        `allow_pull` (--allow-pull) any built-in model or Hugging Face repo, which then joins the list."""
        self.models = {name: Served(name, model) for name, model in models}
        self.default = models[0][0]
        self.load, self.config, self.keep_alive, self.max_loaded = load, config, keep_alive, max_loaded
        self.available, self.need, self.check, self.fetch = available, need, check, fetch
        self.allow_pull = allow_pull
        self._pulls: dict[str, asyncio.Task] = {}  # a pulled model's canonical name -> its download in progress
        self._aliases: dict[str, str] = {}  # a built-in model's or repo's canonical name -> the name it is served as
        for name, model in models:
            self._alias(name, model)
        self.registry = CollectorRegistry()
        self.loads = Counter("minerva:model_loads", "Models loaded, by name.", ["model_name"], registry=self.registry)
        self.unloads = Counter("minerva:model_unloads", "Models unloaded, by name and why.",
                               ["model_name", "reason"], registry=self.registry)
        self.load_time = Gauge("minerva:model_load_seconds", "Seconds the last load of the model took.",
                               ["model_name"], registry=self.registry)
        self.loaded = Gauge("minerva:model_loaded", "1 while the model is loaded.", ["model_name"],
                            registry=self.registry)
        for name in self.models:
            self.loaded.labels(name).set(0)
        self.fatal = None  # as AsyncEngine's, for the server: a router never fails as a whole
        self.on_fatal = None
        self.accepting = True
        self._room = asyncio.Lock()  # one load (and the unloads making room for it) at a time
        self._reaper: asyncio.Task | None = None
        self._metrics: dict[str, Metrics] = {}

    # ------------------------------------------------------------ finding, loading, unloading

    def _alias(self, name: str, model: str) -> None:
        for spelling in (name, model):
            key = ollama_pull.canonical(spelling)
            if key is not None:
                self._aliases.setdefault(key, name)

    def lookup(self, name: str | None) -> Served | None:
        """The model served as `name` (None: the first), or under another spelling of the same
        built-in model or repo (hf.co/OWNER/REPO:QUANT is OWNER/REPO:QUANT, as `minerva list` names it)."""
        served = self.models.get(self.default if name is None else name)
        if served is None and name is not None and (key := ollama_pull.canonical(name)) in self._aliases:
            served = self.models.get(self._aliases[key])
        return served

    async def found(self, name: str | None) -> Served:
        """`entry(name)`; with --allow-pull, a built-in model or repo not listed but here without
        fetching (pulled as OWNER/REPO before a restart, listed as OWNER/REPO:QUANT) is added first."""
        if (self.lookup(name) is None and self.allow_pull and name is not None
                and ollama_pull.canonical(name) not in self._pulls
                and await asyncio.to_thread(ollama_pull.here, name)):
            self.add(name, name)
        return self.entry(name)

    def entry(self, name: str | None) -> Served:
        served = self.lookup(name)
        if served is None and name is not None and ollama_pull.canonical(name) in self._pulls:
            raise APIError(503, f"the model '{clipped(name)}' is being pulled; try again once the pull is done", "model",
                           type="server_unavailable", headers={"Retry-After": "10"})
        if served is None:
            names = ", ".join(f"'{n}'" for n in self.models)
            raise APIError(404, f"the model '{clipped(name)}' does not exist; this server serves {names} "
                                f"(see /v1/models)", "model")
        return served

    async def call(self, name: str | None, handler: Callable[[Routes], Awaitable], raw: HTTPRequest | None = None):
        """Run `handler` on the routes of the model `name` (None: the first), loading it first
        (the load time goes to the request's access log line)."""
        served = await self.found(name)
        if not self.accepting:
            raise APIError(503, "the server is shutting down", type="server_unavailable")
        served.active += 1
        try:
            routes, loaded = await self.ensure(served)
            if raw is not None and loaded:
                raw.scope.get(ACCESS, {})["load"] = served.load_seconds
            served.last_used = time.monotonic()
            return await handler(routes)
        finally:
            served.active -= 1
            served.last_used = time.monotonic()

    async def ensure(self, served: Served) -> tuple[Routes, bool]:
        """The model's routes, and whether this call loaded it."""
        async with served.lock:
            if served.routes is not None and served.routes.engine.alive:
                return served.routes, False
            self._failed_lately(served)
            async with self._room:
                if served.routes is not None:  # its engine stopped (a fatal error): load it afresh
                    await self.unload(served, "failed")
                start = time.monotonic()
                try:
                    if self.check is not None:
                        await asyncio.to_thread(self.check, served.model)
                    await self._make_room(served)
                    if not self.accepting:
                        raise APIError(503, "the server is shutting down", type="server_unavailable")
                    llm, threads = await asyncio.to_thread(self.load, served.model)
                except APIError:
                    raise
                except Exception as exc:  # the reason goes to this request; the other models keep serving
                    raise self._failed(served, exc) from None
                served.failed = None
                served.load_seconds = time.monotonic() - start
                metrics = self._metrics[served.name] = Metrics(served.name, registry=self.registry)
                engine = AsyncEngine(llm, metrics, max_waiting=self.config.max_waiting, threads=threads)
                config = dataclasses.replace(self.config, served_model_name=served.name, aliases=())
                served.routes = Routes(llm, engine, metrics, config)
                engine.start()
                self.loads.labels(served.name).inc()
                self.load_time.labels(served.name).set(served.load_seconds)
                self.loaded.labels(served.name).set(1)
                log.info("loaded %s (%s) in %.2f s", served.name, llm.path.name, served.load_seconds)
                return served.routes, True

    def add(self, name: str, model: str) -> Served:
        """The model `model` served as `name` from now on (a pulled one); the one listed already if so."""
        served = self.lookup(name)
        if served is None:
            served = self.models[name] = Served(name, model)
            self._alias(name, model)
            self.loaded.labels(name).set(0)
            log.info("added %s", name)
        return served

    def pull(self, name: str, model: str) -> asyncio.Task:
        """`model` downloaded (`fetch`, on a thread of its own that a shutdown does not wait for) and
        served as `name` once it is here; one download per name, however many clients ask. The task
        goes on when the client that asked leaves: the download is not lost."""
        key = ollama_pull.canonical(name) or name
        task = self._pulls.get(key)
        if task is None and len(self._pulls) >= PULLS_AT_ONCE:
            raise APIError(503, f"{len(self._pulls)} models are being pulled, as many as this server pulls at once; "
                                "try again when one is done", "model", type="server_unavailable",
                           headers={"Retry-After": "10"})
        if task is None:
            async def fetched():
                await in_daemon_thread(lambda: self.fetch(model))
                self.add(name, model)
            task = self._pulls[key] = asyncio.get_running_loop().create_task(fetched())
            task.add_done_callback(lambda t: self._pulled(key, name, t))
        return task

    def _pulled(self, key: str, name: str, task: asyncio.Task) -> None:
        self._pulls.pop(key, None)
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            log.warning("could not pull %s: %s", name, exc)

    async def readable(self, name: str) -> None:
        """Whether the model `name`, a file or folder here, can load, found without loading it (its
        header read): a 503 naming why not, as its requests get. A name or repo is not fetched for it."""
        served = self.entry(name)
        if served.routes is not None or self.check is None or not Path(served.model).expanduser().exists():
            return
        self._failed_lately(served)
        try:
            await asyncio.to_thread(self.check, served.model)
        except Exception as exc:
            raise self._failed(served, exc) from None

    @staticmethod
    def _failed_lately(served: Served) -> None:
        """A 503 at once for a model whose load failed less than RETRY_FAILED seconds ago."""
        if served.failed is not None and time.monotonic() - served.failed[0] < RETRY_FAILED:
            raise APIError(503, f"the model '{served.name}' could not be loaded: {served.failed[1]}", "model",
                           type="model_load_error", headers={"Retry-After": str(int(RETRY_FAILED))})

    @staticmethod
    def _failed(served: Served, exc: Exception) -> APIError:
        """The 503 of a model that could not load, kept as why its next requests fail."""
        served.failed = (time.monotonic(), str(exc))
        log.warning("could not load %s: %s", served.name, exc)
        return APIError(503, f"the model '{served.name}' could not be loaded: {exc}", "model", type="model_load_error")

    async def _make_room(self, served: Served) -> None:
        """Unload idle models, least recently used first, until one more fits: in number, and
        in the memory the next one needs (when known); wait for a busy one at most WAIT_FOR_ROOM."""
        need = self.need(served.model) if self.need else 0
        deadline = time.monotonic() + WAIT_FOR_ROOM
        while True:
            loaded = [s for s in self.models.values() if s.routes is not None and s is not served]
            short = len(loaded) >= self.max_loaded or (need and self.available and self.available() < need)
            if not short:
                return
            idle = sorted((s for s in loaded if not s.busy), key=lambda s: s.last_used)
            if idle:
                await self.unload(idle[0], "room")
                continue
            if len(loaded) < self.max_loaded:
                return  # memory looks short, but nothing can go: try the load
            if time.monotonic() > deadline or not self.accepting:
                raise APIError(503, f"every loaded model is busy (--max-loaded-models {self.max_loaded}); "
                                    "try again shortly", type="server_unavailable", headers={"Retry-After": "5"})
            await asyncio.sleep(0.05)

    async def unload(self, served: Served, reason: str) -> None:
        routes, served.routes = served.routes, None
        if routes is None:
            return
        await routes.engine.drain(0)
        await asyncio.to_thread(routes.engine.stop)
        del routes
        gc.collect()
        _trim()
        self.unloads.labels(served.name, reason).inc()
        self.loaded.labels(served.name).set(0)
        metrics = self._metrics.get(served.name)
        if metrics is not None:
            metrics.running.set(0)
            metrics.waiting.set(0)
        log.info("unloaded %s (%s)", served.name, reason)

    def kept(self, served: Served) -> float | None:
        """How long the model stays loaded once idle: its last request's keep_alive, else the server's."""
        return self.keep_alive if served.keep_alive is False else served.keep_alive

    def hold(self, name: str, seconds: float | None | bool) -> None:
        """A request's keep_alive for the model `name` (Ollama's; False: the server's): it applies from then on."""
        served = self.lookup(name)
        if served is not None:  # (else the request's own lookup says why not, or adds it)
            served.keep_alive = seconds

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for served in list(self.models.values()):  # (a pull may add one meanwhile)
                if served.busy:  # a stream in flight: the idle time counts from its end
                    served.last_used = now
                elif (served.routes is not None and (keep := self.kept(served)) is not None
                      and not served.lock.locked() and not self._room.locked() and now - served.last_used > keep):
                    try:
                        await self.unload(served, "idle")
                    except Exception:  # keep reaping the others
                        log.exception("unloading %s failed", served.name)

    # ------------------------------------------------------------ the server's life

    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def drain(self, timeout: float, give_up=None) -> None:
        """What `Server.shutdown` calls: no new requests; every loaded model's in-flight ones get `timeout`."""
        self.accepting = False
        if self._reaper is not None:
            self._reaper.cancel()
        await asyncio.gather(*(s.routes.engine.drain(timeout, give_up=give_up)
                               for s in self.models.values() if s.routes is not None))

    async def stop(self) -> None:
        for served in list(self.models.values()):
            if served.routes is not None:
                await asyncio.to_thread(served.routes.engine.stop)


def named(body, routes: Routes):
    """The request as the model's routes take it: `model` the name it is served as (a request may
    name it by another spelling of the same repo)."""
    if getattr(body, "model", None) is not None:
        body.model = routes.config.served_model_name
    return body


def in_daemon_thread(fn: Callable[[], object]) -> asyncio.Future:
    """`fn()` on a daemon thread, as a future of the running loop: a download an exiting server
    need not wait for (asyncio.to_thread's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, exc) -> None:
        if not future.done():
            future.set_exception(exc) if exc is not None else future.set_result(result)

    def run() -> None:
        try:
            result, exc = fn(), None
        except BaseException as e:  # handed to the future's awaiter
            result, exc = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=run, daemon=True, name="minerva-pull").start()
    return future


def _trim() -> None:
    """Give freed memory back: the GPU's cached blocks, and the heap (glibc keeps it otherwise)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class RouterRoutes:
    """The API paths, each handing its request to the routes of the model it names."""

    def __init__(self, router: Router):
        self.router = router

    def register(self, app: FastAPI) -> None:
        register_routes(app, chat=self.chat_completions, text=self.completions, embed=self.embeddings,
                        models=self.models, model=self.model, health=self.health, metrics=self.prometheus,
                        page=self.page, tokenize=self.tokenize, detokenize=self.detokenize, load=self.load,
                        check=self.router.readable, pull=self.pull, keep_alive=self.router.hold)

    async def chat_completions(self, body: P.ChatCompletionRequest, raw: HTTPRequest) -> Response:
        return await self.router.call(body.model, lambda r: r.chat.chat_completions(named(body, r), raw), raw)

    async def completions(self, body: P.CompletionRequest, raw: HTTPRequest) -> Response:
        return await self.router.call(body.model, lambda r: r.text.completions(named(body, r), raw), raw)

    async def embeddings(self, body: P.EmbeddingRequest, raw: HTTPRequest):
        return await self.router.call(body.model, lambda r: r.embed.embeddings(named(body, r), raw), raw)

    async def tokenize(self, body: P.TokenizeRequest):
        return await self.router.call(body.model, lambda r: r.tokenize(named(body, r)))

    async def detokenize(self, body: P.DetokenizeRequest):
        return await self.router.call(body.model, lambda r: r.detokenize(named(body, r)))

    async def load(self, name: str, raw: HTTPRequest | None = None) -> None:
        """The model `name` loaded, as a request for it loads it (Ollama's load)."""
        await self.router.call(name, lambda r: r.load(r.config.served_model_name), raw)

    async def pull(self, name: str) -> asyncio.Task | None:
        """Ollama's pull of `name`: what of a listed model is missing fetched (nothing for a file or
        folder), or, with --allow-pull, a built-in model or Hugging Face repo fetched and added."""
        served = self.router.lookup(name)
        if served is not None and ollama_pull.is_path(served.model):
            return None
        if served is None and not self.router.allow_pull:
            raise APIError(403, f"this server does not fetch models for its clients: it serves "
                                f"{', '.join(repr(n) for n in self.router.models)}; start it with --allow-pull, or "
                                f"run `minerva pull {clipped(name)}` on its machine and serve the model",
                           "model", type="permission_error")
        if self.router.fetch is None:
            return None
        if served is None:
            ollama_pull.pullable(name)
            return self.router.pull(name, name)
        return self.router.pull(served.name, served.model)

    def card(self, served: Served) -> dict:
        routes = served.routes
        return {"id": served.name, "object": "model", "created": served.created, "owned_by": "minerva",
                "root": served.root(),
                "max_model_len": routes.max_model_len if routes else None, "loaded": routes is not None}

    async def models(self):
        return {"object": "list", "data": [self.card(s) for s in self.router.models.values()]}

    async def model(self, model_id: str):
        return self.card(await self.router.found(model_id))

    async def page(self):
        return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))

    async def health(self):
        if not self.router.accepting:
            return error_response(503, "the server is shutting down", type="server_unavailable")
        return {"status": "ok"}

    async def prometheus(self):
        return Response(generate_latest(self.router.registry), media_type=CONTENT_TYPE_LATEST)


def build_router_app(router: Router, config: ServerConfig) -> FastAPI:
    """The app serving the router's models (what `build_app` is for one model)."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        router.start()
        yield
        await router.drain(config.shutdown_timeout)
        await router.stop()

    app = FastAPI(title="Minerva", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server of the Minerva inference engine.")
    app.state.engine = router  # what the server drains on shutdown
    install(app, config, router.registry)
    RouterRoutes(router).register(app)
    return app
