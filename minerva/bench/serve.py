"""`minerva bench serve`: a load client for any OpenAI-compatible server, like vLLM's serving benchmark.

Requests go to `/v1/completions` with `stream: true` and `stream_options.include_usage`,
at a Poisson `--request-rate` (or all at once), at most `--max-concurrency` in flight.
Definitions follow vLLM's benchmark_serving: TTFT is the time to the first chunk with
choices; ITL the gaps between successive such chunks; TPOT (e2e - TTFT) / (output
tokens - 1); output tokens are the server's `usage.completion_tokens`; throughput is
over the wall time of the whole run. With `--compare-offline` the same prompts then run
through the offline engine in this process at the same concurrency, and the prefill
time of one prompt is measured, so the server's overhead is one ratio away.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
import urllib.parse
from dataclasses import asdict, dataclass, field

from minerva.engine.sampler import SamplingParams
from minerva.errors import MinervaError, write_output
from minerva.serve.registry import urls
from minerva.formats.gguf import GGUFFile
from minerva.formats.tokenizer import Tokenizer
from minerva.llm import LLM, set_threads
from minerva.serve.async_engine import on_own_thread
from minerva.store import resolve


@dataclass
class Result:
    """One request as the client saw it."""

    prompt_len: int
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    schema: dict | None = None  # the JSON schema it was asked to follow (--json-schemas)


# --json-schemas: ten shapes of JSON output, each bounded (no extra properties, short strings)
# so that a completion can end
_INT = {"type": "integer", "minimum": 0, "maximum": 100000}
_STR = {"type": "string", "maxLength": 24}
SCHEMAS = [
    {"type": "object", "properties": {"name": _STR, "age": _INT}, "additionalProperties": False, "required": ["name", "age"]},
    {"type": "object", "properties": {"city": _STR, "population": _INT, "capital": {"type": "boolean"}},
     "additionalProperties": False, "required": ["city", "population", "capital"]},
    {"type": "array", "items": _INT, "minItems": 1, "maxItems": 6},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                 "maxItems": 4}}, "additionalProperties": False, "required": ["colors"]},
    {"type": "object", "properties": {"title": _STR, "year": _INT, "tags": {"type": "array", "items": _STR,
                                                                         "maxItems": 3}},
     "additionalProperties": False, "required": ["title", "year", "tags"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {"type": "number"}},
     "additionalProperties": False, "required": ["answer"]},
    {"type": "object", "properties": {"x": _INT, "y": _INT, "label": _STR}, "additionalProperties": False, "required": ["x", "y"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": _INT, "email": _STR},
                                               "additionalProperties": False, "required": ["id"]}}, "additionalProperties": False, "required": ["user"]},
    {"type": "array", "items": {"type": "object", "properties": {"k": _STR, "v": _INT}, "additionalProperties": False, "required": ["k", "v"]},
     "maxItems": 3},
    {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 80}}, "additionalProperties": False, "required": ["summary"]},
]


def valid_for(text: str, schema: dict) -> bool:
    """Whether `text` parses as JSON and (where jsonschema is installed) validates against `schema`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    try:
        import jsonschema
    except ImportError:  # parsing is the check then
        return True
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def load_tokenizer(model: str | None):
    path = resolve(model)
    return path, (Tokenizer.from_pretrained_dir(path) if path.is_dir()
                  else Tokenizer.from_gguf_metadata(GGUFFile(path).metadata))


def random_prompts(tokenizer, num: int, input_len: int, seed: int) -> list[tuple[str, int]]:
    """Text of about input_len tokens made of random token ids, as vLLM's random dataset does:
    decode random ids, re-encode, cut to input_len, decode again."""
    rng = random.Random(seed)
    special = {tokenizer.bos_token_id, *tokenizer.eos_token_ids}
    vocab = min(tokenizer.vocab_size, 32000)
    out = []
    for _ in range(num):
        ids = [t for t in (rng.randrange(vocab) for _ in range(input_len * 2)) if t not in special]
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)[:input_len]
        text = tokenizer.decode(ids)
        out.append((text, len(tokenizer.encode(text))))
    return out


async def one_request(client, url: str, payload: dict, prompt_len: int, headers: dict) -> Result:
    r = Result(prompt_len)
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                for c in chunk.get("choices") or ():
                    r.text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                if chunk.get("choices"):
                    if r.ttft == 0.0:
                        r.ttft = now - start
                    else:
                        r.itl.append(now - last)
                    last = now
                elif chunk.get("usage"):
                    r.output_tokens = chunk["usage"]["completion_tokens"]
                    r.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if "error" in chunk:
                    r.error = str(chunk["error"])
                    return r
        r.latency = time.perf_counter() - start
        r.ok = r.ttft > 0
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        r.error = f"{type(exc).__name__}: {exc}"
    return r


