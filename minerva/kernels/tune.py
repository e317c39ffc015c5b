"""The kernel choices, measured on the machine they run on.

The int8 kernels (`csrc/q8_*.cpp`; their choices in `csrc/q8_cpu.h`) have knobs that change
no bit of a result, only how fast it comes. For one row of x (decode): how many regrouped
K-quant groups of 8 rows a work item takes (`groups`: 1, or 2 in one 512-bit register with
the AVX-512 build), how many groups of the 32-weight block types it streams side by side (1,
2 or 4) or, with AVX-512 VNNI, whether two share each 512-bit register (`pairs`: half the
instructions a weight, for a CPU that runs 512-bit operations whole), and how far ahead the
weights are prefetched into L2 (`l2_ahead`, bytes, 0 = none). For many rows, whether the
AVX-512 Q4_K/Q5_K tiles copy their rows of x side by side (`x_copy`); for a few (2 to 8: a
speculative verification, a handful of sequences), up to how many the 32-weight block types
take the one-row streams rather than panels (`few_rows`). The fastest depends on the CPU (the
prefetch that makes an Intel Xeon 1.27x faster makes a Zen 4 slower), so rather than guess
from the vendor the planner times them, as FFTW's planner and Triton's autotuner do:

- for each packed type and each setting, one row of x against matrices of the 1.1B shape's
  feed-forward sizes (5632 x 2048 and 2048 x 5632), as many as make three times the L3 cache
  (at least 96 MB, so they come from memory as in decode; at most 512 MB: a server's L3 of
  hundreds of MB is shared by all its cores, and 3 x 480 MB took 79 s to plan on an Intel
  Xeon), with the AVX-512 build 64 rows of x against one matrix for `x_copy`, and for
  `few_rows` 2, 4 and 8 rows both ways, the streams taken up to the largest count at which
  they were not slower there and at every smaller one;
- the L2 prefetch distance again for long rows (`l2_long`: 8192 columns or more; 4096 x 14336, a 7B down projection);
- the settings alternate round by round, each one's median sweep counting; a setting replaces
  the CPU's default only when it is more than `MARGIN` faster, so noise does not pick;
- each type's choice and measured bandwidth go into `choices.json` beside the kernel build
  (`native.build_dir()`): a build is planned once (well under a minute); `minerva tune` again.

`MINERVA_CHOICES=FILE` takes the choices from FILE (`minerva tune --out FILE` writes one);
`MINERVA_NO_TUNE=1` (`--no-tune`) keeps the CPU's fixed defaults. The knob that changes bits
(the Q4_K/Q5_K tiles' integer or float steps, `int_steps`) stays the CPU's documented default."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch

from minerva.errors import MinervaError, not_a_file
from minerva.kernels import hugepages, native, repack
from minerva.machine import machine

log = logging.getLogger("minerva")

Q = gguf.GGMLQuantizationType
# every type the int8 kernels multiply, in the order a table shows them
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
K_TYPES = frozenset({Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})
X_COPY_TYPES = frozenset({Q.Q4_K, Q.Q5_K})
# where each type's block keeps its fp16 scales (set to a small normal value, so random
# blocks decode to finite weights of a trained model's size) or its E8M0 exponent
FP16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q2_K: (80, 82),
               Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
E8M0_FIELDS = {Q.MXFP4: (0,)}
SHAPES = ((5632, 2048), (2048, 5632))  # (out, in): the 1.1B shape's gate/up and down projections
LONG_SHAPES = ((4096, 14336),)  # rows of LONG_ROWS (8192) columns or more: a 7B shape's down projection
LONG_ROUNDS = 5
MIN_STREAM_BYTES, MAX_STREAM_BYTES = 96 << 20, 512 << 20
L2_AHEAD = (0, 16384, 32768, 65536)
ROUNDS = 11
MARGIN = 0.03  # a setting other than the default must be this much faster to be chosen
# A plan during which this process ran less than this share of its threads' time (other work
# took the cores: a compile, another engine) is marked busy, and the next process's first use
# measures again, up to PLAN_TRIES plans in all (a machine that stays busy keeps the last)
BUSY_SHARE = 0.7
PLAN_TRIES = 3
MANY_ROWS = 64
FEW_ROWS = (2, 4, 8)  # rows of x the few-row path is timed at; its largest is the kernels' FEW_ROWS_MOST
FEW_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4})  # (not the K-quants)
FEW_ROUNDS = 5
FILE_NAME = "choices.json"
VERSION = 2


@dataclass(frozen=True)
class Setting:
    groups: int
    l2_ahead: int
    x_copy: int
    few_rows: int = FEW_ROWS[-1]
    l2_long: int | None = None  # the L2 prefetch distance for long rows (None: l2_ahead's)

    @property
    def long(self) -> int:
        return self.l2_ahead if self.l2_long is None else self.l2_long


_defaults: dict[int, list[int]] = {}  # the kernels' own choices per type, read before any is set
_applied: dict | None = None  # what `ensure` put in force: the planner's file, or None for defaults
_source = "not loaded"


def defaults(kernels, qtype: Q | None = None) -> list[int]:
    """The CPU's fixed choices for `qtype` (every type's as the build starts; None: Q4_K's):
    groups, L2 prefetch distance, x copy, int steps, few rows, L2 prefetch distance for long rows."""
    if not _defaults:
        _defaults.update({int(t): list(kernels.cpu_choices(None, int(t))) for t in TYPES})
    return list(_defaults[int(Q.Q4_K if qtype is None else qtype)])


def reset(kernels) -> None:
    """Every type back to the CPU's fixed choices."""
    for t in TYPES:
        kernels.cpu_choices(defaults(kernels, t), int(t))


