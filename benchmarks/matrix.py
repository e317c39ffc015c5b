"""The performance matrix: Minerva and llama.cpp on every packed type at real shapes, each
engine in its own process, alternating, written as one generated page per machine.

    python benchmarks/matrix.py                         # every file below, 2 rounds
    python benchmarks/matrix.py --only 1.1b:Q4_0,1.1b:Q4_K_M --rounds 3
    python benchmarks/matrix.py --list                  # the files, made or not
    python benchmarks/matrix.py --only 7b:Q4_0 --update  # measure one again, keep the page's others

Files (random weights in the real shapes, `benchmarks/synthetic.py` and
`synthetic_gpt_oss.py`, made on first use under `~/.cache/minerva/synthetic/`): the
TinyLlama-1.1B shape in every llama.cpp type the int8 kernels take (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K), the Mistral-7B shape in Q4_0, Q4_K_M and Q8_0,
and the GPT-OSS-20B shape (MXFP4 experts).

For each file and round each engine runs in a process of its own (two engines' thread pools in
one process fight over the same cores), the one going first alternating from round to round,
each right after a fresh process probes the machine's read bandwidth: a prefill of `--prompt`
random tokens (tokens/s) and a decode of `--gen` tokens after a 16-token prompt (batch 1). The
page gives the medians, the ratio of the medians, and each decode's share of the probed
bandwidth (weight bytes a token reads, as `minerva roofline` counts them, times tokens/s,
over the probe taken just before that run; the median of the rounds' shares): what neither
engine can pass on this machine. On a shared host the bandwidth moves from minute to minute;
a probe beside each run keeps a slow minute from counting against the engine that ran in it.

The page goes to `docs/performance/MACHINE.md` with its JSON beside it (`--out DIR`), named
after the CPU, its family and model, and its widest vector build; a later run on the same
kind of machine replaces it; with `--update` only the files it measures, the others kept from
the page's JSON (the page names both runs); `--render PAGE.json` writes a page again from
its JSON, measuring nothing. Needs llama-cpp-python (`pip install -e '.[bench]'`).

`--isa avx2` measures the builds an AVX2 machine runs on a CPU with AVX-512: Minerva's AVX2
kernels (`MINERVA_ISA=avx2`) against a llama-cpp-python built without AVX-512 and installed
apart (`--llama-path DIR`, put first on llama.cpp's `PYTHONPATH`), on a page of its own; each
page names the SIMD features llama.cpp reports and the kernel build Minerva ran:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF" \
        pip install --no-deps --no-cache-dir --no-binary llama-cpp-python --target /opt/llama_avx2 \
            llama-cpp-python==0.3.36  # compiled: a wheel pip kept is the native build (refused)
    python benchmarks/matrix.py --isa avx2 --llama-path /opt/llama_avx2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from minerva.machine import machine  # noqa: E402

SYNTHETIC = Path(os.environ.get("MINERVA_HOME", Path.home() / ".cache" / "minerva")).expanduser() / "synthetic"
SHAPE_NAMES = {"1.1b": "tinyllama-1.1b", "7b": "mistral-7b"}
FILES = ([f"1.1b:{t}" for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K")]
         + [f"7b:{t}" for t in ("Q4_0", "Q4_K_M", "Q8_0")] + ["gpt-oss-20b:MXFP4"])
TARGET_DECODE, TARGET_PREFILL, TARGET_SHARE = 1.15, 1.5, 0.75
# a shape whose share of the probe has a target of its own: GPT-OSS's step pays routing and
# gathering outside the kernels
SHARE_TARGETS = {"gpt-oss-20b": 0.60}
MEMORY_BOUND = 0.85  # a decode share both engines reach: the page names those files as bound by memory


def path_of(spec: str) -> Path:
    shape, qtype = spec.split(":")
    if shape == "gpt-oss-20b":
        return SYNTHETIC / "gpt-oss-20b-MXFP4.gguf"
    return SYNTHETIC / f"{SHAPE_NAMES[shape]}-{qtype}.gguf"


def make(spec: str) -> Path:
    path = path_of(spec)
    if not path.exists():
        shape, qtype = spec.split(":")
        cmd = ([sys.executable, str(HERE / "synthetic_gpt_oss.py"), "-o", str(path)] if shape == "gpt-oss-20b" else
               [sys.executable, str(HERE / "synthetic.py"), SHAPE_NAMES[shape], "--type", qtype, "-o", str(path)])
        print(f"making {path.name}...", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return path


def child(args) -> dict:
    """One engine (or the probe) in this process: its figures as a dict."""
    if args.child == "probe":
        from minerva.bench.hardware import probe
        return {"bandwidth": probe(seconds=2.0, threads=args.threads).bandwidth}
    rng = random.Random(args.seed)
    if args.child == "minerva":
        from minerva.bench.measure import minerva_decode, minerva_prefill
        from minerva.bench.roofline import model_costs
        from minerva.kernels import native, tune
        from minerva.llm import LLM
        llm = LLM(args.model, threads=args.threads, kv_cache_memory=0.2,
                  max_num_batched_tokens=max(2048, args.prompt))
        vocab = min(llm.config.vocab_size, 32000)
        prompt, short = ([rng.randrange(1, vocab) for _ in range(n)] for n in (args.prompt, 16))
        minerva_prefill(llm, short)  # warm-up
        pp = minerva_prefill(llm, prompt)
        tg = minerva_decode(llm, [short], args.gen + 1)[0]
        costs = model_costs(llm.loaded, dtype=llm.dtype)
        out = {"pp": pp, "tg": tg, "bytes_per_token": costs.weight_bytes_read(1), "activations": llm.activations,
               "dtype": llm.dtype_name, "choices": tune.in_force()[0].split(":")[0],
               "build": native.chosen_isa(native.cpu_flags())[0] or "none"}
        llm.close()
        return out
    import llama_cpp

    from minerva.bench.peers import load_peer
    peer = load_peer("llama.cpp", Path(args.model), args.threads, n_ctx=args.prompt + args.gen + 64)
    vocab = 32000
    prompt, short = ([rng.randrange(1, vocab) for _ in range(n)] for n in (args.prompt, 16))
    peer.prefill(short, 0)  # warm-up
    out = {"pp": peer.prefill(prompt, 0), "tg": peer.decode(short, args.gen), "version": llama_cpp.__version__,
           "simd": simd_features(llama_cpp.llama_print_system_info().decode(errors="replace"))}
    peer.close()
    return out


SIMD = ("AVX", "AVX2", "AVX_VNNI", "FMA", "F16C", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_INT8")


def simd_features(system_info: str) -> str:
    """The x86 vector features llama.cpp's system info says its build uses ("AVX2 FMA F16C")."""
    on = set(re.findall(r"(\w+) = 1", system_info))
    return " ".join(f for f in SIMD if f in on) or "none"


