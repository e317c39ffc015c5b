"""The stages of benchmarks/gpu_check.py: each a function of the check's setting (`Ctx`) that
returns its result as a dict (`status`, `summary`, and its figures), run in a process of its own.
See gpu_check.py for what each stage checks and how they are run."""

from __future__ import annotations

import importlib.util
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TYPES_CHECKED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
PROMPTS = ("Why is the sky blue?", "Write a haiku about the sea.", "What is 17 times 23?",
           "Name three programming languages and one thing each is good at.")


# ------------------------------------------------------------------ the stages' setting

class Ctx:
    """What every stage knows: dry run or not, the device, the models, a work folder, and the
    results of `env` (the measured bandwidth) once it has run."""

    def __init__(self, d: dict, result_file: Path | None = None):
        self.dry: bool = d["dry"]
        self.models: dict[str, str] = d["models"]
        self.work = Path(d["work"])
        self.env: dict = d.get("env", {})
        self.budget: float = d.get("budget", 60.0)  # this stage's seconds
        self.device = "cpu" if self.dry else "cuda"
        self.result_file = result_file

    def sizes(self, gpu, dry):
        return dry if self.dry else gpu

    def partial(self, result: dict) -> None:
        """What a long stage has so far: reported if its budget runs out before it ends."""
        if self.result_file is not None:
            self.result_file.write_text(json.dumps(result, default=str))


def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _llm(ctx: Ctx, path, kernels="triton", dtype="bfloat16", device=None, **options):
    from minerva import LLM
    device = device or ctx.device
    options.setdefault("kv_cache_memory", 0.3 if device == "cuda" else 512 << 20)
    llm = LLM(str(path), device=device, kernels=kernels, dtype=dtype, activations="float", **options)
    if llm.kernels != kernels:  # the report names the path that ran: the one asked for, never a fallback
        raise RuntimeError(f"asked for --kernels {kernels}, {llm.kernels} runs")
    return llm


def _toy_shape():
    import synthetic
    # one layer, rows a multiple of 256 for the K-quants, a 256-token vocabulary: the
    # interpreter runs a Triton program in tens of milliseconds
    return synthetic.Shape("toy", 1, 256, 256, 4, 2, 256, 256, 10000.0)


def _synthetic(ctx: Ctx, shape_name: str, file_type: str, sparse: bool = False) -> Path:
    """A random-weight file of a real shape (a toy one in a dry run), written once into the work folder."""
    import synthetic
    shape = _toy_shape() if ctx.dry else synthetic.SHAPES[shape_name]
    name = f"{'toy' if ctx.dry else shape_name}-{file_type}{'-sparse' if sparse else ''}.gguf"
    path = ctx.work / name
    if not path.exists():
        synthetic.write(path, shape, file_type, tokenizer=Path(_tokenizer_model(ctx)), sparse=sparse)
    return path


def _tokenizer_model(ctx: Ctx) -> str:
    """The model whose tokenizer the random-weight files copy: the first `--model`, else the store's SmolLM2."""
    if ctx.models and not ctx.dry:
        return next(iter(ctx.models.values()))
    from minerva.store import resolve
    return str(resolve("smollm2-135m"))


def _randomize(llm) -> None:
    """Draw the float weights of a file written sparse (zeros) on the model's device: normal(0, 0.02)."""
    import torch
    model = llm.engine.model
    seen = set()
    with torch.inference_mode():  # the loaded weights are inference tensors
        for w in [getattr(m, "weight", None) for m in model.modules()] + [getattr(model, "embed", None)]:
            t = getattr(w, "tensor", None)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and id(t) not in seen and t.dim() == 2:
                seen.add(id(t))
                t.normal_(0.0, 0.02)
    if not seen:
        raise RuntimeError("no float matrix to fill: the file's weights are not plain tensors on this backend")


# --------------------------------------------------------------------------- stages