def _set(kernels, qtype: Q, s: Setting) -> None:
    kernels.cpu_choices([s.groups, s.l2_ahead, s.x_copy, defaults(kernels, qtype)[3], s.few_rows, s.long],
                        int(qtype))


def _default_setting(kernels, qtype: Q) -> Setting:
    g, l2, xc, _, few, long = defaults(kernels, qtype)
    return Setting(g, l2, xc, few, None if long == l2 else long)


def _l3_bytes() -> int:
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text[:-1]) << (10 if text.endswith("K") else 20) if text[-1] in "KM" else int(text)
    except (OSError, ValueError, IndexError):
        return 32 << 20


def random_blocks(qtype: Q, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [rows, row bytes] of random blocks of `qtype` whose fp16 scales are small normal
    numbers: finite weights, no NaN, no subnormal (what the kernels' speed sees of a trained
    matrix; the values themselves do not matter to it)."""
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = torch.randint(0, 256, (rows * cols // per, size), dtype=torch.uint8, generator=gen)
    for off in FP16_FIELDS.get(qtype, ()):
        blocks[:, off:off + 2] = torch.tensor([0x1F, 0x21], dtype=torch.uint8)  # fp16 0.0101
    for off in E8M0_FIELDS.get(qtype, ()):
        blocks[:, off] = 120  # 2^-7
    return blocks.reshape(rows, -1)


@dataclass
class Matrix:
    packed: torch.Tensor  # as the int8 path keeps it: regrouped where the type has a layout for it
    qtype_id: int
    rows: int
    cols: int


def _matrices(kernels, qtype: Q, gen: torch.Generator, stream_bytes: int, shapes=None) -> list[Matrix]:
    """`stream_bytes` of matrices of `shapes` (`SHAPES`), alternating, in 2 MiB pages as the loader keeps them."""
    shapes = shapes or SHAPES
    firsts = {}
    for rows, cols in shapes:
        w = random_blocks(qtype, rows, cols, gen)
        if repack.applies(kernels, qtype) and qtype != Q.Q6_K:  # (Q6_K's units take no choice: its GGML layout's)
            firsts[rows, cols] = repack.regroup_in_place(w, qtype, rows, cols, kernels), int(qtype) | repack.REGROUPED
        else:
            firsts[rows, cols] = w, int(qtype)
    count, total = 0, 0
    while total < stream_bytes:
        total += firsts[shapes[count % len(shapes)]][0].numel()
        count += 1
    pages = hugepages.Pool(sum(hugepages.padded(firsts[shapes[i % len(shapes)]][0]) for i in range(count)))
    out = []
    for i in range(count):
        (w, qtype_id), (rows, cols) = firsts[shapes[i % len(shapes)]], shapes[i % len(shapes)]
        out.append(Matrix(pages.take(w), qtype_id, rows, cols))
    return out


def _sweep_seconds(kernels, matrices: list[Matrix], xs: dict) -> float:
    start = time.perf_counter()
    for m in matrices:
        kernels.qmatmul_q8(xs[m.cols], m.packed, m.qtype_id, m.rows, m.cols)
    return time.perf_counter() - start


def settings_one_row(kernels, qtype: Q) -> list[Setting]:
    """What the planner times for one row of x: the K-quants' groups (1, or 2 with the
    AVX-512 build; Q6_K 1: its GGML layout, the one it is timed in, takes two rows at a time
    whatever the groups, and its units of 16 rows take no choice) or the 32-weight types'
    streams (1, 2 or 4 groups side by side, and where the build has it two groups a 512-bit
    register, `kernels.x8_pairs`), each with every L2 prefetch distance."""
    d = _default_setting(kernels, qtype)
    pairs = getattr(kernels, "x8_pairs", 0)
    groups = (((1, 2) if native.built == "avx512" and qtype != Q.Q6_K else (1,)) if qtype in K_TYPES
              else (1, 2, 4) + ((pairs,) if pairs else ()))
    return [Setting(g, l2, d.x_copy, d.few_rows) for g in groups for l2 in L2_AHEAD]


def _alternating(kernels, qtype: Q, settings: list[Setting], matrices: list[Matrix], xs: dict, rounds: int,
                 step) -> dict[Setting, float]:
    """Each setting's median sweep over `matrices`, the settings taking turns round by round."""
    times: dict[Setting, list[float]] = {s: [] for s in settings}
    _sweep_seconds(kernels, matrices, xs)  # first touch: pages, caches
    for _ in range(rounds):
        for s in settings:
            _set(kernels, qtype, s)
            times[s].append(_sweep_seconds(kernels, matrices, xs))
        step()
    return {s: statistics.median(t) for s, t in times.items()}