async def run_load(args, prompts: list[tuple[str, int]], model_name: str) -> tuple[list[Result], float]:
    import httpx

    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    timeout = httpx.Timeout(None, connect=30.0)
    pool = httpx.Limits(max_connections=args.max_concurrency or len(prompts), max_keepalive_connections=None)

    async def limited(client, payload, n, schema):
        async with limit:
            result = await one_request(client, url, payload, n, headers)
            result.schema = schema
            return result

    async with httpx.AsyncClient(timeout=timeout, limits=pool) as client:
        tasks = []
        start = time.perf_counter()
        for text, n in prompts:
            payload = {"model": model_name, "prompt": text, "max_tokens": args.random_output_len,
                       "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
            if args.ignore_eos:
                payload["ignore_eos"] = True
            schema = None
            if args.json_schemas:
                schema = SCHEMAS[len(tasks) % args.json_schemas]
                payload["response_format"] = {"type": "json_schema",
                                              "json_schema": {"name": f"shape{len(tasks) % args.json_schemas}",
                                                              "schema": schema}}
            tasks.append(asyncio.create_task(limited(client, payload, n, schema)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def stats(values: list[float], scale: float = 1e3) -> dict:
    if not values:
        return {"mean": math.nan, "median": math.nan, "std": math.nan, "p99": math.nan}
    v = sorted(x * scale for x in values)
    p99 = v[min(len(v) - 1, max(0, math.ceil(0.99 * len(v)) - 1))] if len(v) > 1 else v[0]
    # vLLM uses numpy's linear-interpolated percentile; do the same.
    pos = 0.99 * (len(v) - 1)
    lo = int(pos)
    p99 = v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)
    return {"mean": statistics.fmean(v), "median": statistics.median(v),
            "std": statistics.pstdev(v), "p99": p99}


def summarize(results: list[Result], duration: float) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens or r.prompt_len for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "duration_s": duration, "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": stats([r.ttft for r in done]), "tpot_ms": stats(tpot),
        "itl_ms": stats([x for r in done for x in r.itl]), "e2el_ms": stats([r.latency for r in done]),
        "valid_json": (f"{sum(valid_for(r.text, r.schema) for r in done if r.schema is not None)} / "
                       f"{sum(r.schema is not None for r in done)}"),
    }


def load_offline(args):
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=args.max_concurrency or args.num_prompts,
              tensor_parallel_size=getattr(args, "tensor_parallel_size", None))
    llm.generate(["warm-up"] * 2, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    return llm


def offline(llm, args, prompts: list[tuple[str, int]], fresh: list[tuple[str, int]]) -> dict:
    """The same prompts through the offline engine at the same concurrency (its max_num_seqs), and
    the prefill time of `fresh` prompts of the same length (never seen: no prefix-cache hits)."""
    set_threads(None)  # a fresh thread: one per physical core, as LLM() set on the loading thread
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prefill = []
    for text, _ in fresh:
        start = time.perf_counter()
        llm.generate(text, one, use_tqdm=False)
        prefill.append(time.perf_counter() - start)
    params = SamplingParams(max_tokens=args.random_output_len, temperature=0, ignore_eos=args.ignore_eos)
    start = time.perf_counter()
    outs = llm.generate([t for t, _ in prompts], params, use_tqdm=False)
    secs = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"max_num_seqs": llm.engine.config.max_num_seqs, "duration_s": secs, "total_output_tokens": tokens,
            "output_throughput": tokens / secs, "prefill_ms_median": statistics.median(prefill) * 1e3,
            "prefill_prompt_tokens": statistics.median(n for _, n in fresh)}


def ratios(summary: dict, off: dict | None) -> dict:
    itl = summary["itl_ms"]
    out = {"itl_p99_over_median": itl["p99"] / itl["median"] if itl["median"] > 0 else math.nan}
    if off:
        out["server_over_offline_throughput"] = summary["output_throughput"] / off["output_throughput"]
        out["ttft_median_over_offline_prefill"] = summary["ttft_ms"]["median"] / off["prefill_ms_median"]
    return out


