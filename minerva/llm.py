"""The offline Python API: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from typing import Iterator, Sequence

import torch
from tqdm import tqdm

from minerva.engine.engine import Engine, EngineConfig, kv_cache
from minerva.engine.runner import ModelRunner
from minerva.engine.speculative import early_exit_runner, self_layers
from minerva.engine.request import CompletionOutput, Request, RequestOutput, StreamDelta
from minerva.engine.sampler import SamplingParams
from minerva.errors import MinervaError
from minerva.formats.chat import check_template, continued, read_template, render_chat
from minerva.formats.generation import check_choice, sampling_defaults
from minerva.parsers.reasoning import reasoning_for
from minerva.parsers.tool_calls import join_pieces
from minerva.parsers.tools import make_plan, tools_for
from minerva.kernels import act_quant, dispatch
from minerva.machine import machine
from minerva.models import fit
from minerva.models.loader import LoadedModel, load_model, read_config
from minerva.models.lora import attach as lora_attach
from minerva.parallel import launch
from minerva.parallel.comm import exchange_choice
from minerva.parallel.shard import plan
from minerva.store import adapter_path, resolve

log = logging.getLogger("minerva")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Prompt = str | list[int]


def default_device() -> str:
    """The CPU, unless a GPU is present and a GPU backend that has passed its GPU tests is
    registered (`dispatch.gpu_ready`): the plain-torch reference on a GPU is no default."""
    return "cuda" if dispatch.gpu_ready() else "cpu"


def parse_device(device: str | None) -> torch.device:
    name = device or default_device()
    try:
        dev = torch.device(name)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise MinervaError(f"unknown device '{name}'; use cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MinervaError(f"device '{name}' requested but no CUDA GPU is available; use --device cpu")
    return dev


def resolve_dtype(name: str, device: torch.device) -> str:
    """The activation dtype `name` stands for; "auto" is bfloat16 where it is the fast choice
    (a CPU with the AVX-512 BF16 kernels, a CUDA GPU with bf16) and float32 (CPU) or float16
    (older GPUs) elsewhere. bf16 activations moved perplexity by under 0.4% on both real models
    (see docs/models.md and docs/performance/)."""
    if name != "auto":
        if name not in DTYPES:
            raise MinervaError(f"unknown dtype '{name}'; choose auto or one of {', '.join(DTYPES)}")
        return name
    return dispatch.default_dtype(device)


def _warn_off_the_kernels(device: torch.device, dtype: torch.dtype) -> None:
    """A dtype the CPU kernels do not run (float16) where they run others: a warning why not."""
    if device.type == "cpu" and dispatch.layer_kernel(device, dtype) is None \
            and dispatch.layer_kernel(device, torch.bfloat16) is not None:
        log.warning("%s activations run torch's reference ops on this CPU, not Minerva's kernels: slower, and a "
                    "request's output may change with its batch; --dtype bfloat16 or float32 run the kernels",
                    str(dtype).removeprefix("torch."))


def resolve_activations(name: str, device: torch.device) -> str:
    """What multiplies quantized weights: "float" activations or "int8" ones; "auto" is int8
    where the kernels' integer dot products are the fast choice (Minerva's CPU kernels, both
    builds: see `CpuBackend.default_activations` and docs/models.md) and float elsewhere."""
    if name == "auto":
        return dispatch.default_activations(device)
    act_quant.check_mode(name)
    return name


def set_threads(threads: int | None) -> int:
    """CPU threads for every kernel: `threads`, or by default one per physical core
    (a second hyper-thread on a core only contends for the same FMA units and cache)."""
    if threads is None:
        threads = machine().physical_cores
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise MinervaError(f"threads (--threads) must be an integer >= 1, got {threads!r}")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads > 4 * cpus:  # past a few per CPU they only wait for each other (10,000 stalled the machine)
        raise MinervaError(f"threads (--threads) {threads} is far more than the {cpus} CPUs this process may use; "
                           f"give at most {4 * cpus}, four a CPU (the default is one a physical core)")
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def _per_prompt(params, count: int) -> list[SamplingParams]:
    """`params` (one SamplingParams for every prompt, or one each) as one each."""
    if isinstance(params, SamplingParams):
        return [params] * count
    if not (isinstance(params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in params)):
        raise MinervaError("params must be a SamplingParams, a list of them (one a prompt) or None; got "
                           f"{type(params).__name__}")
    if len(params) != count:
        raise MinervaError(f"got {len(params)} sampling parameter sets for {count} prompts")
    return list(params)


class _Stop:
    """Stops a tensor-parallel LLM's workers and leaves its process group. The LLM's finalizer
    holds it, so it holds the group and the runner, never the LLM (which it would keep alive)."""

    def __init__(self, group: launch.Group):
        self.group = group
        self.runner: ModelRunner | None = None  # once the engine exists: it tells the workers to stop

    def __call__(self) -> None:
        group = self.group
        if group.closed:
            return
        stopped = False
        try:
            if self.runner is not None and not (group.comm is not None and group.comm.broken):
                self.runner.stop()
                stopped = True
        except MinervaError:  # a worker already gone: nothing to tell it
            pass
        group.close(10.0 if stopped else 0.0)  # workers never told to stop are killed at once


def check_arguments(model, lora, engine_options: dict) -> None:
    """LLM()'s arguments of the wrong kind, each a one-line error."""
    unknown = set(engine_options) - set(EngineConfig.__dataclass_fields__)
    if unknown:
        raise MinervaError(f"unknown engine option(s) {', '.join(sorted(unknown))}")
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise MinervaError(f"model must be a name, a path or a Hugging Face repo (a string), got {model!r}")
    if lora is not None and not (isinstance(lora, dict) and all(
            isinstance(k, str) and k.strip() and isinstance(v, (str, os.PathLike)) for k, v in lora.items())):
        raise MinervaError(f"lora must be a dict of adapter name (not empty) -> path, got "
                           f"{lora if isinstance(lora, dict) else type(lora).__name__!r}")