def _pick(medians: dict[Setting, float], default: Setting) -> Setting:
    best = min(medians, key=medians.get)
    if default in medians and medians[default] <= medians[best] * (1 + MARGIN):
        return default
    return best


def _plan_type(kernels, qtype: Q, stream_bytes: int, rounds: int, step) -> dict:
    gen = torch.Generator().manual_seed(int(qtype))
    matrices = _matrices(kernels, qtype, gen, stream_bytes)
    nbytes = sum(m.packed.numel() for m in matrices)
    xs = {cols: torch.randn(1, cols, generator=gen) for _, cols in SHAPES}
    default = _default_setting(kernels, qtype)
    settings = settings_one_row(kernels, qtype)
    medians = _alternating(kernels, qtype, settings, matrices, xs, rounds, step)
    chosen = _pick(medians, default)
    x_copy = chosen.x_copy
    many = {}
    if native.built == "avx512" and qtype in X_COPY_TYPES:
        x = torch.randn(MANY_ROWS, matrices[0].cols, generator=gen)
        for xc in (0, 1):
            s = Setting(chosen.groups, chosen.l2_ahead, xc, chosen.few_rows)
            _set(kernels, qtype, s)
            _sweep_seconds(kernels, matrices[:1], {x.shape[1]: x})
            many[s] = statistics.median(
                _sweep_seconds(kernels, matrices[:1], {x.shape[1]: x}) for _ in range(rounds))
        x_copy = _pick(many, Setting(chosen.groups, chosen.l2_ahead, default.x_copy, chosen.few_rows)).x_copy
    chosen = Setting(chosen.groups, chosen.l2_ahead, x_copy, chosen.few_rows)
    few = []
    if qtype in FEW_TYPES and 2 <= chosen.groups <= 4:  # (the streams take work items of 2 groups or more)
        chosen, few = _plan_few_rows(kernels, qtype, chosen, matrices, gen, step)
    elif qtype in FEW_TYPES:
        for _ in FEW_ROWS:
            step()
    chosen, long_measured = _plan_long_rows(kernels, qtype, chosen, gen, step)
    return {"groups": chosen.groups, "l2_ahead": chosen.l2_ahead, "x_copy": chosen.x_copy,
            "few_rows": chosen.few_rows, "l2_ahead_long": chosen.long, "long_measured": long_measured,
            "gb_per_s": round(nbytes / medians[_pick(medians, default)] / 1e9, 2),
            "default_gb_per_s": round(nbytes / medians[default] / 1e9, 2) if default in medians else None,
            "measured": [{**vars(s), "gb_per_s": round(nbytes / m / 1e9, 2)} for s, m in medians.items()],
            "few_measured": few, "stream_bytes": nbytes}