def report(summary: dict, args, model_name: str, off: dict | None) -> list[str]:
    rate = "inf" if not math.isfinite(args.request_rate) else f"{args.request_rate:g}"
    lines = [f"command: {' '.join(['minerva', *sys.argv[1:]])}",
             f"target:  {args.base_url}{args.endpoint} (model '{model_name}')",
             f"load:    {args.num_prompts} prompts of ~{args.random_input_len} tokens -> "
             f"{args.random_output_len} tokens, request rate {rate}/s, max concurrency "
             f"{args.max_concurrency or 'unlimited'}",
             "",
             f"{'Successful requests:':<40}{summary['completed']:>12}",
             f"{'Failed requests:':<40}{summary['failed']:>12}",
             f"{'Benchmark duration (s):':<40}{summary['duration_s']:>12.2f}",
             f"{'Total input tokens:':<40}{summary['total_input_tokens']:>12}",
             f"{'Total generated tokens:':<40}{summary['total_output_tokens']:>12}",
             f"{'Request throughput (req/s):':<40}{summary['request_throughput']:>12.2f}",
             f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:>12.2f}",
             f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:>12.2f}"]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        s = summary[key]
        short = key.split("_")[0].upper()
        lines += [f"{'-' * 16}{title:-^36}{'-' * 16}"[:68]]
        lines += [f"{f'{w} {short} (ms):':<40}{s[k]:>12.2f}"
                  for w, k in (("Mean", "mean"), ("Median", "median"), ("Std", "std"), ("P99", "p99"))]
    r = ratios(summary, off)
    lines.append(f"{'P99 / median ITL:':<40}{r['itl_p99_over_median']:>12.2f}")
    for e in summary["errors"]:
        lines.append(f"error: {e}")
    if args.json_schemas:
        lines.append(f"{'Outputs valid for their JSON schema:':<40}{summary['valid_json']:>12}")
    if off:
        lines += [f"{'-' * 16}{'Offline engine, same prompts':-^36}{'-' * 16}"[:68],
                  f"{'Output token throughput (tok/s):':<40}{off['output_throughput']:>12.2f}",
                  f"{'Server / offline throughput:':<40}{r['server_over_offline_throughput']:>12.2f}",
                  f"{'Offline prefill of one prompt, median (ms):':<44}{off['prefill_ms_median']:>8.2f}",
                  f"{'Server median TTFT / offline prefill:':<40}{r['ttft_median_over_offline_prefill']:>12.2f}"]
    return lines


async def _model_name(args) -> str:
    import httpx

    if args.model_name:
        return args.model_name
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            resp = await client.get(args.base_url.rstrip("/") + "/v1/models", headers=headers)
            if resp.status_code == 401:
                raise MinervaError(f"the server at {args.base_url} wants an API key: give --api-key" if not args.api_key
                                   else f"the server at {args.base_url} refuses the API key given (--api-key)")
            if resp.status_code != 200:
                raise MinervaError(f"the server at {args.base_url} answered GET /v1/models with HTTP "
                                   f"{resp.status_code}; give --base-url the server's URL (or pass --model-name)")
            return resp.json()["data"][0]["id"]
    except MinervaError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise MinervaError(f"cannot list models at {args.base_url}/v1/models ({type(exc).__name__}: {exc}); "
                           "is the server running? (or pass --model-name)") from None


def base_url(args) -> str:
    """The server's URL: --base-url (an OpenAI SDK's, ending in /v1, taken too: the routes add
    /v1), else the one at --host/--port, else the one Minerva server running here."""
    if args.base_url is None:
        if args.port is not None and not 1 <= args.port <= 65535:
            raise MinervaError(f"--port must be in [1, 65535], got {args.port}")
        found = urls(args.host, args.port)
        if len(found) > 1:
            raise MinervaError(f"{len(found)} Minerva servers run here ({', '.join(found)}); "
                               "say which with --base-url or --host/--port")
        return found[0]
    url = args.base_url.strip().rstrip("/")
    url = url.removesuffix("/v1").rstrip("/")
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or port == 0:
        raise MinervaError(f"--base-url '{args.base_url}' is not a server's URL; give one such as "
                           "http://127.0.0.1:8000 (http or https, a port in [1, 65535]; the routes add /v1)")
    return url