def child_env(kind: str, args) -> dict:
    """The environment of an engine's process: Minerva's kernel build (--isa), llama.cpp's
    install (--llama-path) first on the path."""
    env = dict(os.environ)
    if kind == "minerva" and args.isa:
        env["MINERVA_ISA"] = args.isa
    if kind == "llama.cpp" and args.llama_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(args.llama_path), env.get("PYTHONPATH")) if p)
    return env


def peer_simd(args) -> str:
    """The SIMD features of the llama.cpp the runs would load (simd_features), asked in its own
    process, with its environment; "" where it cannot be loaded."""
    ask = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode(errors='replace'))"
    done = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, timeout=120,
                          env=child_env("llama.cpp", args))
    return simd_features(done.stdout) if done.returncode == 0 else ""


def run_child(kind: str, path: Path, args, seed: int) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--model", str(path), "--prompt", str(args.prompt),
           "--gen", str(args.gen), "--threads", str(args.threads), "--seed", str(seed)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=child_env(kind, args))
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"{kind} exited {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def measure(spec: str, args) -> dict:
    path = make(spec)
    rounds = []
    for r in range(args.rounds):
        one = {}
        order = ("minerva", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "minerva")
        for kind in order:
            one[f"probe:{kind}"] = run_child("probe", path, args, r)
            one[kind] = run_child(kind, path, args, r)
        rounds.append(one)
        print(f"{spec} round {r + 1}: " + ", ".join(
            (f"{k} pp {v['pp']:.1f} tg {v['tg']:.2f}" if "pp" in v else f"{k} {v.get('error', '')}")
            + f" (probe {one[f'probe:{k}'].get('bandwidth', 0) / 1e9:.1f} GB/s)" for k in order for v in [one[k]]),
            file=sys.stderr, flush=True)
    return {"file": spec, "path": str(path), "bytes": path.stat().st_size, "rounds": rounds}


