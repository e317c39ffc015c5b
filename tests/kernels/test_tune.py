"""The planner of the int8 kernels' choices (`minerva.kernels.tune`): what it measures is put
in force type by type, changes no result, is kept beside the build and reused, can be
pinned from a file or turned off, and a bad file is one clear error."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch

from minerva.errors import MinervaError
from minerva.kernels import native, repack, tune

Q = gguf.GGMLQuantizationType
kernels = native.load()
pytestmark = pytest.mark.skipif(kernels is None, reason=f"no CPU kernels: {native.unavailable_reason}")


@pytest.fixture
def restore():
    """Every type back to the defaults afterwards."""
    yield
    tune.reset(kernels)


@pytest.fixture
def small(monkeypatch):
    """A plan of toy size: matrices of a few MB, two rounds."""
    monkeypatch.setattr(tune, "MIN_STREAM_BYTES", 4 << 20)
    monkeypatch.setattr(tune, "_l3_bytes", lambda: 1 << 20)
    monkeypatch.setattr(tune, "SHAPES", ((512, 1024), (256, 2048)))
    monkeypatch.setattr(tune, "LONG_SHAPES", ((64, 8192),))  # the kernels' long rows: 8192 columns or more
    monkeypatch.setattr(tune, "LONG_ROUNDS", 2)


def _product(qtype: Q, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    w = tune.random_blocks(qtype, rows, cols, torch.Generator().manual_seed(1))
    qid = int(qtype)
    if repack.applies(kernels, qtype):
        w, qid = repack.regroup_in_place(w, qtype, rows, cols, kernels), qid | repack.REGROUPED
    return kernels.qmatmul_q8(x, w, qid, rows, cols)


def test_random_blocks_decode_to_finite_normal_weights():
    for qtype in tune.TYPES:
        w = tune.random_blocks(qtype, 16, 512, torch.Generator().manual_seed(0))
        dense = torch.from_numpy(gguf.dequantize(w.numpy(), qtype)).float()
        assert torch.isfinite(dense).all(), qtype.name
        assert 1e-4 < dense.abs().mean() < 50, (qtype.name, dense.abs().mean())


def test_choices_are_per_type_and_change_no_result(restore):
    g, l2, xc, steps, few, long = tune.defaults(kernels, Q.Q4_0)
    other = [1 if g != 1 else 2, 65536 if l2 == 0 else 0, xc, steps, 3 if few != 3 else 8, 16384 if long != 16384 else 0]
    q4_k = kernels.cpu_choices(None, int(Q.Q4_K))
    kernels.cpu_choices(other, int(Q.Q4_0))
    assert kernels.cpu_choices(None, int(Q.Q4_0)) == other
    assert kernels.cpu_choices(None, int(Q.Q4_K)) == q4_k  # the others keep theirs
    x = torch.randn(1, 2048)
    for qtype in tune.TYPES:
        for setting in tune.settings_one_row(kernels, qtype)[::3]:
            tune.reset(kernels)
            before = _product(qtype, x, 256, 2048)
            tune._set(kernels, qtype, setting)
            assert torch.equal(_product(qtype, x, 256, 2048), before), (qtype.name, setting)


def test_a_choice_for_a_type_the_kernels_do_not_take_is_refused(restore):
    with pytest.raises(RuntimeError, match="cpu_choices"):
        kernels.cpu_choices(tune.defaults(kernels), 1000)
    with pytest.raises(RuntimeError, match="cpu_choices"):
        kernels.cpu_choices(tune.defaults(kernels), int(Q.F16))
    with pytest.raises(RuntimeError, match="cpu_choices"):
        kernels.cpu_choices([5, 0, 0, 1], int(Q.Q4_0))
    with pytest.raises(RuntimeError, match="cpu_choices"):
        kernels.cpu_choices([3, 0, 0, 1], int(Q.Q4_K))
    with pytest.raises(RuntimeError, match="cpu_choices"):
        kernels.cpu_choices([1, 0, 0, 1, 8, -1], int(Q.Q4_K))  # a negative long-row distance
    with pytest.raises(RuntimeError, match="cpu_choices"):
        kernels.cpu_choices([1, 0, 0, 1, 8, 0, 0], int(Q.Q4_K))  # too many values


def test_plan_measures_every_setting_and_puts_the_fastest_in_force(small, restore, monkeypatch):
    # Q4_0 in work items of 4 groups only, so the few-row streams (2 groups or more) are timed
    every = tune.settings_one_row
    monkeypatch.setattr(tune, "settings_one_row",
                        lambda k, q: [s for s in every(k, q) if q in tune.K_TYPES or s.groups == 4])
    data = tune.plan(kernels, rounds=2, types=(Q.Q4_0, Q.Q4_K), progress=False)
    assert data["version"] == tune.VERSION and data["build"] == native.built
    for name in ("Q4_0", "Q4_K"):
        c = data["types"][name]
        measured = c["measured"]
        assert len(measured) == len(tune.settings_one_row(kernels, getattr(Q, name)))
        assert all(m["gb_per_s"] > 0 for m in measured)
        fastest = max(m["gb_per_s"] for m in measured)
        assert c["gb_per_s"] >= fastest / (1 + tune.MARGIN) - 0.01  # the best, or the default within the margin
        in_force = kernels.cpu_choices(None, int(getattr(Q, name)))
        assert in_force[:3] == [c["groups"], c["l2_ahead"], c["x_copy"]] and in_force[4] == c["few_rows"]
        assert in_force[3] == tune.defaults(kernels)[3]  # the bits' choice is never planned
        assert in_force[5] == c["l2_ahead_long"] and len(c["long_measured"]) == len(tune.L2_AHEAD)
    few = data["types"]["Q4_0"]["few_measured"]  # the few-row paths, both timed at each count
    assert [m["rows"] for m in few] == list(tune.FEW_ROWS) and all(m["streams_ms"] > 0 < m["panels_ms"] for m in few)
    assert data["types"]["Q4_K"]["few_measured"] == [] and data["types"]["Q4_K"]["few_rows"] == tune.defaults(kernels, Q.Q4_K)[4]


def test_one_row_settings_offer_two_groups_a_register_where_the_build_has_it():
    """The 32-weight block types' one-row groups: 1, 2 or 4 streams, and `x8_pairs` where the
    build takes two groups a 512-bit register (AVX-512 VNNI); the K-quants never take it. Each
    with every L2 prefetch distance."""
    for qtype in (Q.Q4_0, Q.Q8_0, Q.MXFP4):
        groups = [s.groups for s in tune.settings_one_row(kernels, qtype)]
        assert sorted(set(groups)) == [1, 2, 4] + ([kernels.x8_pairs] if kernels.x8_pairs else [])
        assert len(groups) == len(set(groups)) * len(tune.L2_AHEAD)
    assert kernels.x8_pairs not in {s.groups for s in tune.settings_one_row(kernels, Q.Q4_K)}
    assert bool(kernels.x8_pairs) == (native.built == "avx512" and "avx512_vnni" in open("/proc/cpuinfo").read())


def test_a_plan_that_takes_two_groups_a_register_keeps_the_few_rows_default(restore, monkeypatch, small):
    """Where pairs are chosen the few-row streams are not timed (the pairs' tiles take those
    rows) and the table names the choice."""
    if not kernels.x8_pairs:
        pytest.skip("this build has no two groups a 512-bit register")
    pairs = tune.Setting(kernels.x8_pairs, 0, 0)
    monkeypatch.setattr(tune, "settings_one_row", lambda k, q: [pairs])
    monkeypatch.setattr(tune, "_default_setting", lambda k, q: pairs)
    data = tune.plan(kernels, rounds=1, types=(Q.Q4_0,), progress=False)
    c = data["types"]["Q4_0"]
    assert c["groups"] == kernels.x8_pairs and c["few_measured"] == []
    assert kernels.cpu_choices(None, int(Q.Q4_0))[0] == kernels.x8_pairs
    assert tune.table(data)[1].split()[:2] == ["Q4_0", "pairs"]


def test_pick_keeps_the_default_unless_another_is_clearly_faster():
    a, b = tune.Setting(1, 0, 0), tune.Setting(1, 32768, 0)
    assert tune._pick({a: 1.0, b: 0.99}, a) == a
    assert tune._pick({a: 1.0, b: 0.9}, a) == b


@pytest.mark.parametrize("streams, panels, few", [
    ((1.0, 1.0, 1.0), (2.0, 2.0, 2.0), 8),   # the streams faster at every count
    ((1.0, 1.0, 3.0), (2.0, 2.0, 2.0), 4),   # ... up to 4 rows
    ((1.0, 3.0, 1.0), (2.0, 2.0, 2.0), 2),   # a loss at 4 rows ends them there, whatever 8 gives
    ((2.05, 1.0, 1.0), (2.0, 2.0, 2.0), 8),  # 2.5% slower at 2 rows, within MARGIN (3%): kept
    ((3.0, 1.0, 1.0), (2.0, 2.0, 2.0), 1),   # slower at 2 rows: never
])
def test_few_rows_are_the_streams_up_to_their_first_loss(monkeypatch, restore, streams, panels, few):
    def sweep(kernels_, matrices, xs):
        rows = next(iter(xs.values())).shape[0]
        in_force = kernels_.cpu_choices(None, int(Q.Q4_0))[4]
        return (streams if in_force > 1 else panels)[tune.FEW_ROWS.index(rows)]

    monkeypatch.setattr(tune, "_sweep_seconds", sweep)
    m = tune.Matrix(torch.zeros(8, 18, dtype=torch.uint8), int(Q.Q4_0), 8, 32)
    chosen, measured = tune._plan_few_rows(kernels, Q.Q4_0, tune._default_setting(kernels, Q.Q4_0), [m],
                                           torch.Generator().manual_seed(0))
    assert chosen.few_rows == few and kernels.cpu_choices(None, int(Q.Q4_0))[4] == few
    assert [(r["streams_ms"], r["panels_ms"]) for r in measured] == [(a * 1e3, b * 1e3) for a, b in zip(streams, panels)]


def _fresh(monkeypatch):
    monkeypatch.setattr(tune, "_source", "not loaded")
    monkeypatch.setattr(tune, "_applied", None)


def test_ensure_plans_once_beside_the_build_then_reuses(small, restore, monkeypatch, tmp_path):
    _fresh(monkeypatch)
    monkeypatch.delenv("MINERVA_CHOICES", raising=False)
    monkeypatch.delenv("MINERVA_NO_TUNE", raising=False)
    monkeypatch.setattr(native, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(tune, "TYPES", (Q.Q8_0,))
    monkeypatch.setattr(tune, "ROUNDS", 1)
    monkeypatch.setattr(tune, "BUSY_SHARE", 0)  # a toy plan is mostly Python on one thread: never busy here
    tune.ensure(kernels)
    kept = json.loads((tmp_path / tune.FILE_NAME).read_text())
    assert set(kept["types"]) == {"Q8_0"}
    assert tune.in_force() == (f"planned: {tmp_path / tune.FILE_NAME}", kept)
    # the next process reads it: no plan
    _fresh(monkeypatch)
    monkeypatch.setattr(tune, "plan", lambda *a, **k: pytest.fail("planned again"))
    tune.ensure(kernels)
    assert tune.in_force()[1] == kept


def test_a_plan_on_a_busy_machine_is_marked_and_measured_again(small, restore, monkeypatch, tmp_path, caplog):
    """A plan during which this process ran less than BUSY_SHARE of its threads' time (other
    work took the cores) is marked busy, and each of the next processes measures again until
    a plan is not busy, or PLAN_TRIES plans were made; a quiet plan is kept."""
    monkeypatch.setattr(tune, "TYPES", (Q.Q8_0,))
    monkeypatch.setattr(tune, "ROUNDS", 1)
    monkeypatch.setattr(tune, "_cpu_seconds", lambda: 0.0)  # none of the time was this process's
    data = tune.plan(kernels, progress=False)
    assert data["busy"] and data["cpu_share"] == 0 and "was busy" in tune.busy_note(data)
    _fresh(monkeypatch)
    monkeypatch.delenv("MINERVA_CHOICES", raising=False)
    monkeypatch.delenv("MINERVA_NO_TUNE", raising=False)
    monkeypatch.setattr(native, "build_dir", lambda: tmp_path)
    plans = []
    busy = iter([True, True, True, False])

    def fake_plan(k):
        plans.append(1)
        return {**data, "busy": next(busy)}

    monkeypatch.setattr(tune, "plan", fake_plan)
    for _ in range(tune.PLAN_TRIES + 1):  # one process each
        _fresh(monkeypatch)
        tune.ensure(kernels)
    kept = json.loads((tmp_path / tune.FILE_NAME).read_text())
    assert len(plans) == tune.PLAN_TRIES and kept["busy"] and kept["tries"] == tune.PLAN_TRIES
    assert "measures them again" in caplog.text
    (tmp_path / tune.FILE_NAME).unlink()
    plans.clear()
    busy = iter([False])
    for _ in range(2):
        _fresh(monkeypatch)
        tune.ensure(kernels)
    assert len(plans) == 1 and not json.loads((tmp_path / tune.FILE_NAME).read_text())["busy"]


def test_no_tune_keeps_the_defaults(monkeypatch, restore):
    _fresh(monkeypatch)
    monkeypatch.setenv("MINERVA_NO_TUNE", "1")
    monkeypatch.delenv("MINERVA_CHOICES", raising=False)
    monkeypatch.setattr(tune, "plan", lambda *a, **k: pytest.fail("planned"))
    tune.ensure(kernels)
    assert tune.in_force() == ("fixed defaults (MINERVA_NO_TUNE)", None)
    assert kernels.cpu_choices(None, int(Q.Q4_0)) == tune.defaults(kernels, Q.Q4_0)


def _choices_file(tmp_path, **changes):
    g, l2, xc, _, _, _ = tune.defaults(kernels, Q.Q5_0)
    data = {"version": tune.VERSION, "build": native.built,
            "types": {"Q5_0": {"groups": g, "l2_ahead": 16384, "x_copy": xc, "gb_per_s": 1.0}}}
    data.update(changes)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    return path


def test_a_pinned_file_is_put_in_force(monkeypatch, restore, tmp_path):
    _fresh(monkeypatch)
    path = _choices_file(tmp_path)
    monkeypatch.setenv("MINERVA_CHOICES", str(path))
    tune.ensure(kernels)
    assert kernels.cpu_choices(None, int(Q.Q5_0))[1] == 16384
    assert tune.in_force()[0] == f"pinned: {path}"


@pytest.mark.parametrize("changes, message", [
    ({"version": 99}, "not a Minerva kernel choices file"),
    ({"build": "avx1"}, "holds choices for the avx1 kernel build"),
    ({"types": {"Q9_9": {"groups": 1, "l2_ahead": 0, "x_copy": 0}}}, "'Q9_9' is not a type"),
    ({"types": {"Q4_0": {"groups": 7, "l2_ahead": 0, "x_copy": 0}}}, "the choices for Q4_0 are not valid"),
    ({"types": {"Q4_0": {"groups": 4, "l2_ahead": 0, "x_copy": 0, "few_rows": 0}}}, "the choices for Q4_0 are not valid"),
    ({"types": {"Q4_0": {"groups": 4, "l2_ahead": 0, "x_copy": 0, "few_rows": "lots"}}}, "the choices for Q4_0 are not valid"),
    ({"types": {"Q4_K": {"groups": 1, "l2_ahead": 0, "x_copy": 0, "l2_ahead_long": -1}}}, "the choices for Q4_K are not valid"),
    ({"types": {"Q4_K": {"groups": 1, "l2_ahead": 0, "x_copy": 0, "l2_ahead_long": "far"}}}, "the choices for Q4_K are not valid"),
    # a number the kernels' binding cannot take was pybind11's message of several lines
    ({"types": {"Q4_0": {"groups": 1e30, "l2_ahead": 0, "x_copy": 0}}},
     r"the choices for Q4_0 are not valid \(groups is 1e\+30, not a whole number in \[0, 2\^31\)\)"),
    ({"types": {"Q4_0": "fast"}}, r"the choices for Q4_0 are not valid \(str, not an object\)"),
    ({"types": {"Q4_0": {"l2_ahead": 0, "x_copy": 0}}}, r"the choices for Q4_0 are not valid \(no groups\)"),
    ({"types": {"Q4_0": {"groups": 4, "l2_ahead": 0, "x_copy": 0, "gb_per_s": "fast"}}},
     "the choices for Q4_0 are not valid .gb_per_s is 'fast', not a number"),
])
def test_a_bad_pinned_file_is_one_clear_error(monkeypatch, restore, tmp_path, changes, message):
    _fresh(monkeypatch)
    monkeypatch.setenv("MINERVA_CHOICES", str(_choices_file(tmp_path, **changes)))
    with pytest.raises(MinervaError, match=message) as e:
        tune.ensure(kernels)
    assert "\n" not in str(e.value)  # one line


def test_a_pinned_path_that_is_a_directory_or_missing_says_so(monkeypatch, tmp_path):
    """MINERVA_CHOICES naming a directory said 'no such file'."""
    for path, what in ((tmp_path, "is a directory, not a file"), (tmp_path / "none.json", "does not exist")):
        _fresh(monkeypatch)
        monkeypatch.setenv("MINERVA_CHOICES", str(path))
        with pytest.raises(MinervaError, match=f"^MINERVA_CHOICES={path}: '{path}' {what}; write one with"):
            tune.ensure(kernels)


def test_cli_tune_writes_a_file_others_can_pin_and_bad_ones_fail_cleanly(tmp_path):
    env = {**os.environ, "MINERVA_NO_TUNE": "1"}
    out = tmp_path / "choices.json"
    run = subprocess.run([sys.executable, "-m", "minerva.cli", "tune", "--rounds", "1", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert set(data["types"]) == {q.name for q in tune.TYPES}
    assert "Q4_0" in run.stdout and "GB/s" in run.stdout
    shown = subprocess.run([sys.executable, "-m", "minerva.cli", "tune", "--show", "--out", str(out)],
                           capture_output=True, text=True, env=env, timeout=120)
    assert shown.returncode == 0 and shown.stdout.splitlines()[2:] == run.stdout.splitlines()[2:]
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    gen = subprocess.run([sys.executable, "-m", "minerva.cli", "generate", "smollm2-135m", "hi", "-n", "1"],
                         capture_output=True, text=True, env={**env, "MINERVA_CHOICES": str(bad)}, timeout=300)
    assert gen.returncode == 1
    assert gen.stderr.strip().splitlines()[-1].startswith(
        f"minerva: error: MINERVA_CHOICES={bad}: not a JSON file of kernel choices")
    assert "Traceback" not in gen.stderr


@pytest.mark.parametrize("rounds", ["-1", "0", "two"])
def test_tune_rounds_below_one_are_refused(rounds, capsys, tmp_path):
    """--rounds -1 was statistics.StatisticsError, 0 the default without a word."""
    from minerva.cli import main
    with pytest.raises(SystemExit) as e:
        main(["tune", "--rounds", rounds, "--out", str(tmp_path / "choices.json")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "minerva tune: error: argument --rounds: " + (
        "expected a whole number, got 'two'" if rounds == "two" else f"must be at least 1, got {rounds}")


@pytest.mark.parametrize("content, message", [
    ({"a": 1}, "is not a Minerva kernel choices file"),  # was KeyError: 'build'
    ({"types": {"Q4_0": "fast"}}, r"the choices for Q4_0 are not valid \(str, not an object\)"),  # AttributeError
    ("{", "not a JSON file of kernel choices"),
])
def test_tune_show_of_a_malformed_file_is_one_line(tmp_path, capsys, content, message):
    from minerva.cli import main
    path = tmp_path / "choices.json"
    if isinstance(content, dict) and "types" in content:
        path = _choices_file(tmp_path, **content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    assert main(["tune", "--show", "--out", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("minerva: error: "), err
    assert str(path) in err and "minerva tune --out FILE" in err and re.search(message, err), err


@pytest.mark.parametrize("content", ["{", json.dumps({"a": 1})])
def test_tune_show_of_the_builds_damaged_file_says_to_plan_again(tmp_path, monkeypatch, capsys, content):
    """The file beside the build is mended by `minerva tune`; it said to write one with --out."""
    from minerva.cli import main
    path = tmp_path / "choices.json"
    path.write_text(content)
    monkeypatch.setattr(tune, "choices_path", lambda: path)
    assert main(["tune", "--show"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err, err
    assert err.rstrip().endswith("`minerva tune` measures them again") and "--out" not in err, err


def test_tune_show_of_a_file_without_the_figures_shows_a_dash(tmp_path, capsys):
    """An entry missing gb_per_s (a hand-written file, which MINERVA_CHOICES takes) was a KeyError."""
    from minerva.cli import main
    path = _choices_file(tmp_path)
    data = json.loads(path.read_text())
    del data["types"]["Q5_0"]["gb_per_s"]
    path.write_text(json.dumps(data))
    assert main(["tune", "--show", "--out", str(path)]) == 0
    c = data["types"]["Q5_0"]
    # type, groups, L2 ahead, long rows, x copy, few rows (not measured), GB/s (none), default (none)
    assert capsys.readouterr().out.splitlines()[-1].split() == ["Q5_0", str(c["groups"]), "16", "KB", "16", "KB",
                                                                str(c["x_copy"]), "-", "-"]


def test_tune_out_is_checked_before_the_plan_and_kept_if_it_cannot_be_written_after(tmp_path, monkeypatch, capsys):
    """--out in a folder that does not exist (or a directory): one line before anything is
    measured; a folder gone by the end of the plan: the plan kept in a temporary file the error
    names (it was a traceback, the plan lost)."""
    from minerva.cli import main
    monkeypatch.setattr(tune, "plan", lambda *a, **k: pytest.fail("planned"))
    out = tmp_path / "no" / "x.json"
    assert main(["tune", "--rounds", "1", "--out", str(out)]) == 1
    assert capsys.readouterr().err == (f"minerva: error: --out '{out}' cannot be written (its folder '{out.parent}' "
                                       "does not exist); give a path in a folder you can write to\n")
    assert main(["tune", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith(f"minerva: error: --out '{tmp_path}' is a directory")
    folder = tmp_path / "out"
    folder.mkdir()
    data = {"version": tune.VERSION, "build": native.built, "types": {}, "made": "now"}

    def plan_then_lose_the_folder(*args, **kwargs):
        folder.rmdir()
        return data

    monkeypatch.setattr(tune, "plan", plan_then_lose_the_folder)
    assert main(["tune", "--out", str(folder / "x.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"minerva: error: --out '{folder / 'x.json'}' cannot be written (its folder '{folder}' "
                          "does not exist); the results are kept in "), err
    kept = Path(err.strip().rsplit(" kept in ", 1)[1].removesuffix(" instead"))
    try:
        assert json.loads(kept.read_text()) == data
    finally:
        kept.unlink()