def cmd_bench_serve(args) -> int:
    args.base_url = base_url(args)
    if not 0 <= args.json_schemas <= len(SCHEMAS):
        raise MinervaError(f"--json-schemas must be in [0, {len(SCHEMAS)}], got {args.json_schemas}")
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, name) < 1:
            raise MinervaError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise MinervaError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise MinervaError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.repeat < 1:
        raise MinervaError(f"--repeat must be at least 1, got {args.repeat}")
    _, tokenizer = load_tokenizer(args.model)
    model_name = asyncio.run(_model_name(args))
    warm = argparse.Namespace(**{**vars(args), "request_rate": math.inf, "max_concurrency": 1})
    asyncio.run(run_load(warm, random_prompts(tokenizer, 1, 16, args.seed + 1), model_name))  # warm-up
    llm = on_own_thread(load_offline, args) if args.compare_offline else None
    rounds = []
    # Each round: the server, then (with --compare-offline) the offline engine right after, on
    # prompts no earlier round used, so the two sides meet the same machine and no cached prefix.
    for k in range(args.repeat):
        seed = args.seed + 1000 * k
        prompts = random_prompts(tokenizer, args.num_prompts, args.random_input_len, seed)
        results, duration = asyncio.run(run_load(args, prompts, model_name))
        summary = summarize(results, duration)
        fresh = random_prompts(tokenizer, 5, args.random_input_len, seed + 2)
        off = on_own_thread(offline, llm, args, prompts, fresh) if llm is not None else None
        rounds.append({"summary": summary, "offline": off, "ratios": ratios(summary, off), "results": results})
        if args.repeat > 1:
            print(f"round {k + 1}/{args.repeat}: " + ", ".join(f"{n} {v:.2f}" for n, v in rounds[-1]["ratios"].items())
                  + f"; output {summary['output_throughput']:.1f} tok/s, median TTFT "
                    f"{summary['ttft_ms']['median']:.1f} ms", file=sys.stderr, flush=True)
    last = rounds[-1]
    lines = report(last["summary"], args, model_name, last["offline"])
    if args.repeat > 1:
        lines.append(f"{'-' * 16}{f'Median of {args.repeat} rounds':-^36}{'-' * 16}"[:68])
        for name in last["ratios"]:
            values = [r["ratios"][name] for r in rounds]
            lines.append(f"{name + ':':<44}{statistics.median(values):>8.2f}  ("
                         + " ".join(f"{v:.2f}" for v in values) + ")")
        for name, get in (("server output tok/s", lambda r: r["summary"]["output_throughput"]),
                          ("server median TTFT ms", lambda r: r["summary"]["ttft_ms"]["median"])):
            lines.append(f"{name + ':':<44}{statistics.median(get(r) for r in rounds):>8.2f}")
    print("\n".join(lines))
    if args.result_file:
        payload = {"command": lines[0], "base_url": args.base_url, "model": model_name,
                   "num_prompts": args.num_prompts, "request_rate": str(args.request_rate),
                   "max_concurrency": args.max_concurrency, "random_input_len": args.random_input_len,
                   "random_output_len": args.random_output_len, **last["summary"], "offline": last["offline"],
                   "ratios": last["ratios"],
                   "rounds": [{k: v for k, v in r.items() if k != "results"} for r in rounds],
                   "itls_ms": [[x * 1e3 for x in r.itl] for r in last["results"]],
                   "results": [{k: v for k, v in asdict(r).items() if k != "itl"} for r in last["results"]]}
        write_output(args.result_file, json.dumps(payload, indent=2), "--result-file")  # (tried before the run)
        print(f"wrote {args.result_file}")
    return 0 if last["summary"]["completed"] else 1


def add_parser(bsub) -> None:
    q = bsub.add_parser("serve", help="load an OpenAI-compatible server like vLLM's serving benchmark")
    q.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="tokenizer for the random prompts, and the model of --compare-offline "
                        "(default smollm2-135m)")
    q.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    q.add_argument("--host", default=None, help="(default: the server running here, else 127.0.0.1)")
    q.add_argument("--port", type=int, default=None, help="(default: the server running here, else 8000)")
    q.add_argument("--endpoint", default="/v1/completions")
    q.add_argument("--model-name", default=None, help="model name to send (default: the server's first)")
    q.add_argument("--api-key", default=None)
    q.add_argument("--num-prompts", type=int, default=100)
    q.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    q.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    q.add_argument("--random-input-len", type=int, default=128)
    q.add_argument("--random-output-len", type=int, default=128)
    q.add_argument("--ignore-eos", action="store_true", help="generate exactly --random-output-len tokens")
    q.add_argument("--json-schemas", type=int, default=0, metavar="N",
                   help=f"constrain request i to JSON schema i mod N of {len(SCHEMAS)} built-in shapes "
                        "(response_format json_schema) and count the outputs that validate (default 0: none)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--result-file", default=None, help="also write the results to this JSON file")
    q.add_argument("--compare-offline", action="store_true",
                   help="then run the same prompts through the offline engine in this process")
    q.add_argument("--repeat", type=int, default=1,
                   help="rounds of (server run, offline run) on fresh prompts; ratios reported per round "
                        "and as medians")
    q.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="for --compare-offline (default auto, as minerva serve)")
    q.add_argument("--kv-cache-memory", type=float, default=None, help="for --compare-offline (default: sized to fit)")
    q.set_defaults(func=cmd_bench_serve)