def _median(rounds: list[dict], engine: str, key: str) -> float | None:
    vals = [r[engine][key] for r in rounds if key in r.get(engine, {})]
    return statistics.median(vals) if vals else None


def summary(result: dict) -> dict:
    rs = result["rounds"]
    m_tg, l_tg = _median(rs, "minerva", "tg"), _median(rs, "llama.cpp", "tg")
    m_pp, l_pp = _median(rs, "minerva", "pp"), _median(rs, "llama.cpp", "pp")
    probes = [v["bandwidth"] for r in rs for k, v in r.items() if k.startswith("probe") and "bandwidth" in v]
    per_token = _median(rs, "minerva", "bytes_per_token")
    errors = sorted({v["error"] for r in rs for v in r.values() if "error" in v})
    return {"file": result["file"], "minerva_tg": m_tg, "llama_tg": l_tg, "tg_ratio": m_tg / l_tg if m_tg and l_tg else None,
            "minerva_share": _share(rs, "minerva", per_token), "llama_share": _share(rs, "llama.cpp", per_token),
            "minerva_pp": m_pp, "llama_pp": l_pp, "pp_ratio": m_pp / l_pp if m_pp and l_pp else None,
            "bandwidth": statistics.median(probes) if probes else None, "errors": errors}


def _share(rounds: list[dict], engine: str, per_token: float | None) -> float | None:
    """The median over the rounds of an engine's decode bytes/s over the probe taken before it
    (runs of an earlier version of this script: the round's one probe)."""
    shares = []
    for r in rounds:
        bw = r.get(f"probe:{engine}", r.get("probe", {})).get("bandwidth")
        tg = r.get(engine, {}).get("tg")
        if tg and bw and per_token:
            shares.append(tg * per_token / bw)
    return statistics.median(shares) if shares else None