def _plan_long_rows(kernels, qtype: Q, chosen: Setting, gen, step) -> tuple[Setting, list[dict]]:
    """The L2 prefetch distance for long rows, the rest as `chosen`, on `MIN_STREAM_BYTES` of
    `LONG_SHAPES` matrices: the short rows' stays unless another is `MARGIN` faster."""
    matrices = _matrices(kernels, qtype, gen, MIN_STREAM_BYTES, LONG_SHAPES)
    nbytes = sum(m.packed.numel() for m in matrices)
    xs = {cols: torch.randn(1, cols, generator=gen) for _, cols in LONG_SHAPES}
    settings = [Setting(chosen.groups, chosen.l2_ahead, chosen.x_copy, chosen.few_rows, l2) for l2 in L2_AHEAD]
    medians = _alternating(kernels, qtype, settings, matrices, xs, LONG_ROUNDS, step)
    best = _pick(medians, Setting(chosen.groups, chosen.l2_ahead, chosen.x_copy, chosen.few_rows, chosen.l2_ahead))
    return best, [{"l2_ahead": s.long, "gb_per_s": round(nbytes / m / 1e9, 2)} for s, m in medians.items()]


def _plan_few_rows(kernels, qtype: Q, chosen: Setting, matrices: list[Matrix], gen,
                   step=lambda: None) -> tuple[Setting, list]:
    """`few_rows` for `chosen`: each of FEW_ROWS rows of x against the matrices with the
    one-row streams (few rows at their most) and with panels (few rows 1), alternating; the
    streams are kept up to the largest count where they were not slower (by MARGIN) there
    and at every smaller count."""
    on, off = (Setting(chosen.groups, chosen.l2_ahead, chosen.x_copy, f) for f in (FEW_ROWS[-1], 1))
    measured, few = [], 1
    for i, rows in enumerate(FEW_ROWS):
        xs = {cols: torch.randn(rows, cols, generator=gen) for cols in {m.cols for m in matrices}}
        times = {on: [], off: []}
        for _ in range(FEW_ROUNDS):
            for s in (on, off):
                _set(kernels, qtype, s)
                times[s].append(_sweep_seconds(kernels, matrices, xs))
        t_on, t_off = statistics.median(times[on]), statistics.median(times[off])
        measured.append({"rows": rows, "streams_ms": round(t_on * 1e3, 2), "panels_ms": round(t_off * 1e3, 2)})
        step()
        if few == (FEW_ROWS[i - 1] if i else 1) and t_on <= t_off * (1 + MARGIN):
            few = rows
    chosen = Setting(chosen.groups, chosen.l2_ahead, chosen.x_copy, few)
    _set(kernels, qtype, chosen)
    return chosen, measured


def plan(kernels, rounds: int | None = None, types=None, progress: bool = True) -> dict:
    """Time every setting for every type (module docstring) and return the choices file's
    contents; the kernels are left with the chosen settings in force."""
    from tqdm import tqdm
    rounds, types = rounds or ROUNDS, types or TYPES
    stream = min(MAX_STREAM_BYTES, max(MIN_STREAM_BYTES, 3 * _l3_bytes()))
    started, cpu_started = time.perf_counter(), _cpu_seconds()
    result = {}
    total = len(types) * (rounds + LONG_ROUNDS) + len(FEW_ROWS) * len(FEW_TYPES & set(types))
    with tqdm(total=total, desc="planning kernel choices", unit="round", disable=not progress, leave=False) as bar:
        for qtype in types:
            bar.set_postfix_str(qtype.name)
            result[qtype.name] = _plan_type(kernels, qtype, stream, rounds, lambda: bar.update(1))
            c = result[qtype.name]
            _set(kernels, qtype, Setting(c["groups"], c["l2_ahead"], c["x_copy"], c["few_rows"], c["l2_ahead_long"]))
    wall, threads = time.perf_counter() - started, torch.get_num_threads()
    share = (_cpu_seconds() - cpu_started) / (wall * threads) if wall > 0 else 1.0
    return {"version": VERSION, "build": native.built, "cpu": machine().cpu, "threads": threads,
            "made": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(wall, 1), "rounds": rounds,
            "int_steps": defaults(kernels)[3],
            "cpu_share": round(share, 2), "busy": share < BUSY_SHARE,
            "types": result}


