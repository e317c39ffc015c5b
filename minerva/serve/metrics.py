"""Prometheus metrics of one server, named like vLLM's with a `minerva:` prefix.

Each app gets its own registry, so several servers (tests) can live in one process; the
models of one server (`router`) share its registry, each under its `model_name` label.
Gauges and counters are updated by the engine thread after every step; histograms
are observed as requests pass their milestones.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minerva.engine import structured
from minerva.engine.sampler import MAX_SPECULATIVE
from minerva.kernels import native

# Bucket edges in seconds, close to vLLM's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
LONG_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0)


def family(registry: CollectorRegistry, kind, name: str, doc: str, labelnames: list[str], **kw):
    """The metric family `name` of the registry, made on first use (models share a registry)."""
    families = registry.__dict__.setdefault("_minerva_families", {})
    if name not in families:
        families[name] = kind(name, doc, labelnames=labelnames, registry=registry, **kw)
    return families[name]


class Metrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name, doc):
            return family(r, Gauge, f"minerva:{name}", doc, ["model_name"]).labels(**labels)

        def counter(name, doc):
            return family(r, Counter, f"minerva:{name}", doc, ["model_name"]).labels(**labels)

        def histogram(name, doc, buckets):
            return family(r, Histogram, f"minerva:{name}", doc, ["model_name"], buckets=buckets).labels(**labels)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.kv_used_blocks = gauge("kv_cache_used_blocks", "KV-cache blocks in use.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Requests preempted to free KV blocks.")
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive tokens of a request.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.",
                             LONG_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time from arrival to the first step that computes the request.",
                                    LONG_BUCKETS)
        self.spec_drafts = counter("spec_decode_num_drafts", "Request-steps that verified speculative guesses.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative tokens guessed.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Speculative guesses accepted.")
        self.spec_accepted_length = histogram(
            "spec_decode_accepted_length", "Guesses accepted per verifying step.",
            tuple(float(i) for i in range(MAX_SPECULATIVE + 1)))
        # the CPU kernels' thread pool (see kernels/csrc/parallel.h); 0 where they are not used
        self.pool_parallel = counter("cpu_pool_parallel_calls", "Kernel calls split over the CPU threads.")
        self.pool_backed_off = counter("cpu_pool_backed_off_calls",
                                       "Kernel calls run on one thread while backed off from stalling helpers.")
        self.pool_stalls = counter("cpu_pool_stalls", "Kernel calls that waited on a helper thread off its core.")
        self.pool_backoffs = counter("cpu_pool_backoffs", "Times the kernels went to one thread for a while.")
        self.pool_wait = counter("cpu_pool_wait_seconds",
                                 "Seconds kernel calls waited for helper threads after their own share.")
        self.structured_rows = counter("structured_output_rows", "Token choices constrained by a grammar.")
        self.structured_fill = counter("structured_output_mask_fill_seconds",
                                       "Seconds computing grammars' token masks (llguidance).")
        self.structured_apply = counter("structured_output_mask_apply_seconds",
                                        "Seconds applying grammars' token masks to the logits.")
        self.tp_calls = counter("tp_all_reduce_calls", "All-reduces between tensor-parallel ranks.")
        self.tp_seconds = counter("tp_all_reduce_seconds",
                                  "Seconds rank 0 spent in all-reduces, waiting for the other ranks included.")
        self._success = family(r, Counter, "minerva:request_success", "Requests finished, by reason.",
                                ["model_name", "finished_reason"])
        self._labels = labels
        pool = native.pool_stats() or {}  # process-wide, as the structured-output totals below
        self._seen = {"prefix_queries": 0, "prefix_hits": 0, "preemptions": 0, "spec_drafts": 0,
                      "spec_draft_tokens": 0, "spec_accepted_tokens": 0,
                      "pool_parallel": pool.get("parallel_calls", 0), "pool_backed_off": pool.get("backed_off_calls", 0),
                      "pool_stalls": pool.get("stalls", 0), "pool_backoffs": pool.get("backoffs", 0),
                      "pool_wait": pool.get("wait_seconds", 0.0), "tp_calls": 0, "tp_seconds": 0.0,
                      # process-wide totals: counted from what they are when the server starts
                      "structured_rows": structured.STATS.rows, "structured_fill": structured.STATS.fill_seconds,
                      "structured_apply": structured.STATS.apply_seconds}
        self._seen_lengths: list[int] = []

    def finished(self, reason: str) -> None:
        self._success.labels(finished_reason=reason, **self._labels).inc()

    def update_engine(self, engine) -> None:
        """Copy the engine's gauges and advance counters by what its own totals gained."""
        blocks, scheduler = engine.blocks, engine.scheduler
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.kv_usage.set(blocks.usage)
        self.kv_used_blocks.set(blocks.num_used_blocks)
        totals = [("prefix_queries", blocks.prefix_queries), ("prefix_hits", blocks.prefix_hits),
                  ("preemptions", scheduler.num_preemptions)]
        spec = engine.speculator
        if spec is not None:
            s = spec.stats
            totals += [("spec_drafts", s.num_steps), ("spec_draft_tokens", s.num_draft_tokens),
                       ("spec_accepted_tokens", s.num_accepted_tokens)]
            seen = self._seen_lengths + [0] * (len(s.accepted_length) - len(self._seen_lengths))
            for accepted, (now, before) in enumerate(zip(s.accepted_length, seen)):
                for _ in range(now - before):
                    self.spec_accepted_length.observe(accepted)
            self._seen_lengths = list(s.accepted_length)
        pool = native.pool_stats()
        if pool is not None:
            totals += [("pool_parallel", pool["parallel_calls"]), ("pool_backed_off", pool["backed_off_calls"]),
                       ("pool_stalls", pool["stalls"]), ("pool_backoffs", pool["backoffs"]),
                       ("pool_wait", pool["wait_seconds"])]
        totals += [("structured_rows", structured.STATS.rows), ("structured_fill", structured.STATS.fill_seconds),
                   ("structured_apply", structured.STATS.apply_seconds)]
        comm = engine.runner.comm
        if comm is not None:
            totals += [("tp_calls", comm.calls), ("tp_seconds", comm.seconds)]
        for name, total in totals:
            gained = total - self._seen[name]
            if gained > 0:
                getattr(self, name).inc(gained)
            self._seen[name] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
