"""The step loop: schedule -> execute -> update, over a paged KV pool shared by all requests."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minerva.engine.block_manager import BlockManager
from minerva.engine.output import OutputProcessor
from minerva.engine.request import Request, StreamDelta
from minerva.engine.runner import ModelRunner
from minerva.engine.sampler import new_state
from minerva.engine.scheduler import Scheduler, SchedulerConfig
from minerva.engine.speculative import build_speculator, check_speculative, parse_method
from minerva.engine.structured import Grammars
from minerva.errors import MinervaError
from minerva.formats.tokenizer import Tokenizer
from minerva.kernels import dispatch
from minerva.kernels.attention import PagedKVCache
from minerva.kernels.kv_layout import KVLayout, kv_layout, single
from minerva.models.config import SLIDING
from minerva.models.causal_lm import CausalLM
from minerva.models.fit import available_memory, step_bytes
from minerva.models.loader import LoadedModel

log = logging.getLogger("minerva")

# Of the memory beside the weights and a step's activations, what a KV pool sized to fit
# takes (by default, and for one request of --max-model-len): a tenth stays spare.
FIT = 0.9


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    # bytes if > 1, else a fraction of the memory available now; None: sized to fit (FIT of
    # it). At most what max_num_seqs requests of the whole context can fill; pages untouched
    # until a block is first used.
    kv_cache_memory: float | None = None
    # the cached blocks of finished requests kept before never-used ones are taken: bytes if
    # > 1, else a fraction of the memory available now; at most a quarter of the pool
    prefix_cache_memory: float = 0.05
    kv_cache_dtype_k: str = "auto"
    kv_cache_dtype_v: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # while someone waits on a token (a stream, a prompt waiting to start), a step's prompt
    # chunks take about this long at the measured speed of a row; 0: the whole token budget
    prefill_chunk_seconds: float = 0.25
    enable_prefix_caching: bool = True
    # sliding-window layers give back the blocks behind their window (minerva/kernels/kv_layout.py)
    hybrid_kv_cache: bool = True
    speculative: str | None = None  # ngram | self[:LAYERS] | draft:MODEL (see engine/speculative.py)
    num_speculative_tokens: int = 3  # guesses per step
    speculative_max_batch: int = 4  # more running requests than this: no guesses this step
    # forwards a step of decodes may run in a row while nothing waits to start (a burst of at
    # most ~0.1 s: minerva/engine/scheduler.py, `_burst`); 1 = one token a step. Not with
    # --speculative.
    decode_steps: int = 8
    # prompt + output tokens a request may reach (--max-model-len, -c / --ctx-size): the
    # model's context, or less; the KV pool is sized for it
    max_model_len: int | None = None

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise MinervaError(f"--block-size must be an integer >= 1, got {self.block_size!r}")
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise MinervaError(f"--kv-cache-memory must be > 0 (bytes, or a fraction <= 1 of free memory), "
                               f"got {self.kv_cache_memory!r}")
        if not self.prefix_cache_memory >= 0:
            raise MinervaError(f"--prefix-cache-memory must be >= 0 (bytes, or a fraction <= 1 of free memory), "
                               f"got {self.prefix_cache_memory!r}")
        # checks them before the KV pool is sized
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, decode_steps=self.decode_steps,
                        chunk_seconds=self.prefill_chunk_seconds)
        if self.speculative:
            check_speculative(self.speculative, self.num_speculative_tokens, self.speculative_max_batch)
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise MinervaError(f"--max-model-len must be an integer >= 2 (prompt and output tokens), "
                               f"got {self.max_model_len!r}")

    def context(self, model_config) -> int:
        """The tokens a request may reach: the model's context, or --max-model-len when it is
        less (more is an error naming both)."""
        ctx = model_config.max_position
        if self.max_model_len is None:
            return ctx
        if self.max_model_len > ctx:
            raise MinervaError(f"--max-model-len {self.max_model_len} is more than the model's context of {ctx} "
                               f"tokens; give at most {ctx}")
        return self.max_model_len

    @property
    def draft_model(self) -> str | None:
        """The model of `--speculative draft:MODEL`, for the caller to load."""
        if not self.speculative:
            return None
        kind, arg = parse_method(self.speculative)
        return arg if kind == "draft" else None


def pool_blocks(mc, config: EngineConfig, dtype: torch.dtype, device: torch.device,
                ranks: int = 1) -> tuple[KVLayout, int, int]:
    """The layout, bytes per block and number of blocks of the KV pool for a model of config
    `mc`: `--kv-cache-memory` bytes, or its fraction of the memory available beyond the
    activations of the largest step (by default FIT of it, shared by `ranks` processes of
    tensor parallelism), then at most what `max_num_seqs` requests of the whole context can
    fill; with --max-model-len, at least one request of it (`one_request`)."""
    layout = layout_of(mc, config)
    per_block = PagedKVCache.bytes_per_block(layout.num_pools, config.block_size, mc.num_kv_heads,
                                             mc.head_dim, config.kv_cache_dtype_k,
                                             config.kv_cache_dtype_v, dtype)
    budget = config.kv_cache_memory
    if budget is None or budget <= 1:
        room = available_memory(device) - step_bytes(mc, config.max_num_batched_tokens)
        per_seq = layout.blocks_for(config.context(mc), config.block_size, config.max_num_batched_tokens)
        share = FIT / ranks if budget is None else budget
        blocks = min(int(share * max(room, 0) // per_block), config.max_num_seqs * per_seq)
        if config.max_model_len is not None and blocks < per_seq:  # a context asked for: one request of it
            blocks = one_request(layout, per_block, per_seq, room, config, device)
        return layout, per_block, blocks
    have = available_memory(device)
    if budget > have:
        raise MinervaError(f"--kv-cache-memory {budget / 1e9:.2f} GB is more than the {have / 1e9:.2f} GB "
                           f"of memory available on {device}; give less (or a fraction of it, e.g. 0.2)")
    return layout, per_block, int(budget // per_block)


def one_request(layout: KVLayout, per_block: int, per_seq: int, room: int, config: EngineConfig,
                device: torch.device) -> int:
    """The blocks of one request of the whole --max-model-len, when they fit in `room` with
    a tenth of it to spare (llama.cpp's --fit); else a refusal with the numbers."""
    if per_seq * per_block <= FIT * room:
        return per_seq
    fits = layout.max_tokens(int(FIT * max(room, 0) // per_block), config.block_size, config.max_num_batched_tokens,
                             config.max_model_len)
    raise MinervaError(f"--max-model-len {config.max_model_len} needs {per_seq * per_block / 1e9:.2f} GB of KV cache "
                       f"for one request, and {room / 1e9:.2f} GB of memory is available on {device} beside the "
                       f"weights; give --max-model-len {fits} or less, a smaller --kv-cache-dtype, or free memory")


def kv_cache(model: CausalLM, config: EngineConfig, device: torch.device, dtype: torch.dtype,
             comm=None) -> PagedKVCache:
    """The paged KV pool for `model` within the budget of `config`. Under tensor parallelism
    (`comm`) rank 0 sizes it and every rank allocates as many blocks for its own KV heads,
    since one block table addresses them all."""
    mc = model.config
    num_blocks = 0
    if comm is None or comm.rank == 0:
        layout, per_block, num_blocks = pool_blocks(mc, config, dtype, device, 1 if comm is None else comm.world)
    else:
        layout, per_block = layout_of(mc, config), 0
    if comm is not None:
        num_blocks = int(comm.broadcast(torch.tensor([num_blocks]) if comm.rank == 0 else None)[0])
    if num_blocks < 1:
        budget = "the memory available" if config.kv_cache_memory is None else f"a KV budget of {config.kv_cache_memory}"
        raise MinervaError(f"{budget} on {device} holds no KV block of {config.block_size} tokens ({per_block} bytes "
                           "each); lower --block-size, raise --kv-cache-memory or free memory")
    return PagedKVCache(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads,
                        mc.head_dim, k_format=config.kv_cache_dtype_k,
                        v_format=config.kv_cache_dtype_v, dtype=dtype, device=device, layout=layout)


def cache_blocks(config: EngineConfig, cache: PagedKVCache, device: torch.device) -> int:
    """The cached blocks of finished requests kept before never-used ones are taken:
    --prefix-cache-memory (bytes, or its fraction of the memory available), at most a
    quarter of the pool."""
    budget = config.prefix_cache_memory
    if budget <= 1:
        budget *= available_memory(device)
    return min(cache.num_blocks // 4, int(budget // (cache.nbytes // cache.num_blocks)))


def layout_of(mc, config: EngineConfig) -> KVLayout:
    """Which layers of a model of config `mc` share a block table: with `hybrid_kv_cache`,
    each sliding-window kind apart from the global layers (see minerva/kernels/kv_layout.py);
    else one table for all."""
    if not config.hybrid_kv_cache:
        return single(mc.num_layers)
    return kv_layout([mc.sliding_window if t == SLIDING else None for t in mc.layer_types], config.context(mc))


class Engine:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, config: EngineConfig,
                 device: torch.device, dtype: torch.dtype, model_id: str, draft: LoadedModel | None = None,
                 comm=None, adapters=None):
        """`draft`: the loaded draft model of `--speculative draft:MODEL`; `comm`: under tensor
        parallelism, rank 0's Comm (each forward is broadcast to the other ranks); `adapters`:
        the LoRA adapters attached to `model` (minerva.models.lora.Adapters)."""
        self.adapters = adapters
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.device = device
        mc = model.config
        if tokenizer.vocab_size > mc.vocab_size:
            log.warning("the model's tokenizer has %d tokens and its embedding %d rows; a prompt that holds one of "
                        "the last %d tokens will be refused", tokenizer.vocab_size, mc.vocab_size,
                        tokenizer.vocab_size - mc.vocab_size)
        self.cache = kv_cache(model, config, device, dtype, comm)
        num_blocks = self.cache.num_blocks
        self.blocks = BlockManager(num_blocks, config.block_size,
                                   enable_prefix_caching=config.enable_prefix_caching,
                                   salt=model_id.encode(), layout=self.cache.layout,
                                   step_tokens=config.max_num_batched_tokens,
                                   cache_blocks=cache_blocks(config, self.cache, device))
        self.max_model_len = self.cache.layout.max_tokens(num_blocks, config.block_size,
                                                          config.max_num_batched_tokens, config.context(mc))
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len,
                                                   1 if config.speculative else config.decode_steps,
                                                   config.prefill_chunk_seconds), self.blocks)
        self.runner = ModelRunner(model, self.cache, device, comm)
        self.runner.adapters = adapters
        self.speculator = None
        if config.speculative:
            self.speculator = build_speculator(config.speculative, config.num_speculative_tokens,
                                               config.speculative_max_batch, model, tokenizer,
                                               self.cache.token_blocks,
                                               config.block_size, dtype, device, draft, comm)
        self.requests: dict[str, Request] = {}
        self.grammars = Grammars(tokenizer, mc.vocab_size)
        # true when a burst of decodes should end early (the server: a request arrived)
        self.interrupt: Callable[[], bool] | None = None

    # ------------------------------------------------------------ requests

    def check(self, request: Request) -> None:
        """Reject up front a request that could never run."""
        n, vocab = len(request.prompt_token_ids), self.model.config.vocab_size
        if n == 0:
            raise MinervaError("the prompt is empty after tokenization; give at least one token")
        stray = next((t for t in request.prompt_token_ids if not 0 <= t < vocab), None)
        if stray is not None and 0 <= stray < self.tokenizer.vocab_size:  # the model's files disagree
            text = self.tokenizer.decode([stray], skip_special_tokens=False)
            raise MinervaError(f"the prompt holds token {text!r} (id {stray}), which the model's tokenizer has and "
                               f"its embedding of {vocab} rows lacks: the model's tokenizer and weights do not "
                               "match; leave that text out, or fix the model")
        if stray is not None:
            raise MinervaError(f"prompt token id {stray} is out of range: token ids must be in [0, {vocab})")
        bad = [t for t in request.params.logit_bias if t >= vocab]
        if bad:
            raise MinervaError(f"logit_bias names token id {bad[0]}, beyond the vocabulary of {vocab}", "logit_bias")
        bad = [t for t in request.params.stop_token_ids if t >= vocab]
        if bad:  # (a stop on a token the model cannot sample would never stop it: a mistaken id)
            raise MinervaError(f"stop_token_ids names token id {bad[0]}, beyond the vocabulary of {vocab}",
                               "stop_token_ids")
        if request.params.adapter is not None:
            if self.adapters is None:
                raise MinervaError(f"the request asks for the LoRA adapter '{request.params.adapter}', and none "
                                   "is loaded; load adapters with --lora NAME=PATH (LLM(lora={NAME: PATH}))")
            request.adapter = self.adapters.index(request.params.adapter)
        if request.params.structured is not None and request.grammar is None:  # a bad one is refused here
            request.grammar = self.grammars.compiled(request.params.structured)
        ctx = self.config.context(self.model.config)
        if n >= ctx:
            what = "the model's context" if self.config.max_model_len is None else "--max-model-len"
            raise MinervaError(f"the prompt has {n} tokens but {what} is {ctx}; "
                               f"shorten it to at most {ctx - 1} tokens")
        need = n + min(request.params.max_tokens, ctx - n)
        if self.blocks.blocks_for(need) > self.blocks.num_blocks:  # then max_model_len < ctx: the pool's
            raise MinervaError(f"the prompt ({n} tokens) plus max_tokens needs {need} tokens of KV cache, "
                               f"but the pool holds {self.max_model_len}; lower max_tokens or raise "
                               "--kv-cache-memory")

    def add_request(self, request: Request) -> None:
        self.check(request)
        if request.request_id in self.requests:
            raise MinervaError(f"request id '{request.request_id}' is already in use")
        request.sampler = new_state(request.params, request.prompt_token_ids, self.device)
        if request.params.structured is not None:
            request.sampler.matcher = request.grammar.deep_copy()
        self.requests[request.request_id] = request
        self.scheduler.add(request, OutputProcessor(request.request_id, self.tokenizer, request.params))

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.abort(request)
            request.finish_reason = "abort"
            if self.speculator is not None:
                self.speculator.finished(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---------------------------------------------------------------- step

    def step(self) -> list[StreamDelta]:
        """schedule -> execute -> update, inside the backend's step context (on CPU: torch's
        own ops on one thread, the kernels on theirs; see CpuBackend.step)."""
        with dispatch.step(self.device):
            proposed = time.perf_counter()
            if self.speculator is not None:
                self.speculator.propose(self.scheduler.running, self.scheduler.room)
            output = self.scheduler.schedule()
            if not output:
                if self.scheduler.has_work():
                    raise RuntimeError("scheduler made no progress with requests pending")
                return []
            start = time.perf_counter()
            sampled = self.runner.execute(output, self.interrupt)
            end = time.perf_counter()
            self.scheduler.timed(output, sampled, end - start)
            if self.speculator is not None:
                rows = self.scheduler.decode_rows(output, sampled)
                if rows:
                    self.speculator.timed(rows, end - proposed)
            result = self.scheduler.update_from_output(output, sampled)
        for r in result.finished:
            del self.requests[r.request_id]
        if self.speculator is not None:
            for r, drafts, accepted in result.verified:
                self.speculator.verified(r, drafts, accepted)
            for r in result.finished:
                self.speculator.finished(r)
        return result.deltas