class LLM:
    """A loaded model with its tokenizer and a batching engine, ready to generate.

    `model` is a pulled name (pulled on first use), a .gguf path or a Hugging
    Face directory; None means the default model. `quantize` ("int8" | "int4")
    quantizes a SafeTensors checkpoint's weights group-wise at load; `activations="int8"`
    quantizes activations to 8 bits for integer dot products (`minerva.kernels.act_quant`),
    "float" keeps them float, "auto" (the default) picks int8 where it is the fast choice. Engine options (KV budget and
    precision, batch limits, prefix caching) are the fields of `EngineConfig`;
    `threads` defaults to the number of physical cores. `kernels` names the backend that runs
    on the device (`minerva.kernels.dispatch`: "auto", "reference", "cpu", "triton"); `device`
    defaults to the CPU unless a GPU backend that has passed its GPU tests is registered.
    `tensor_parallel_size` N > 1 splits
    the model over N processes on this host (`minerva.parallel`; this process is rank 0 and
    starts the others, each with a 1/N share of the cores by default); under `torchrun`
    every rank constructs the same LLM, and on ranks other than 0 the constructor follows
    rank 0's steps and then exits the process. `generation_config` "auto" takes the model's
    recommended sampling (a Hugging Face directory's generation_config.json, a GGUF file's
    general.sampling.* keys) as the defaults of calls that give no parameters, "none" leaves
    SamplingParams' defaults, a folder reads its generation_config.json.

    A tensor-parallel LLM holds worker processes and this process's `torch.distributed` group
    until `close()`, which runs by itself when the LLM is garbage-collected, at exit, and at
    the end of `with LLM(...) as llm:`; one such LLM can be open at a time.
    """

    def __init__(self, model: str | None = None, *, device: str | None = None,
                 dtype: str = "auto", auto_pull: bool = True, threads: int | None = None,
                 quantize: str | None = None, activations: str = "auto",
                 tensor_parallel_size: int | None = None, kernels: str = "auto",
                 lora: dict[str, str] | None = None, chat_template: str | os.PathLike | None = None,
                 generation_config: str | os.PathLike = "auto", **engine_options):
        check_arguments(model, lora, engine_options)
        check_choice(generation_config)
        given_template = None if chat_template is None else read_template(chat_template)  # before the load
        engine_config = EngineConfig(**engine_options)
        self.group: launch.Group | None = None
        self._stop: _Stop | None = None
        self._finalizer: weakref.finalize | None = None
        self.device = parse_device(device)
        self.kernels = dispatch.choose(self.device.type, kernels)
        # the model first: a wrong name is an error at once, before the kernels are built
        self.path = resolve(model, auto_pull=auto_pull)
        launch.check_size(tensor_parallel_size)
        if (tensor_parallel_size or 1) > 1 or launch.torchrun_rank():
            if self.device.type != "cpu":
                raise MinervaError("tensor parallelism runs on CPUs so far; use --device cpu")
            world = tensor_parallel_size or launch.torchrun_rank()[1]
            # what would fail on every rank fails here, before any rank starts
            whole = read_config(self.path)
            plan(whole, 0, world)
            self_layers(engine_config.speculative, whole)
            exchange_choice()
            launch.timeout()
            threads = launch.threads_per_rank(threads, world)
            spec = dict(model=str(self.path), device=device, dtype=dtype, auto_pull=False, threads=threads,
                        quantize=quantize, activations=activations, tensor_parallel_size=tensor_parallel_size,
                        kernels=kernels, **engine_options)
            self.group = launch.join(tensor_parallel_size, spec)
            if self.group is not None and self.group.leader:  # closed however this LLM goes, even half-built
                self._stop = _Stop(self.group)
                self._finalizer = weakref.finalize(self, self._stop)
        set_threads(threads)
        self.dtype_name = resolve_dtype(dtype, self.device)
        self.dtype = DTYPES[self.dtype_name]
        _warn_off_the_kernels(self.device, self.dtype)
        self.activations = activations = resolve_activations(activations, self.device)
        group = self.group
        before = fit.resident()
        self.loaded: LoadedModel = load_model(self.path, self.device, self.dtype, quantize=quantize,
                                             activations=activations,
                                             parallel=None if group is None else (group.rank, group.world))
        comm = None
        if group is not None:
            launch.connect_group(group, self.device, self.loaded.compute_bytes)
            comm, shard = group.comm, self.loaded.shard
            self.loaded.model.parallelize(comm, shard.vocab, shard.vocab_per_rank)
            if not group.leader:  # a follower: run rank 0's steps on this shard until it stops, then leave
                model = self.loaded.model
                cache = kv_cache(model, engine_config, self.device, self.dtype, comm)
                layers = self_layers(engine_config.speculative, model.config)
                draft = None if layers is None else early_exit_runner(
                    model, layers, cache.token_blocks, engine_config.block_size, self.dtype, self.device, comm)[0]
                ModelRunner(model, cache, self.device, comm).follow(draft)
                group.close()
                raise SystemExit(0)
        self.tokenizer = self.loaded.tokenizer
        self.config = self.loaded.config
        self._use_chat_template(given_template)
        self.sampling_defaults = sampling_defaults(self.path, generation_config, announce=True,
                                                   metadata=self.loaded.metadata)
        self.reasoning = reasoning_for(self.tokenizer)  # how its replies split into reasoning and answer
        self.tool_format = tools_for(self.tokenizer, self._render)  # how its template and replies carry tools
        draft = engine_config.draft_model
        if draft is not None:
            draft = load_model(resolve(draft, auto_pull=auto_pull), self.device, self.dtype,
                               activations=activations)
        self._attach_adapters(lora or {}, auto_pull)
        self.engine = Engine(self.loaded.model, self.tokenizer, engine_config, self.device, self.dtype,
                             model_id=f"{self.path.resolve()}:{self.dtype_name}:{quantize}:{activations}", draft=draft,
                             comm=comm, adapters=self.adapters)
        if self._stop is not None:
            self._stop.runner = self.engine.runner
        # what this model takes in this process, the KV pool counted full (minerva.models.fit)
        self.memory = fit.estimate(self.loaded.footprint, self.config, self.engine.cache.nbytes,
                                   engine_config.max_num_batched_tokens, base=before)

    def _use_chat_template(self, given: tuple[str, str] | None) -> None:
        """The template chat requests are rendered with: `given` (its text and where it comes
        from), else the model's own (one that does not compile is a warning: completions work),
        else the built-in one for its architecture."""
        if given is not None:
            text, self.chat_template_source = given
            check_template(text, self.chat_template_source)
            self.tokenizer.use_chat_template(text)
        elif self.tokenizer.chat_template:
            self.chat_template_source = (f"the chat template of '{self.path}'; give a working one with "
                                         "--chat-template FILE")
            try:
                check_template(self.tokenizer.chat_template, self.chat_template_source)
            except MinervaError as exc:
                log.warning("%s; chat requests will fail (completions work)", exc)
        else:
            self.chat_template_source = f"Minerva's built-in chat template for {self.config.architecture}"
        self.built_in_template = given is None and not self.tokenizer.chat_template  # a base model's, mostly
        self.chat_template = self.tokenizer.resolved_chat_template

    def _attach_adapters(self, lora: dict[str, str], auto_pull: bool) -> None:
        """LoRA adapters: name -> directory (or Hugging Face repo), each a model id of its own."""
        self.adapter_paths = {name: adapter_path(p, auto_pull) for name, p in lora.items()}
        self.adapters = None
        if self.adapter_paths:
            if self.group is not None:
                raise MinervaError("LoRA adapters do not run under tensor parallelism yet; drop --lora or "
                                   "--tensor-parallel-size")
            self.adapters = lora_attach(self.loaded.model, self.adapter_paths, self.device, self.dtype)

    def close(self) -> None:
        """Stop the tensor-parallel workers (a no-op for one process); the LLM cannot run after it."""
        self.group = None
        if self._finalizer is not None:
            self._finalizer()  # once: a no-op after the first call, and at collection or exit

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ prompts

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False,
                            **variables) -> str:
        """The prompt of a conversation; `tools` (OpenAI's function tools) and `variables` (e.g.
        reasoning_effort) go to the template too. Tools, tool calls and tool results are rendered
        by the template when it supports them, else in the built-in format (`parsers.tools`).
        `continue_final_message`: the prompt ends inside the last message, an assistant's, for
        the reply to go on from its text (a prefill), as transformers renders it."""
        if continue_final_message and add_generation_prompt:
            raise MinervaError("continue_final_message goes on with the last message, and add_generation_prompt "
                               "starts a new one: set add_generation_prompt false")
        if tools or any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in messages):
            messages, extra = self.tool_format.render(messages, tools)
            variables = {**variables, **extra}
        text = self._render(messages, add_generation_prompt, **variables)
        return continued(text, messages[-1]) if continue_final_message else text

    def _render(self, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
        return render_chat(self.chat_template, messages, bos_token=self._token(self.tokenizer.bos_token_id),
                           eos_token=self._token(self.tokenizer.eos_token_id),
                           add_generation_prompt=add_generation_prompt, source=self.chat_template_source, **variables)

    def chat_params(self, params: SamplingParams, tools: bool = False) -> SamplingParams:
        """`params` for a chat reply: special tokens kept where the model's reasoning parser (or,
        with `tools`, its tool-call parser) reads them."""
        keep = ((self.reasoning is not None and not self.reasoning.skip_special_tokens)
                or (tools and not self.tool_format.skip_special_tokens))
        return dataclasses.replace(params, skip_special_tokens=False) if keep else params

    def _token(self, token_id: int | None) -> str:
        return (self.tokenizer.id_to_token(token_id) or "") if token_id is not None else ""

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            # A chat template already starts with the BOS token where the model wants one.
            return self.tokenizer.encode(prompt, add_special_tokens=not self._starts_with_bos(prompt))
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise MinervaError("a prompt must be a string or a list of token ids")

    def _starts_with_bos(self, text: str) -> bool:
        bos = self._token(self.tokenizer.bos_token_id)
        return self.tokenizer.add_bos and bool(bos) and text.startswith(bos)

    def make_requests(self, prompt: Prompt, params: SamplingParams) -> list[Request]:
        """The engine requests of one prompt, one per completion (n of them), checked by the
        engine (a MinervaError for one that could never run); siblings get seeds seed, seed + 1, ...
        (past 2^63 - 1 from -2^63 on) and share the prompt's KV through the prefix cache."""
        ids = self.encode_prompt(prompt)
        text = prompt if isinstance(prompt, str) else None
        group = [Request(ids, dataclasses.replace(
                     params, seed=None if params.seed is None else (params.seed + i + 2**63) % 2**64 - 2**63),
                         prompt=text)
                 for i in range(params.n)]
        for sibling in group[1:]:
            sibling.wait_for = group[0]
        for r in group:
            self.engine.check(r)
        return group

    # --------------------------------------------------------- generation

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters of a call that gives none: SamplingParams' defaults with the model's
        own sampling defaults (`sampling_defaults`, from `generation_config`) over them."""
        return SamplingParams(**self.sampling_defaults)

    def _defaults_for(self, ids: list[int]) -> SamplingParams:
        """get_default_sampling_params for a prompt of `ids`, max_tokens cut at the context's room."""
        params, room = self.get_default_sampling_params(), max(1, self.engine.max_model_len - len(ids))
        return dataclasses.replace(params, max_tokens=min(params.max_tokens, room))

    def stream_many(self, prompts: Sequence[Prompt],
                    params: SamplingParams | Sequence[SamplingParams] | None = None,
                    ) -> Iterator[tuple[int, int, StreamDelta]]:
        """Yield (prompt index, completion index, delta) as the engine produces them."""
        if params is None:  # the defaults, fitted to each prompt
            prompts = [self.encode_prompt(p) for p in prompts]
            params = [self._defaults_for(ids) for ids in prompts]
        params = _per_prompt(params, len(prompts))
        groups = [self.make_requests(p, sp) for p, sp in zip(prompts, params)]  # all checked before any runs
        where = {}
        for i, group in enumerate(groups):
            for j, r in enumerate(group):
                self.engine.add_request(r)
                where[r.request_id] = (i, j)
        try:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    if delta.error is not None:  # its constraint could not be followed
                        raise MinervaError(delta.error)
                    yield (*where[delta.request_id], delta)
        finally:  # a consumer that stops early must not leave requests holding KV blocks
            for rid in where:
                self.engine.abort(rid)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt through the engine together; outputs in prompt order. `use_tqdm`:
        a progress bar of the prompts done, with the input and output tokens/s (on stderr)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise MinervaError("prompts must be a string, a list of token ids, or a list of those; got "
                               f"{type(prompts).__name__}")
        prompts = list(prompts)
        ids = [self.encode_prompt(p) for p in prompts]  # once: the engine and the outputs take these
        per_prompt = [self._defaults_for(i) for i in ids] if params is None else _per_prompt(params, len(prompts))
        completions = [[{"text": [], "ids": [], "finish": None, "logprobs": []} for _ in range(sp.n)]
                       for sp in per_prompt]
        left = [sp.n for sp in per_prompt]
        start, produced, prompt_tokens = time.perf_counter(), 0, 0
        with tqdm(total=len(prompts), disable=not use_tqdm, desc="Processed prompts", unit="prompt") as bar:
            for i, j, delta in self.stream_many(ids, per_prompt):
                c = completions[i][j]
                c["text"].append(delta.text)
                c["ids"] += delta.token_ids
                c["logprobs"] += delta.logprobs
                produced += len(delta.token_ids)
                if delta.finish_reason:
                    c["finish"] = delta.finish_reason
                    left[i] -= 1
                    if left[i] == 0:
                        prompt_tokens += len(ids[i])
                        seconds = max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"input: {prompt_tokens / seconds:.1f} tok/s, "
                                            f"output: {produced / seconds:.1f} tok/s", refresh=False)
                        bar.update(1)
        return [RequestOutput(f"gen-{i}", p if isinstance(p, str) else None, ids[i],
                              [CompletionOutput(j, "".join(c["text"]), c["ids"], c["finish"],
                                                c["logprobs"] if per_prompt[i].logprobs is not None else None)
                               for j, c in enumerate(completions[i])])
                for i, p in enumerate(prompts)]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield text deltas of one prompt as tokens are produced."""
        for _, _, delta in self.stream_many([prompt], params):
            yield delta

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None, *,
             tools: list[dict] | None = None, tool_choice: str | dict | None = None,
             parallel_tool_calls: bool | None = None, use_tqdm: bool = True,
             **variables) -> RequestOutput | list[RequestOutput]:
        """A reply to `messages` (one conversation), or a list of replies to a list of
        conversations, run together. For a model that reasons first, each completion's `text`
        is the answer and its `reasoning` the reasoning. `tools`, `tool_choice` and
        `parallel_tool_calls` are OpenAI's: the calls the model makes are each completion's
        `tool_calls` (its finish_reason then "tool_calls"), and `text` what else it wrote."""
        many = bool(messages) and all(isinstance(m, (list, tuple)) for m in messages)
        calling = make_plan(tools, tool_choice, parallel_tool_calls)
        if calling is not None and calling.forced and params is not None and params.structured is not None:
            raise MinervaError("a forced tool call already constrains the output; leave out SamplingParams.structured")
        prompts = [self.apply_chat_template(list(c), tools=calling.prompt_tools if calling else None, **variables)
                   for c in (messages if many else [messages])]
        forced = {"structured": calling.output(self.tool_format)} if calling is not None and calling.forced else {}
        ids = [self.encode_prompt(p) for p in prompts]  # once: the defaults' fit and the engine take these
        each = [self.chat_params(dataclasses.replace(params or self._defaults_for(i), **forced),
                                 tools=calling is not None and calling.choice == "auto") for i in ids]
        outs = [self._reply(dataclasses.replace(out, prompt=prompt), prompt, calling)
                for out, prompt in zip(self.generate(ids, each, use_tqdm=use_tqdm), prompts)]
        return outs if many else outs[0]

    def _reply(self, out: RequestOutput, prompt: str, calling) -> RequestOutput:
        """`out` split into reasoning, answer and tool calls."""
        outputs = []
        for c in out.outputs:
            json_only = calling is not None and calling.held_to_json(self.tool_format)  # no reasoning to split
            parser = self.reasoning.parser(prompt) if self.reasoning is not None and not json_only else None
            reasoning, text = parser.feed(c.text, end=True) if parser is not None else ("", c.text)
            reasoning = reasoning or None
            caller = calling.parser(self.tool_format, parser) if calling is not None else None
            calls = None
            if caller is not None:
                text, pieces = caller.feed(text, end=True)
                calls = join_pieces(pieces) or None
            outputs.append(dataclasses.replace(c, text=text, reasoning=reasoning, tool_calls=calls,
                                               finish_reason="tool_calls" if calls and c.finish_reason == "stop"
                                               else c.finish_reason))
        return dataclasses.replace(out, outputs=outputs)

    def __repr__(self) -> str:
        c = self.config
        return (f"LLM({self.path.name!r}: {c.architecture}, {c.num_layers} layers, {self.dtype_name} on {self.device}, "
                f"{self.loaded.weight_bytes / 1e6:.0f} MB of weights, context {self.engine.max_model_len})")