def stage_env(ctx: Ctx) -> dict:
    import torch
    import triton
    out = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "device": ctx.device}
    if ctx.dry:
        out["name"] = platform.processor() or platform.machine()
        n = 16 << 20
    else:
        p = torch.cuda.get_device_properties(0)
        out.update(name=p.name, memory_gb=round(p.total_memory / 1e9, 1), sms=p.multi_processor_count,
                   capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda)
        n = 1 << 30
    a = torch.empty(n // 4, dtype=torch.float32, device=ctx.device).uniform_()
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(12):
        _sync()
        t = time.perf_counter()
        b.copy_(a)
        _sync()
        best = min(best, time.perf_counter() - t)
    out["bandwidth_gbs"] = round(2 * n / best / 1e9, 1)  # read and written
    out["summary"] = (f"{out['name']}, torch {out['torch']}, triton {out['triton']}: "
                      f"{out['bandwidth_gbs']} GB/s device copy (read + written)")
    return out


# the test files whose cases run the Triton kernels on a GPU when there is one (each file's
# cases take DEVICE = "cuda" then; the backend ops are chosen by name)
CUDA_TESTS = ["tests/kernels/test_triton_qmatmul.py", "tests/kernels/test_triton_attention.py",
              "tests/kernels/test_triton_ops.py", "tests/kernels/test_backend_ops.py",
              "tests/formats/test_quant.py::test_cuda_bit_identical_to_gguf_package"]


def stage_cuda_tests(ctx: Ctx) -> dict:
    if ctx.dry:
        return {"status": "skipped", "summary": "no GPU: the CUDA tests run on one (here they run in the suite, "
                                                "under the interpreter)"}
    import os
    import signal
    workers = ["-n", "8"] if importlib.util.find_spec("xdist") else []  # Triton compiles a kernel per case
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, *CUDA_TESTS]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its workers are killed with it
    try:
        out, timed_out = proc.communicate(timeout=ctx.budget - 15)[0], False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, timed_out = proc.communicate()[0], True
    lines = out.strip().splitlines()
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    status = "timeout" if timed_out else "passed" if proc.returncode == 0 else "failed"
    return {"status": status, "summary": (lines[-1] if lines else "no output") + (" (stopped at its budget)" if timed_out else ""),
            "failures": failed[:20], "output_tail": "\n".join(lines[-40:])}


def stage_kernels(ctx: Ctx) -> dict:
    import gguf
    import torch
    import synthetic
    from minerva.formats.quant import dequantize
    from minerva.kernels.cuda import qmatmul as tq
    Q = gguf.GGMLQuantizationType
    # the 8B shape's gate/up and down matrices (a Triton kernel is compiled per row length,
    # type and activation dtype); more rows are the cuda_tests' and the throughput stage's
    shapes = ctx.sizes([(14336, 4096), (4096, 14336)], [(64, 256)])
    rows = ctx.sizes((1, 7), (1, 5))
    dtypes = (torch.float32, torch.bfloat16) if not ctx.dry else (torch.float32, torch.float16)
    # of the largest output: the rounding of x (and of the weights for half types) and of the sums
    eps = {torch.float32: 2 ** -18, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -8}
    table, bad = [], []
    for name in TYPES_CHECKED:
        qtype = Q[name]
        for n, k in shapes:
            raw = _random_packed(synthetic, qtype, (n, k))
            packed = torch.from_numpy(raw).to(ctx.device)
            w = dequantize(torch.from_numpy(raw), qtype, (n, k)).double()
            for m in rows:
                x = torch.randn(m, k, dtype=torch.float64) * 0.5
                ref = x @ w.T
                scale = ref.abs().max().item()
                errs = {}
                for dt in dtypes:
                    y = tq.qmatmul(x.to(dt).to(ctx.device), packed, qtype, n, k).double().cpu()
                    # the dtype's rounding of x and of each product's sum: relative to the largest output
                    errs[str(dt).split(".")[-1]] = (y - ref).abs().max().item() / scale
                ok = all(e <= eps[dt] * max(1.0, k ** 0.5 / 32) for e, dt in zip(errs.values(), dtypes))
                row = {"type": name, "n": n, "k": k, "m": m, **{f"err_{d}": e for d, e in errs.items()}, "ok": ok}
                if m == 1 and not ctx.dry:
                    xb = x.to(torch.bfloat16).to(ctx.device)
                    us = _gpu_us(lambda: tq.qmatmul(xb, packed, qtype, n, k))
                    row.update(us=round(us, 1), gbs=round(raw.nbytes / us / 1e3, 1))
                table.append(row)
                if not ok:
                    bad.append(f"{name} {n}x{k} m={m}: {errs}")
                ctx.partial({"status": "timeout", "partial": True, "table": table, "failures": bad,
                             "summary": f"{len(table)} cases done before the budget ran out, {len(bad)} off"})
    top = [r for r in table if r.get("gbs")]
    speed = "; ".join(f"{r['type']} {r['gbs']}" for r in top if r["n"] == 4096)
    return {"status": "failed" if bad else "passed", "table": table, "failures": bad,
            "summary": f"{len(table) - len(bad)}/{len(table)} cases within tolerance" + (f"; one row of x, 4096x14336, GB/s: {speed}" if speed else "")}


