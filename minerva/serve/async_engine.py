"""The engine on its own thread, feeding per-request asyncio streams.

`Engine` is not thread-safe, so one thread owns it. Request handlers (on the
event loop) send commands through a thread-safe queue; the engine thread applies
them between steps, steps while there is work, blocks on the queue when idle, and
hands each step's deltas to the event loop in one `call_soon_threadsafe` call.
A failure inside a step fails the requests in flight, not the server.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from minerva.engine.request import Request, Status, StreamDelta
from minerva.errors import MinervaError
from minerva.parallel.comm import ParallelError
from minerva.serve.metrics import Metrics

log = logging.getLogger("minerva.serve")


class QueueFull(Exception):
    """More requests are waiting than --max-waiting allows."""


class EngineDead(Exception):
    """The engine thread is not running (shutting down, or it stopped)."""


@dataclass
class Tracked:
    """What the server keeps about one engine request besides the request itself."""

    request: Request
    index: int  # position in its group (choice index)
    sink: "Group"
    scheduled_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_tokens: int = 0


@dataclass
class Group:
    """The engine requests of one HTTP request and the asyncio queue their deltas go to."""

    requests: list[Request]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    tracked: list[Tracked] = field(default_factory=list)
    constraint_field: str | None = None  # the request's field its output constraint came from, for its errors


class AsyncEngine:
    def __init__(self, llm, metrics: Metrics, max_waiting: int = 256, threads: int | None = None):
        self.llm = llm
        self.engine = llm.engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # a burst of decodes ends at the forward in progress when a request or an abort arrives
        self.engine.interrupt = lambda: not self._commands.empty()
        self._live: dict[str, Tracked] = {}  # engine thread only
        self._lock = threading.Lock()
        self._not_started = 0  # requests submitted and not yet scheduled (guarded by _lock)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._threads = threads or torch.get_num_threads()
        self.accepting = False
        # A failure the engine cannot go on after (a tensor-parallel rank that died): the
        # requests in flight fail with it, `fatal` keeps it, and `on_fatal` (set by the
        # server) is called on the event loop to shut the server down.
        self.fatal: BaseException | None = None
        self.on_fatal = None

    # ------------------------------------------------------------ event loop side

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="minerva-engine", daemon=True)
        self._thread.start()
        self.accepting = True
        group = getattr(self.llm, "group", None)
        if group is not None and group.workers:
            threading.Thread(target=self._watch, args=(group,), name="minerva-tp-watch", daemon=True).start()

    def _watch(self, group) -> None:
        """Rank 0's worker processes, twice a second: one that exits ends the server, even idle."""
        while self.alive and not group.closed:
            why = group.check_workers()
            if why is not None:
                self._commands.put(("fatal", ParallelError(why)))
                return
            time.sleep(0.5)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        return len(self._live) + self._commands.qsize()

    @property
    def busy(self) -> bool:
        """Requests submitted and not finished, those on their way to the engine thread included
        (taken off the command queue, not yet in the live set)."""
        with self._lock:
            pending = self._not_started
        return pending > 0 or self.num_unfinished > 0

    def submit(self, requests: list[Request], constraint_field: str | None = None) -> Group:
        """Queue a group of requests (checked already), or raise QueueFull / EngineDead;
        `constraint_field` names the field of their output constraint in its errors."""
        if not self.accepting or not self.alive:
            raise EngineDead("the server is shutting down")
        with self._lock:
            if self._not_started + len(requests) > self.max_waiting:
                raise QueueFull(f"{self._not_started} requests are already waiting "
                                f"(--max-waiting {self.max_waiting})")
            self._not_started += len(requests)
        group = Group(requests, constraint_field=constraint_field)
        self._commands.put(("add", group))
        return group

    def abort(self, group: Group) -> None:
        self._commands.put(("abort", [r.request_id for r in group.requests]))

    async def drain(self, timeout: float, give_up=lambda: False) -> None:
        """Stop taking requests, give those in flight `timeout` seconds to finish, then abort
        the rest: each of their streams ends with finish_reason "abort" (and the server's
        [DONE]) instead of a cut connection. `give_up()` true ends the wait early."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self.num_unfinished and time.monotonic() < deadline and not give_up():
            await asyncio.sleep(0.05)
        if self.num_unfinished and self.alive:
            log.warning("aborting %d requests still running after %.0f s", self.num_unfinished, timeout)
            self._commands.put(("abort all", None))
            deadline = time.monotonic() + 5.0
            while self.num_unfinished and time.monotonic() < deadline:
                await asyncio.sleep(0.02)

    async def stream(self, group: Group) -> AsyncIterator[tuple[Tracked, StreamDelta]]:
        """Deltas of the group's requests until all have finished; aborts them if the consumer
        stops early (a client that went away, a cancelled task)."""
        left = len(group.requests)
        try:
            while left:
                item = await group.queue.get()
                if isinstance(item, BaseException):
                    raise item
                tracked, delta = item
                if delta.finish_reason is not None:
                    left -= 1
                yield tracked, delta
        finally:
            if left:
                self.abort(group)

    def stop(self, timeout: float = 5.0) -> None:
        """Abort whatever is left and join the engine thread."""
        self.accepting = False
        if self._thread is not None:
            self._commands.put(("stop", None))
            self._thread.join(timeout)

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        torch.set_num_threads(self._threads)  # OpenMP's thread count is per calling thread
        engine = self.engine
        while True:
            # Block only when idle; between steps take whatever has arrived.
            try:
                commands = [self._commands.get(block=not engine.has_unfinished())]
            except queue.Empty:
                commands = []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            out: list = []
            stop = False
            for kind, arg in commands:
                if kind == "add":
                    self._add(arg, out)
                elif kind == "abort":
                    for rid in arg:
                        self._abort(rid, out)
                elif kind == "abort all":
                    for rid in list(self._live):
                        self._abort(rid, out)
                elif kind == "fatal":
                    self._fail(arg, out)
                    stop = True
                else:
                    stop = True
            if stop:
                for rid in list(self._live):
                    self._abort(rid, out)
                self._deliver(out)
                self.metrics.update_engine(engine)
                return
            if engine.has_unfinished():
                self._step(out)
            self._deliver(out)
            self.metrics.update_engine(engine)

    def _fail(self, exc: BaseException, out: list) -> None:
        """A fatal failure: the requests in flight end with it, and the server is told to stop."""
        log.error("%s; failing the %d requests in flight and shutting down", exc, len(self._live))
        self.fatal, self.accepting = exc, False
        self._fail_live(RuntimeError(f"the engine failed: {exc}"), out)
        if self.on_fatal is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_fatal)

    def _fail_live(self, error: BaseException, out: list) -> None:
        """Every request in flight ends with `error` (its KV blocks freed)."""
        for rid in list(self._live):
            t = self._remove(rid)
            self.metrics.finished("error")
            out.append((t.sink.queue, error))

    def _add(self, group: Group, out: list) -> None:
        group.tracked = [Tracked(r, i, group) for i, r in enumerate(group.requests)]
        try:
            for t in group.tracked:
                self.engine.add_request(t.request)
                self._live[t.request.request_id] = t
        except Exception as exc:  # noqa: BLE001 - checked before queueing; report, do not die
            self._started(sum(t.request.request_id not in self._live for t in group.tracked))
            for t in group.tracked:
                self._remove(t.request.request_id)
            out.append((group.queue, exc if isinstance(exc, MinervaError) else RuntimeError(str(exc))))

    def _remove(self, rid: str) -> Tracked | None:
        """Take a request out of the engine (its KV blocks freed) and out of the live set."""
        t = self._live.pop(rid, None)
        if t is not None:
            if t.scheduled_time is None:
                self._started(1)
            t.finish_time = time.monotonic()
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - e.g. after a failed step; the request is gone either way
                log.exception("aborting %s failed", rid)
        return t

    def _abort(self, rid: str, out: list) -> None:
        t = self._remove(rid)
        if t is not None:
            self.metrics.finished("abort")
            out.append((t.sink.queue, (t, StreamDelta(rid, "", [], "abort"))))

    def _started(self, n: int) -> None:
        with self._lock:
            self._not_started -= n

    def _step(self, out: list) -> None:
        start = time.monotonic()
        try:
            deltas = self.engine.step()
        except ParallelError as exc:  # the group is broken: fail everything, end the server
            self._fail(exc, out)
            self._commands.put(("stop", None))
            return
        except MinervaError as exc:  # explained (the model's logits came out NaN, ...): no traceback
            log.error("engine step failed: %s; failing the %d requests in flight", exc, len(self._live))
            self._fail_live(RuntimeError(f"the engine failed on this request: {exc}"), out)
            return
        except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep serving
            log.exception("engine step failed; failing the %d requests in flight", len(self._live))
            self._fail_live(RuntimeError(f"the engine failed on this request: {type(exc).__name__}: {exc}"), out)
            return
        now = time.monotonic()
        m = self.metrics
        newly = 0
        for t in self._live.values():
            if t.scheduled_time is None and (t.request.status is not Status.WAITING
                                              or t.request.num_computed_tokens):
                t.scheduled_time = start
                newly += 1
                m.queue_time.observe(start - t.request.arrival_time)
        if newly:
            self._started(newly)
        for d in deltas:
            t = self._live.get(d.request_id)
            if t is None:
                continue
            r = t.request
            if d.token_ids:
                if t.last_token_time is None:
                    m.ttft.observe(now - r.arrival_time)
                    m.prompt_tokens.inc(len(r.prompt_token_ids))
                else:
                    m.itl.observe((now - t.last_token_time) / len(d.token_ids))
                t.last_token_time = now
                t.num_tokens += len(d.token_ids)
                m.generation_tokens.inc(len(d.token_ids))
            if d.finish_reason is not None:
                del self._live[d.request_id]
                t.finish_time = now
                m.e2e.observe(now - r.arrival_time)
                m.finished(d.finish_reason)
            # a request that cannot go on (d.error): its client gets the error, as a 400 or a stream's error event
            failed = MinervaError(d.error, t.sink.constraint_field) if d.error is not None else None
            out.append((t.sink.queue, failed or (t, d)))

    def _deliver(self, out: list) -> None:
        if out and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(_put_all, out)
            except RuntimeError:  # the loop closed in between: nobody is listening
                pass


def on_own_thread(fn, *args):
    """fn(*args) on a short-lived thread; returns its result or raises its exception.

    Model loading and engine steps run their OpenMP kernels from threads other than the main
    one. When a second thread also leads an OpenMP team (say the main thread loaded the model
    and an engine thread then steps it), libgomp counts more managed threads than CPUs and
    switches its workers to very short spinning, which made steps about 15% slower on a 2-core
    machine. Loading on a thread that then exits leaves the engine thread's team the only one.
    """
    box: list = []

    def run():
        try:
            box.append((True, fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box.append((False, exc))

    t = threading.Thread(target=run, name="minerva-worker")
    t.start()
    t.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _put_all(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)
