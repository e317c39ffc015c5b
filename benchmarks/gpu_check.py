"""One prepared check of Minerva's CUDA path: correctness and speed in a single short call.

    python benchmarks/gpu_check.py --pack .gpu-pack      # here, beforehand: wheels and the real models, cut
    python3 benchmarks/gpu_check.py --from .gpu-pack     # on the GPU machine, .gpu-pack carried along
    python benchmarks/gpu_check.py --dry-run --out DIR   # on a CPU: every stage at toy sizes

`--pack DIR` fills DIR (an ignored path, at most 60 MiB: a device call carries 64 MiB with the
tree) with the wheels of the packages the GPU machine lacks (`--fetch-wheels DIR` alone does
just that) and the two pulled models cut to their first layers and tokens (`CUTS`), real
weights otherwise. `--model NAME=PATH` checks any other model file.

On the GPU machine (its own PyTorch and Triton, no package index) it first installs what is
missing: each wheel of `--wheels` whose package does not import there (never torch or triton),
then Minerva itself (`pip install --no-deps -e .`). Then it runs the stages below, each in a
process of its own with its own time budget, so that a stage that fails, hangs or breaks the
CUDA context costs only itself; every stage is reported, also after an earlier one failed:

- env: the GPU, the versions, and the HBM bandwidth measured by a device-to-device copy;
- cuda_tests: the test files that run on a GPU when there is one (the Triton kernels, the
  backend ops, paged attention, the reference dequantization on CUDA);
- kernels: the Triton matmul of every packed type at real shapes against a float64 matmul of the
  reference dequantization (`formats/quant.py`), with each one-row call's time and GB/s;
- logits_NAME, greedy_NAME, batched_NAME for each model: its logits on CUDA (Triton kernels,
  float32) against the CPU float32 reference path (within 1e-3 of the largest logit), greedy
  ids on CUDA against the CPU's, and a batch of prompts against each prompt alone;
- decode_*: batch-1 decode tokens/s and the share of the measured bandwidth it reaches, for the
  TinyLlama-1.1B shape in bf16, Q4_0 and Q4_K_M and the Llama-3-8B shape in bf16 (random
  weights: packed files written by benchmarks/synthetic.py, float ones drawn on the GPU);
- throughput: 256 requests at once on the 1.1B shape, output tokens/s;
- graphs: decode with CUDA graphs on and off (the runner has no CUDA-graph path yet: reported so);
- idle: where a batch-1 decode step's time goes (a torch profiler trace: GPU busy time, the gaps
  between kernels, launches per token).

It writes `gpu_check.json` and `gpu_check.md` to `--out` (default `$OUT`, else ./gpu-check) and
prints the markdown. `--dry-run` runs the same stages on the CPU at toy sizes, the Triton kernels
through Triton's interpreter and the CUDA tests skipped, so the script is tested in every run of
the suite (tests/bench/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # minerva and tests.helpers from this checkout

from gpu_stages import Ctx, stages  # noqa: E402  (beside this file)

# The packages Minerva imports that the GPU machine's image lacks (the device tool's package
# list), as pip names them, with what they need in turn; --fetch-wheels downloads them at the
# versions pyproject.toml asks for, and the install takes only those that do not import there.
WHEELS = ("gguf", "llguidance", "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types",
          "typing-inspection", "uvicorn")
NEVER = ("torch", "triton")  # the machine's own builds stay
IMPORT_NAMES = {"pyyaml": "yaml"}  # where a module's name is not the project's with "_" for "-"
WHEEL_PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
                   "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                   "manylinux2014_x86_64", "manylinux1_x86_64", "any")
WHEELS_LIMIT = 40 << 20


# -------------------------------------------------------------------- running them

def run_stage(name: str, ctx_file: Path, result_file: Path) -> int:
    """In a child process: run one stage, write its result as JSON."""
    ctx = Ctx(json.loads(ctx_file.read_text()), result_file)
    if ctx.dry:
        from minerva.kernels.cuda.backend import TritonBackend
        TritonBackend.devices = ("cuda", "cpu")  # the Triton kernels under the interpreter, on the CPU
    fn = stages(ctx.models)[name][0]
    try:
        result = fn(ctx)
        result.setdefault("status", "passed")
    except Exception as exc:  # a stage's failure is its result
        result = {"status": "failed", "summary": f"{type(exc).__name__}: {str(exc)[:400]}",
                  "traceback": traceback.format_exc()[-3000:]}
    result_file.write_text(json.dumps(result, default=str))
    return 0


def stage_environment(dry: bool) -> dict:
    """The stages' environment: this checkout importable; the Triton interpreter in a dry run, and
    on the GPU machine the CPU reference path in torch alone (no C++ build there)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["TRITON_INTERPRET" if dry else "MINERVA_NO_NATIVE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_all(args, models: dict[str, str], env: dict) -> list[dict]:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    table = stages(models)
    chosen = args.stages or list(table)  # in the order asked
    ctx = {"dry": args.dry_run, "models": models, "work": str(work), "env": {}}
    deadline = args.started + args.deadline
    results = []
    for name in chosen:
        budget = table[name][2 if args.dry_run else 1]
        left = deadline - time.monotonic()
        if left < min(budget, 60) / 2:  # too little of its budget left to finish: left for a later call
            results.append({"stage": name, "status": "not run", "summary": f"{left:.0f} s were left before the "
                                                                          f"check's deadline, of its {budget} s budget"})
            continue
        limit = min(budget, left)
        ctx_file, result_file = work / "ctx.json", work / f"result-{name}.json"
        ctx_file.write_text(json.dumps({**ctx, "budget": limit}))
        result_file.unlink(missing_ok=True)
        start = time.monotonic()
        print(f"[gpu_check] {name} (budget {limit:.0f} s) ...", flush=True)
        try:
            proc = subprocess.run([sys.executable, __file__, "--run-stage", name, str(ctx_file), str(result_file)],
                                  env=env, cwd=ROOT, capture_output=True, text=True, timeout=limit)
            if result_file.exists():
                r = json.loads(result_file.read_text())
                if r.pop("partial", False):  # it ended before its last word: a crash, not a timeout
                    r.update(status="failed", summary=f"the stage's process ended with code {proc.returncode} "
                                                      f"before it finished; {r.get('summary', '')}",
                             stderr_tail=proc.stderr[-3000:])
            else:
                r = {"status": "failed", "summary": f"the stage's process ended with code {proc.returncode} "
                                                    "and no result", "stderr_tail": proc.stderr[-3000:]}
        except subprocess.TimeoutExpired as exc:
            r = json.loads(result_file.read_text()) if result_file.exists() else {}  # what it had so far
            r.pop("partial", None)
            r.update(status="timeout", summary=f"ran past its budget of {limit:.0f} s; " + r.get("summary", ""),
                     stderr_tail=(exc.stderr or b"")[-3000:].decode(errors="replace")
                     if isinstance(exc.stderr, bytes) else (exc.stderr or "")[-3000:])
        r["stage"], r["seconds"] = name, round(time.monotonic() - start, 1)
        results.append(r)
        print(f"[gpu_check] {name}: {r['status']} in {r['seconds']} s: {r.get('summary', '')}", flush=True)
        if name == "env" and r["status"] == "passed":
            ctx["env"] = {k: r.get(k) for k in ("bandwidth_gbs", "name")}
    return results


# -------------------------------------------------------------------------- reports

def markdown(report: dict) -> str:
    lines = [f"# Minerva GPU check: {report['machine']}", "",
             f"- {'dry run on the CPU (toy sizes, Triton interpreter)' if report['dry_run'] else 'on the GPU'}, "
             f"{report['date']}, commit {report['commit']}",
             f"- command: `{report['command']}`",
             f"- install: {report['install']}",
             f"- kernels that ran: {', '.join(sorted({r['kernels'] for r in report['stages'] if r.get('kernels')})) or 'none'}"
             " (asked for by name, `--kernels`; the CPU float32 reference beside them)", "",
             "| stage | status | seconds | result |", "| --- | --- | --- | --- |"]
    for r in report["stages"]:
        summary = str(r.get("summary", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['stage']} | {r['status']} | {r.get('seconds', '')} | {summary} |")
    kern = next((r for r in report["stages"] if r["stage"] == "kernels" and r.get("table")), None)
    if kern:
        lines += ["", "## Triton matmuls against a float64 matmul of the reference dequantization", "",
                  "| type | N x K | rows | float32 err | half err | one row us | GB/s |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for t in kern["table"]:
            errs = [v for k, v in t.items() if k.startswith("err_")]
            lines.append(f"| {t['type']} | {t['n']}x{t['k']} | {t['m']} | {errs[0]:.1e} | {errs[-1]:.1e} | "
                         f"{t.get('us', '')} | {t.get('gbs', '')} |")
    for r in report["stages"]:
        if r["status"] in ("failed", "timeout") and (r.get("traceback") or r.get("output_tail") or r.get("stderr_tail")):
            lines += ["", f"## {r['stage']}: {r['status']}", "", "```",
                      (r.get("traceback") or r.get("output_tail") or r.get("stderr_tail"))[-2500:], "```"]
    return "\n".join(lines) + "\n"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip() or "?"
    except OSError:
        return "?"


# -------------------------------------------------------------------------- install

def _imports(pip_name: str) -> bool:
    return importlib.util.find_spec(IMPORT_NAMES.get(pip_name, pip_name.replace("-", "_"))) is not None


def _wheel_project(path: Path) -> str:
    return path.name.split("-")[0].lower().replace("_", "-")


def missing_wheels(folder: Path) -> list[Path]:
    """The wheels in `folder` whose package does not import here (never torch or triton)."""
    return [w for w in sorted(folder.glob("*.whl")) if _wheel_project(w) not in NEVER and not _imports(_wheel_project(w))]


def install(wheels: Path | None, env: dict) -> str:
    """Install what the machine lacks: the wheels of packages that do not import here (into the
    interpreter's packages, else into a folder put on the stages' PYTHONPATH), then Minerva without
    its dependencies (else the stages import it from this checkout). Returns what was done."""
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--disable-pip-version-check"]
    done = []
    if wheels is not None and wheels.is_dir():
        missing = missing_wheels(wheels)
        names = ", ".join(_wheel_project(w) for w in missing) or "none missing"
        site = Path(tempfile.gettempdir()) / "minerva-gpu-site"
        for how in ([], ["--target", str(site)]):
            if not missing:
                break
            run = _quiet([*pip, *how, *map(str, missing)])
            if run is None:
                if how:
                    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
                break
            names += f" (pip install{' --target' if how else ''} failed: {run})"
        done.append("wheels: " + names)
    run = _quiet([*pip, "--no-build-isolation", "-e", str(ROOT)])
    done.append("minerva: pip install --no-deps -e ." if run is None else f"minerva from this checkout ({run})")
    return "; ".join(done)


def _quiet(cmd: list[str]) -> str | None:
    """Run cmd; None if it worked, else the last line it said."""
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return "no answer in 180 s"
    return None if run.returncode == 0 else (run.stderr.strip().splitlines() or ["exit %d" % run.returncode])[-1][-200:]


def _requirements() -> list[str]:
    """WHEELS with the version ranges pyproject.toml gives those it names."""
    import tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ranges = {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower(): d for d in deps}
    return [ranges.get(w, w) for w in WHEELS]


def fetch_wheels(folder: Path) -> int:
    """Download the wheels of WHEELS for the GPU machine's Python (3.12, x86-64 Linux)."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *[a for p in WHEEL_PLATFORMS for a in ("--platform", p)],
           "-d", str(folder), *_requirements()]
    run = subprocess.run(cmd)
    if run.returncode:
        print(f"error: pip download failed (code {run.returncode}); is the package index reachable?", file=sys.stderr)
        return 1
    for w in folder.glob("*.whl"):
        with zipfile.ZipFile(w) as z:
            z.testzip()
    total = sum(w.stat().st_size for w in folder.glob("*.whl"))
    print(f"{len(list(folder.glob('*.whl')))} wheels in {folder}: {total / 1e6:.1f} MB (limit {WHEELS_LIMIT / 1e6:.0f} MB)")
    if total > WHEELS_LIMIT:
        print("error: over the limit of what a device call carries beside the tree", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------- the pack: what one device call carries

# A device call carries 64 MiB with the tree, and the two real models are 98 and 253 MB: --pack
# cuts each to its first layers (Gemma 3's sixth is its first global-attention layer) and first
# tokens (the special ones among them), every kept tensor's bytes as in the model, so that both
# architectures and all their tensor types travel in one call beside the wheels.
CUTS = {"smollm2": ("smollm2-135m", 8, 12288), "gemma3": ("gemma3-270m", 6, 8192)}
PACK_LIMIT = 60 << 20


def cut_model(src: Path, dst: Path, layers: int, vocab: int) -> None:
    """Write `src`'s first `layers` layers and first `vocab` tokens (the embedding's and LM head's
    rows, the tokenizer cut as benchmarks/synthetic.py cuts one) to `dst`."""
    import gguf
    import numpy as np
    import synthetic
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    md = {k: f.contents() for k, f in r.fields.items()}
    count = md[f"{arch}.block_count"]
    if not 1 <= layers <= count or not 1 <= vocab <= len(md["tokenizer.ggml.tokens"]):
        raise SystemExit(f"error: cannot cut {src.name} ({count} layers) to {layers} layers and {vocab} tokens")
    tok = synthetic.fit_vocabulary(md, vocab)
    w = gguf.GGUFWriter(dst, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.description"):
            continue
        value = {f"{arch}.block_count": layers, f"{arch}.vocab_size": vocab}.get(key, tok.get(key, field.contents()))
        kind = field.types[0]
        w.add_key_value(key, value, kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    w.add_description(f"{src.name} cut by Minerva's benchmarks/gpu_check.py --pack: its first {layers} of "
                      f"{count} layers and first {vocab} tokens")
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        data = np.asarray(t.data)
        if t.name in ("token_embd.weight", "output.weight"):
            data = data[:vocab]
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def pack(folder: Path) -> int:
    """The wheels and the two cut real models in one folder for a device call (`--from`)."""
    from minerva.store import resolve
    if fetch_wheels(folder / "wheels"):
        return 1
    for name, (model, layers, vocab) in CUTS.items():
        cut_model(resolve(model), folder / f"{name}.gguf", layers, vocab)
    total = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(f"packed {folder}: {total / 1e6:.1f} MB (limit {PACK_LIMIT / 1e6:.0f} MB)")
    if total > PACK_LIMIT:
        print("error: the pack is over what one device call carries beside the tree", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- main

def parse_models(items: list[str]) -> dict[str, str]:
    models = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not re.fullmatch(r"[a-z0-9]+", name):
            raise SystemExit(f"error: --model takes NAME=PATH (NAME in lower-case letters and digits), got {item!r}")
        if not Path(path).is_file():
            raise SystemExit(f"error: --model {name}: {path} is not a file")
        if name in models:
            raise SystemExit(f"error: --model {name} is given twice")
        models[name] = str(Path(path).resolve())
    return models


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run-stage"]:
        return run_stage(argv[1], Path(argv[2]), Path(argv[3]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:5]))
    p.add_argument("--dry-run", action="store_true", help="every stage on the CPU at toy sizes (no GPU needed)")
    p.add_argument("--out", default=None, help="folder for gpu_check.json and gpu_check.md (default $OUT, else ./gpu-check)")
    p.add_argument("--model", action="append", default=[], metavar="NAME=PATH", help="a real model to check (repeatable)")
    p.add_argument("--wheels", type=Path, default=None, help="folder of wheels to install what the machine lacks")
    p.add_argument("--fetch-wheels", type=Path, default=None, metavar="DIR", help="download those wheels here, then exit")
    p.add_argument("--pack", type=Path, default=None, metavar="DIR",
                   help="here, beforehand: the wheels and the two real models cut to travel in one call, then exit")
    p.add_argument("--from", dest="pack_dir", type=Path, default=None, metavar="DIR",
                   help="on the GPU: take the wheels and every model (NAME.gguf) of a --pack folder")
    p.add_argument("--stages", default=None, help="comma-separated stages to run (default: all)")
    p.add_argument("--deadline", type=float, default=470.0,
                   help="seconds from the start, the install included, after which no stage starts (default 470)")
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "minerva-gpu-check"),
                   help="folder for the random-weight files (kept for the next run)")
    args = p.parse_args(argv)
    args.started = time.monotonic()
    if args.fetch_wheels is not None:
        return fetch_wheels(args.fetch_wheels)
    if args.pack is not None:
        return pack(args.pack)
    if args.pack_dir is not None:
        if not args.pack_dir.is_dir():
            print(f"error: --from {args.pack_dir}: no such folder; make it with --pack first", file=sys.stderr)
            return 2
        args.wheels = args.wheels or args.pack_dir / "wheels"
        args.model += [f"{m.stem}={m}" for m in sorted(args.pack_dir.glob("*.gguf"))]
    models = parse_models(args.model)
    if args.dry_run and not models:
        models = {"smollm2": "toy", "gemma3": "toy"}  # toy random-weight files stand in for them
    args.stages = args.stages.split(",") if args.stages else None
    unknown = set(args.stages or ()) - set(stages(models))
    if unknown:
        print(f"error: no stage {', '.join(sorted(unknown))}; the stages: {', '.join(stages(models))}", file=sys.stderr)
        return 2
    if not args.dry_run:
        import torch
        if not torch.cuda.is_available():
            print("error: no CUDA GPU here; run with --dry-run on a CPU", file=sys.stderr)
            return 2
    out = Path(args.out or os.environ.get("OUT") or "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    env = stage_environment(args.dry_run)
    how = "dry run: nothing installed" if args.dry_run else install(args.wheels, env)
    results = run_all(args, models, env)
    env = next((r for r in results if r["stage"] == "env"), {})
    report = {"machine": env.get("name", platform.node()), "dry_run": args.dry_run,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)), "commit": _commit(),
              "command": "python benchmarks/gpu_check.py " + " ".join(argv), "install": how,
              "seconds": round(time.time() - started, 1), "stages": results}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    text = markdown(report)
    (out / "gpu_check.md").write_text(text)
    sys.stdout.write(text)
    bad = [r["stage"] for r in results if r["status"] in ("failed", "timeout")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