def _random_packed(synthetic, qtype, shape):
    """Valid random blocks of `qtype` (synthetic.py's recipe: dequantized std 0.02)."""
    import numpy as np
    t = synthetic.RandomTensor(qtype, shape, np.random.SeedSequence(int(qtype) * 7919 + shape[0]), {})
    return np.concatenate(list(t.slabs())).reshape(t.shape)


def _gpu_us(fn) -> float:
    """Median microseconds of fn() on the GPU, the L2 cache flushed before each call (the 8B
    matrices of most types fit in an H100/H200's L2): triton.testing.do_bench."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def _model_path(ctx: Ctx, name: str) -> Path:
    if ctx.dry:
        return _synthetic(ctx, "tinyllama-1.1b", {"smollm2": "Q8_0", "gemma3": "Q4_K_M"}.get(name, "Q4_0"))
    return Path(ctx.models[name])


def _prompt_ids(ctx: Ctx, llm, count: int) -> list[list[int]]:
    """Chat prompts, or in a dry run a few ids each (the toy vocabulary spells a prompt in hundreds)."""
    if ctx.dry:
        return [[60 + 7 * i + j for j in range(5 + i)] for i in range(count)]
    return [llm.encode_prompt(llm.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS[:count]]


def stage_logits(ctx: Ctx, name: str) -> dict:
    import torch
    from tests.helpers.paged import paged_logits
    path = _model_path(ctx, name)
    ref_llm = _llm(ctx, path, kernels="reference", dtype="float32", device="cpu")
    ids = [i for p in _prompt_ids(ctx, ref_llm, 2) for i in p][:96]
    ref = paged_logits(ref_llm.engine.model, ids, chunk=ctx.sizes(40, 6))
    del ref_llm
    llm = _llm(ctx, path, dtype="float32")
    ours = paged_logits(llm.engine.model, ids, chunk=ctx.sizes(40, 6), device=ctx.device).cpu()
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item() / scale
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    out = {"status": "passed" if err <= 1e-3 else "failed", "kernels": llm.kernels, "tokens": len(ids), "max_err_rel": err,
           "argmax_agree": agree}
    if not ctx.dry:  # bf16, as users run it: reported, not judged
        del llm
        llm = _llm(ctx, path, dtype="bfloat16")
        bf = paged_logits(llm.engine.model, ids, chunk=40, dtype=torch.bfloat16, device=ctx.device).cpu()
        out["bf16_err_rel"] = (bf - ref).abs().max().item() / scale
        out["bf16_argmax_agree"] = (bf.argmax(-1) == ref.argmax(-1)).float().mean().item()
    out["summary"] = (f"{len(ids)} positions: float32 max |diff| {err:.2e} of the largest logit (limit 1e-3), "
                      f"argmax agrees {agree:.0%}" + (f"; bf16 {out['bf16_err_rel']:.2e}, argmax {out['bf16_argmax_agree']:.0%}"
                                                       if "bf16_err_rel" in out else ""))
    return out


def _greedy(llm, prompts, n):
    from minerva import SamplingParams
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def stage_greedy(ctx: Ctx, name: str) -> dict:
    path = _model_path(ctx, name)
    n = ctx.sizes(32, 3)
    ref_llm = _llm(ctx, path, kernels="reference", dtype="float32", device="cpu")
    prompts = _prompt_ids(ctx, ref_llm, ctx.sizes(4, 2))
    ref = [_greedy(ref_llm, [p], n)[0] for p in prompts]
    del ref_llm
    llm = _llm(ctx, path, dtype="float32")
    ours = [_greedy(llm, [p], n)[0] for p in prompts]
    same = [a == b for a, b in zip(ours, ref)]
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ours, ref)]
    return {"status": "passed" if all(same) else "failed", "kernels": llm.kernels, "equal": same, "first_difference": first,
            "summary": f"{sum(same)}/{len(same)} prompts give the CPU reference's {n} greedy ids (float32)"}


def stage_batched(ctx: Ctx, name: str) -> dict:
    path = _model_path(ctx, name)
    n = ctx.sizes(24, 3)
    llm = _llm(ctx, path, dtype=ctx.sizes("bfloat16", "float32"))
    prompts = (_prompt_ids(ctx, llm, 4) * 2)[:ctx.sizes(8, 2)]
    together = _greedy(llm, prompts, n)
    alone = [_greedy(llm, [p], n)[0] for p in prompts]
    same = [a == b for a, b in zip(together, alone)]
    return {"status": "passed" if all(same) else "failed", "kernels": llm.kernels, "equal": same,
            "summary": f"{sum(same)}/{len(same)} requests batched give their ids alone ({n} greedy tokens, "
                       f"{ctx.sizes('bf16', 'float32')})"}


def _decode_rate(llm, prompt_len: int, n: int, warm: bool = True) -> tuple[float, float]:
    """(decode tokens/s after the first token, seconds to the first token) of one greedy request."""
    from minerva import SamplingParams
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    prompt = list(range(100, 100 + prompt_len))
    if warm:  # compiles the kernels
        list(llm.stream(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))
    _sync()
    start = time.perf_counter()
    first, count = None, 0
    for delta in llm.stream(prompt, params):
        count += len(delta.token_ids)
        if first is None and count:
            first = time.perf_counter()
            first_count = count
    _sync()
    end = time.perf_counter()
    return (count - first_count) / max(end - first, 1e-9), first - start


DECODES = {"decode_1.1b_bf16": ("tinyllama-1.1b", "BF16"), "decode_1.1b_q4_0": ("tinyllama-1.1b", "Q4_0"),
           "decode_1.1b_q4_k_m": ("tinyllama-1.1b", "Q4_K_M"), "decode_8b_bf16": ("llama3-8b", "BF16")}


def stage_decode(ctx: Ctx, shape_name: str, file_type: str) -> dict:
    from minerva.bench.roofline import model_costs
    floats = file_type in ("BF16", "F16")
    path = _synthetic(ctx, shape_name, file_type, sparse=floats and not ctx.dry)
    start = time.perf_counter()
    # no prefix cache: the timed request must not reuse the warm-up's blocks
    llm = _llm(ctx, path, dtype=ctx.sizes("bfloat16", "float32"), max_num_seqs=4, enable_prefix_caching=False)
    if floats and not ctx.dry:
        _randomize(llm)
    load = time.perf_counter() - start
    n = ctx.sizes(128, 3)
    rate, ttft = _decode_rate(llm, ctx.sizes(128, 4), n, warm=not ctx.dry)
    costs = model_costs(llm.loaded)
    step_bytes = costs.weight_bytes_per_token + costs.kv_bytes_per_token * ctx.sizes(192, 5)
    bw = ctx.env.get("bandwidth_gbs")
    share = rate * step_bytes / (bw * 1e9) if bw else None
    return {"kernels": llm.kernels, "tokens_per_s": round(rate, 1), "ttft_s": round(ttft, 3), "load_s": round(load, 1),
            "weight_gb": round(costs.weight_bytes_per_token / 1e9, 3), "share_of_bandwidth": share,
            "matmuls": "torch (cuBLAS on a GPU)" if floats else llm.kernels,
            "summary": f"{rate:.1f} tokens/s at batch 1 ({costs.weight_bytes_per_token / 1e6:.1f} MB of weights a token"
                       + (f", {share:.0%} of {bw} GB/s" if share is not None else "") + f"); load {load:.1f} s"
                       + ("; float matrices multiply in torch, the rest on Triton" if floats else "")}


def stage_throughput(ctx: Ctx) -> dict:
    from minerva import SamplingParams
    path = _synthetic(ctx, "tinyllama-1.1b", "Q4_K_M")
    count, n_in, n_out = ctx.sizes((256, 128, 128), (4, 4, 3))
    llm = _llm(ctx, path, dtype=ctx.sizes("bfloat16", "float32"), max_num_seqs=count, enable_prefix_caching=False,
               max_num_batched_tokens=ctx.sizes(8192, 64))
    prompts = [[100 + (i * 131 + j * 7) % ctx.sizes(20000, 150) for j in range(n_in)] for i in range(count)]  # no two alike
    params = SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True)
    if not ctx.dry:  # compiles the kernels
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    _sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync()
    secs = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": count, "output_tokens": produced, "seconds": round(secs, 2),
            "output_tokens_per_s": round(produced / secs, 1),
            "summary": f"{count} requests of {n_in} in / {n_out} out, {ctx.sizes('1.1B', 'toy')} shape Q4_K_M: "
                       f"{produced / secs:.0f} output tokens/s ({secs:.1f} s)"}


def stage_graphs(ctx: Ctx) -> dict:
    from minerva.engine import runner
    has = any("graph" in n.lower() for n in dir(runner.ModelRunner))
    if not has:
        return {"status": "skipped", "summary": "the runner has no CUDA-graph path yet: decode runs eagerly "
                                                "(the decode_* stages are the graphs-off figures)"}
    return {"status": "failed", "summary": "the runner has a graph path this check does not know how to switch"}


def stage_idle(ctx: Ctx) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from minerva import SamplingParams
    path = _synthetic(ctx, "tinyllama-1.1b", "BF16", sparse=not ctx.dry)
    llm = _llm(ctx, path, dtype=ctx.sizes("bfloat16", "float32"), max_num_seqs=4, decode_steps=1,
               enable_prefix_caching=False)
    if not ctx.dry:
        _randomize(llm)
    prompt = list(range(100, ctx.sizes(132, 104)))
    steps = ctx.sizes(32, 3)
    if not ctx.dry:  # compiles the kernels
        list(llm.stream(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if not ctx.dry else [])
    _sync()
    with profile(activities=acts) as prof:
        start = time.perf_counter()
        list(llm.stream(prompt, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)))
        _sync()
        wall = time.perf_counter() - start
    events = [e for e in prof.events() if (e.device_type == torch.autograd.DeviceType.CUDA) != ctx.dry
              and not e.name.startswith(("Memcpy", "Memset"))]  # kernels (copies are not launches)
    if ctx.dry:  # the CPU ops at the top of their stacks stand in for the kernels
        events = [e for e in events if e.cpu_parent is None]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end_at = 0.0, None
    for a, b in spans:
        if end_at is None or a > end_at:
            busy += b - a
            end_at = b
        elif b > end_at:
            busy += b - end_at
            end_at = b
    busy_s = busy / 1e6
    top = {}
    for e in events:
        top[e.name] = top.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    heavy = sorted(top.items(), key=lambda kv: -kv[1])[:8]
    idle = max(0.0, 1 - busy_s / wall)
    return {"steps": steps, "wall_s": round(wall, 4), "busy_s": round(busy_s, 4), "idle_share": round(idle, 3),
            "launches_per_token": round(len(events) / steps, 1),
            "top": [{"name": n[:80], "ms": round(t / 1e3, 2)} for n, t in heavy],
            "summary": f"{steps} batch-1 steps of the {ctx.sizes('1.1B shape (bf16)', 'toy shape')}: "
                       f"{ctx.sizes('kernels', 'top-level CPU ops')} busy "
                       f"{busy_s / wall:.0%} of {wall * 1e3 / steps:.2f} ms a token, idle {idle:.0%}; "
                       f"{len(events) / steps:.0f} launches a token"}


def stages(models) -> dict:
    """Name -> (function of ctx, budget in seconds on a GPU, in a dry run), in the order they run:
    correctness first, then the figures the GPU issue asks for, the broad test files, the rest."""
    out = {"env": (stage_env, 60, 60), "kernels": (stage_kernels, 120, 240)}
    for name in models:
        out[f"logits_{name}"] = (lambda c, n=name: stage_logits(c, n), 90, 240)
        out[f"greedy_{name}"] = (lambda c, n=name: stage_greedy(c, n), 90, 240)
        out[f"batched_{name}"] = (lambda c, n=name: stage_batched(c, n), 60, 240)
    for key, (shape, ft) in DECODES.items():
        out[key] = (lambda c, s=shape, f=ft: stage_decode(c, s, f), 120 if "8b" in key else 75, 240)
    out["cuda_tests"] = (stage_cuda_tests, 120, 30)
    out["idle"] = (stage_idle, 60, 240)
    out["throughput"] = (stage_throughput, 90, 240)
    out["graphs"] = (stage_graphs, 30, 30)
    return out