def _f(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def share_target(file: str) -> float:
    return SHARE_TARGETS.get(file.split(":")[0], TARGET_SHARE)


def this_host() -> dict:
    host = machine()
    return {"cpu": host.cpu, "machine": host.describe(), "kind": cpu_kind(), "date": datetime.date.today().isoformat()}


def page(results: list[dict], args, command: str, kept: list[dict] = (), host: dict | None = None) -> str:
    """The page; `kept`: earlier runs (command, date, files) whose results it keeps; `host`: the
    machine and date it names (this_host()'s keys; default this machine, today)."""
    host = host or this_host()
    rows = [summary(r) for r in results]
    builds = f", {args.isa.upper()} builds" if getattr(args, "isa", None) else ""
    # runs of an earlier version of this script took one probe a round
    probes = ("each run right after a bandwidth probe of its own (a decode's share: over that probe, median of the rounds)"
              if any(k.startswith("probe:") for r in results for one in r["rounds"] for k in one)
              else "each round after a bandwidth probe")
    lines = [f"# {host['cpu']} ({host['kind']}){builds}", "",
             "Generated by `benchmarks/matrix.py`; do not edit by hand.", "",
             f"- machine: {host['machine']}, {host['kind']}",
             f"- date: {host['date']}",
             f"- command: `{command}`",
             *(f"- kept from an earlier run, `{k['command']}` ({k['date']}): {', '.join(k['files'])}" for k in kept),
             f"- each engine in its own process, alternating, {args.rounds} rounds, {probes}; medians; {args.threads} "
             f"threads; prefill of {args.prompt} random tokens, decode of {args.gen} tokens at batch 1",
             f"- llama.cpp: llama-cpp-python {_llama_setup(results)}; Minerva: its defaults ({_minerva_setup(results)})",
             "",
             f"| file | decode tok/s Minerva | llama.cpp | ratio | Minerva % of probed bandwidth | "
             f"llama.cpp % | pp{args.prompt} Minerva | llama.cpp | ratio | probe GB/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in rows:
        lines.append(f"| {s['file']} | {_f(s['minerva_tg'], '.2f')} | {_f(s['llama_tg'], '.2f')} | "
                     f"{_f(s['tg_ratio'], '.2f')}× | {_f(s['minerva_share'], '.0%')} | {_f(s['llama_share'], '.0%')} | "
                     f"{_f(s['minerva_pp'], '.1f')} | {_f(s['llama_pp'], '.1f')} | {_f(s['pp_ratio'], '.2f')}× | "
                     f"{_f(s['bandwidth'] and s['bandwidth'] / 1e9, '.1f')} |")
    missed = [s for s in rows if s["tg_ratio"] is not None and (
        s["tg_ratio"] < TARGET_DECODE or (s["pp_ratio"] or 0) < TARGET_PREFILL
        or (s["minerva_share"] or 0) < share_target(s["file"]))]
    own = "; ".join(f"{shape} shape: {v:.0%}, its routing and gathering included" for shape, v in SHARE_TARGETS.items())
    lines += ["", f"Targets: decode ≥ {TARGET_DECODE}× llama.cpp and ≥ {TARGET_SHARE:.0%} of the probed bandwidth "
              f"({own}), prefill ≥ {TARGET_PREFILL}×. " + (
                  "Not met here: " + ", ".join(s["file"] for s in missed) + "." if missed else "All met here.")]
    bound = [s["file"] for s in rows if min(s["minerva_share"] or 0, s["llama_share"] or 0) >= MEMORY_BOUND]
    if bound:
        lines += ["", f"Decode at the memory bound for both engines (each at {MEMORY_BOUND:.0%} or more of its probe): "
                  + ", ".join(bound) + ". Both read the same weights a token, so there the ratio cannot pass "
                  "the ratio of their shares, whatever the kernels."]
    errors = [f"- {s['file']}: {e}" for s in rows for e in s["errors"]]
    if errors:
        lines += ["", "Runs that failed:", *errors]
    return "\n".join(lines) + "\n"


def merge(earlier: dict | None, results: list[dict]) -> tuple[list[dict], list[dict]]:
    """This run's results with those of `earlier` (a page's JSON) for the files it did not
    measure, in the list's order, and the earlier runs they come from (command, date, files)."""
    measured = {r["file"] for r in results}
    others = [r for r in (earlier or {}).get("results", []) if r["file"] not in measured]
    if not others:
        return results, []
    kept = [{**k, "files": [f for f in k["files"] if f not in measured]} for k in earlier.get("kept", [])]
    kept = [k for k in kept if k["files"]]
    first = [r["file"] for r in others if not any(r["file"] in k["files"] for k in kept)]
    if first:
        kept.insert(0, {"command": earlier["command"], "date": earlier["date"], "files": first})
    order = {f: i for i, f in enumerate(FILES)}
    return sorted(results + others, key=lambda r: order.get(r["file"], len(order))), kept


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) and isinstance(data.get("results"), list) else None
    except (OSError, ValueError):
        return None


def _runs(results: list[dict], engine: str) -> list[dict]:
    return [v for r in results for one in r["rounds"] for k, v in one.items() if k == engine and "tg" in v]


def _minerva_setup(results: list[dict]) -> str:
    seen = sorted({(f"{v['build']} kernels, " if "build" in v else "")
                   + f"{v['dtype']}, {v['activations']} activations, kernel choices {v['choices']}"
                   for v in _runs(results, "minerva")})
    return "; ".join(seen) or "no run finished"


def _llama_setup(results: list[dict]) -> str:
    """The version and SIMD features each llama.cpp run reported (runs of an earlier version of
    this script reported neither: the installed version)."""
    seen = sorted({f"{v['version']} (its build: {v['simd']})" for v in _runs(results, "llama.cpp") if "version" in v})
    if seen:
        return "; ".join(seen)
    try:
        import importlib.metadata
        return importlib.metadata.version("llama-cpp-python")
    except Exception:
        return "not installed"


def cpu_kind() -> str:
    family = model = ""
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "cpu family" and not family:
            family = value.strip()
        elif key == "model" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    isa = ("AVX-512" + (" VNNI" if "avx512_vnni" in flags else "") + (" AMX" if "amx_int8" in flags else "")
           if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2")
    return f"family {family} model {model}, {isa}"


def render(data: dict) -> str:
    """The page of a JSON this script wrote, with its machine, date and settings (those of an
    earlier version's JSON, which kept none, from its command and results)."""
    def option(name: str, default: int) -> int:
        found = re.search(rf"--{name}[ =](\d+)", data["command"])
        return int(found.group(1)) if found else default
    cores = re.search(r"\((\d+) cores", data["machine"])
    args = argparse.Namespace(
        isa=data.get("isa"), rounds=data.get("rounds") or max(len(r["rounds"]) for r in data["results"]),
        threads=data.get("threads") or option("threads", int(cores.group(1)) if cores else 0),
        prompt=data.get("prompt") or option("prompt", 512), gen=data.get("gen") or option("gen", 32))
    host = {"cpu": data.get("cpu") or data["machine"].split(" (")[0], "machine": data["machine"], "kind": data["kind"],
            "date": data["date"]}
    return page(data["results"], args, data["command"], data.get("kept", []), host)


def slug(isa: str | None = None) -> str:
    text = f"{machine().cpu} {cpu_kind()}" + (f" {isa} builds" if isa else "")
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="comma-separated files of the list (e.g. 1.1b:Q4_0,7b:Q4_K_M)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--timeout", type=float, default=1800, help="seconds one engine's run may take")
    p.add_argument("--out", type=Path, default=HERE.parent / "docs" / "performance")
    p.add_argument("--isa", choices=("avx2", "avx512"), default=None,
                   help="Minerva's kernel build (MINERVA_ISA); the page is named after it")
    p.add_argument("--llama-path", type=Path, default=None,
                   help="a folder holding llama-cpp-python (pip install --target), first on llama.cpp's path")
    p.add_argument("--list", action="store_true")
    p.add_argument("--update", action="store_true",
                   help="keep the results of the files this run does not measure from the page's JSON")
    p.add_argument("--render", type=Path, default=None, metavar="JSON",
                   help="write a page again from its JSON (after a change to the page's form), measuring nothing")
    p.add_argument("--child", choices=("probe", "minerva", "llama.cpp"), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.threads = args.threads or machine().physical_cores
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    if args.render:
        data = _read(args.render)
        if data is None:
            p.error(f"--render {args.render}: not a page's JSON that benchmarks/matrix.py wrote")
        out = args.render.with_suffix(".md")
        out.write_text(render(data))
        print(f"written: {out}", file=sys.stderr)
        return 0
    specs = FILES if args.only is None else [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in specs if s not in FILES]
    if unknown:
        p.error(f"not in the list: {', '.join(unknown)}; --list shows it")
    if args.list:
        for s in specs:
            print(f"{s:22} {path_of(s)} {'(made)' if path_of(s).exists() else ''}")
        return 0
    if args.rounds < 1 or args.prompt < 1 or args.gen < 1:
        p.error("--rounds, --prompt and --gen must be at least 1")
    if args.llama_path and not (args.llama_path / "llama_cpp").is_dir():
        p.error(f"--llama-path {args.llama_path} holds no llama_cpp package; install one there with "
                "pip install --target DIR llama-cpp-python")
    if args.isa == "avx2" and "AVX512" in peer_simd(args).split():
        p.error(f"--isa avx2 measures against a llama.cpp built without AVX-512, but the one on the path "
                f"({args.llama_path or 'installed'}) uses it; build one apart with CMAKE_ARGS=\"-DGGML_NATIVE=OFF "
                "-DGGML_AVX512=OFF\" pip install --no-cache-dir --no-binary llama-cpp-python --target DIR "
                "llama-cpp-python and pass --llama-path DIR (a wheel pip kept would be the native build)")
    command = "python benchmarks/matrix.py " + " ".join(sys.argv[1:])
    name = slug(args.isa)
    earlier = _read(args.out / f"{name}.json") if args.update else None
    results, kept = merge(earlier, [measure(s, args) for s in specs])
    args.out.mkdir(parents=True, exist_ok=True)
    text = page(results, args, command.strip(), kept)
    (args.out / f"{name}.md").write_text(text)
    (args.out / f"{name}.json").write_text(json.dumps(
        {**this_host(), "isa": args.isa, "rounds": args.rounds, "threads": args.threads, "prompt": args.prompt,
         "gen": args.gen, "command": command.strip(), "kept": kept, "results": results,
         "summary": [summary(r) for r in results]}, indent=1) + "\n")
    print(text)
    print(f"written: {args.out / (name + '.md')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