def _cpu_seconds() -> float:
    return time.process_time()  # every thread's, the kernels' pool included


def busy_note(data: dict) -> str | None:
    """What to say of a plan measured while other work took the cores (`busy`), else None."""
    if not data.get("busy"):
        return None
    return (f"the machine was busy while the kernel choices were measured (this process ran "
            f"{data.get('cpu_share', 0):.0%} of its {data.get('threads')} threads' time), so they may be off; "
            "run `minerva tune` when it is quiet")


def _whole(c: dict, key: str, default=None) -> int:
    """A choice: a whole number in [0, 2^31), or (missing) `default`."""
    v = c.get(key, default)
    if v is None:
        raise ValueError(f"no {key}")
    whole = int(v) if isinstance(v, float) and v.is_integer() else v
    if isinstance(whole, bool) or not isinstance(whole, int) or not 0 <= whole < 1 << 31:
        raise ValueError(f"{key} is {v!r}, not a whole number in [0, 2^31)")
    return whole


WRITE_ONE = "write one with `minerva tune --out FILE`"  # a file the user names: what to do if it is no good


def check(kernels, data, where: str, remedy: str = WRITE_ONE) -> dict[Q, Setting]:
    """A choices file's settings by type (and the figures a table shows, numbers); a file that is
    not a choices file, or an entry that is not valid, is an error naming `where` and `remedy`."""
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("types"), dict):
        raise MinervaError(f"{where} is not a Minerva kernel choices file (version {VERSION}); {remedy}")
    settings = {}
    for name, c in data["types"].items():
        if name not in {t.name for t in TYPES}:
            raise MinervaError(f"{where}: {name!r} is not a type the int8 kernels multiply")
        qtype = getattr(Q, name)
        try:
            if not isinstance(c, dict):
                raise ValueError(f"{type(c).__name__}, not an object")
            for key in ("gb_per_s", "default_gb_per_s"):
                if c.get(key) is not None and (isinstance(c[key], bool) or not isinstance(c[key], (int, float))):
                    raise ValueError(f"{key} is {c[key]!r}, not a number")
            settings[qtype] = Setting(_whole(c, "groups"), _whole(c, "l2_ahead"), _whole(c, "x_copy"),
                                      _whole(c, "few_rows", defaults(kernels, qtype)[4]),
                                      _whole(c, "l2_ahead_long", c.get("l2_ahead")))
        except ValueError as exc:
            raise MinervaError(f"{where}: the choices for {name} are not valid ({exc}); {remedy}") from None
    return settings


def apply(kernels, data: dict, where: str) -> None:
    """Put a choices file's settings in force, type by type; a file for another build, or
    not a choices file (`check`), is an error naming it."""
    settings = check(kernels, data, where)
    if data.get("build") != native.built:
        raise MinervaError(f"{where} holds choices for the {data.get('build')} kernel build, this CPU runs the "
                           f"{native.built} build; write one here with `minerva tune --out FILE`")
    for qtype, setting in settings.items():
        try:
            _set(kernels, qtype, setting)
        except (RuntimeError, TypeError) as exc:  # a value the kernels refuse (their message: its first line)
            raise MinervaError(f"{where}: the choices for {qtype.name} are not valid "
                               f"({str(exc).strip().splitlines()[0]}); "
                               "write the file again with `minerva tune --out FILE`") from None


def choices_path() -> Path | None:
    build = native.build_dir()
    return build / FILE_NAME if build is not None else None


@contextlib.contextmanager
def _lock(path: Path):
    """One planner at a time per build (tensor-parallel workers, test processes)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path.with_suffix(".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_pinned(path: Path, where: str, remedy: str = WRITE_ONE) -> dict:
    """A choices file the user named (MINERVA_CHOICES, `tune --show --out`), or the build's
    (`tune --show`), read, or an error saying what it is instead and `remedy`."""
    data = _read(path)
    if data is None:
        what = "not a JSON file of kernel choices" if path.is_file() else f"'{path}' {not_a_file(path)}"
        raise MinervaError(f"{where}: {what}; {remedy}")
    return data


def save(data: dict, path: Path) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def ensure(kernels) -> None:
    """Once a process, as the CPU backend loads: the choices of MINERVA_CHOICES, else those
    planned for this build (planning them first where there are none), else, with
    MINERVA_NO_TUNE, the CPU's defaults."""
    global _applied, _source
    if _source != "not loaded" or kernels is None or not hasattr(kernels, "cpu_choices"):
        return
    defaults(kernels)
    pinned = os.environ.get("MINERVA_CHOICES", "").strip()
    if pinned:
        data = read_pinned(Path(pinned).expanduser(), f"MINERVA_CHOICES={pinned}")
        apply(kernels, data, f"MINERVA_CHOICES={pinned}")
        _applied, _source = data, f"pinned: {pinned}"
        return
    if os.environ.get("MINERVA_NO_TUNE", "").strip() not in ("", "0"):
        _source = "fixed defaults (MINERVA_NO_TUNE)"
        return
    path = choices_path()
    if path is None:
        _source = "fixed defaults (no kernel build directory)"
        return
    with _lock(path):
        data = _read(path)
        stale = not isinstance(data, dict) or data.get("version") != VERSION or data.get("build") != native.built
        again = not stale and data.get("busy") and data.get("tries", 1) < PLAN_TRIES
        if stale or again:
            log.warning("measuring this CPU's kernel choices (%s, well under a minute; "
                        "--no-tune or MINERVA_NO_TUNE=1 skips it)...",
                        "again: the machine was busy the last time" if again else "once per kernel build")
            tries = data.get("tries", 1) + 1 if again else 1
            data = plan(kernels)
            data["tries"] = tries
            try:
                save(data, path)
            except OSError as exc:  # in force in this process all the same
                log.warning("the kernel choices could not be kept at %s (%s); they are measured again next time",
                            path, exc.strerror or exc)
            if data["busy"]:
                log.warning("%s%s", busy_note(data),
                            "" if tries >= PLAN_TRIES else " (the next process measures them again)")
    try:
        apply(kernels, data, str(path))
    except MinervaError as exc:  # a damaged file beside the build: plan again next time
        log.warning("%s; using the fixed defaults", exc)
        path.unlink(missing_ok=True)
        _source = "fixed defaults (damaged choices file removed)"
        return
    _applied, _source = data, f"planned: {path}"


def in_force() -> tuple[str, dict | None]:
    """Where the choices in force came from, and the file's contents (None: the defaults)."""
    return _source, _applied


def table(data: dict, bandwidth: float | None = None) -> list[str]:
    """One line per type: the setting chosen, the one-row bandwidth it streamed at (and with
    the CPU's defaults), and with `bandwidth` (bytes/s, a probe's) the share of it."""
    share = bandwidth is not None
    lines = [f"{'type':6} {'groups':>6} {'L2 ahead':>9} {'long rows':>9} {'x copy':>6} {'few rows':>8} {'GB/s':>7} "
             f"{'default':>8}" + ("  of probe" if share else "")]
    for name, c in data["types"].items():  # (`check`ed: a hand-written file may lack the figures)
        gb, d = c.get("gb_per_s"), c.get("default_gb_per_s")
        groups = "pairs" if c["groups"] > 4 else c["groups"]  # (X8_PAIRS: two groups a 512-bit register)
        lines.append(f"{name:6} {groups:>6} {c['l2_ahead'] // 1024:>6} KB "
                     f"{c.get('l2_ahead_long', c['l2_ahead']) // 1024:>6} KB {c['x_copy']:>6} "
                     f"{c.get('few_rows', '-') if c.get('few_measured') else '-':>8} "
                     f"{'-' if gb is None else f'{gb:.1f}':>7} {'' if d is None else f'{d:.1f}':>8}"
                     + (f"  {gb * 1e9 / bandwidth:>7.0%}" if share and gb is not None else ""))
    return lines
