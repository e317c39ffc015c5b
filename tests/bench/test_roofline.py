"""`minerva roofline`: the ceiling arithmetic on hand-made costs, a real model's costs
against its GGUF file's own tensor list (read with `GGUFFile`, not through the model),
the hardware presets and probe, and the command end to end."""

from __future__ import annotations

import argparse
import math
import time

import gguf
import pytest
import torch

from minerva.bench import roofline
from minerva.bench.hardware import PRESETS, Hardware, hardware_from_args, probe
from minerva.bench.roofline import (
    ModelCosts,
    add_parser,
    decode_ceiling,
    model_costs,
    parallel_decode,
    prefill_ceiling,
)
from minerva.errors import MinervaError
from minerva.formats.gguf import GGUFFile, GGUFTensor
from minerva.kernels import native
from minerva.machine import machine
from minerva.models.layers import Linear

HW = Hardware("test", bandwidth=10e9, fp32_flops=1e12, bf16_flops=4e12, source="given")


def costs(**overrides) -> ModelCosts:
    fields = {"weight_bytes_per_token": 100_000_000, "matmul_params": 50_000_000, "kv_bytes_per_token": 0,
              "num_heads": 8, "head_dim": 64, "windows": (None,) * 4, "max_context": 8192}
    return ModelCosts(**{**fields, **overrides})


# ------------------------------------------------------------------ ceilings

def test_batch_1_decode_of_a_100_mb_model_on_10_gb_per_s_is_100_tokens_per_s():
    c = decode_ceiling(costs(), HW, batch=1, context=1)
    assert c.bound == "memory"
    assert c.tokens_per_second == pytest.approx(100.0)
    assert c.memory_seconds == pytest.approx(0.01)


def test_large_batch_decode_is_compute_bound_and_uses_the_dtype_peak():
    m = costs()
    batch = 1000
    flops = batch * (2 * m.matmul_params + 4 * 8 * 64 * 4 * 1)  # 4 layers, 1 key each
    fp32 = decode_ceiling(m, HW, batch, context=1, dtype="float32")
    assert fp32.bound == "compute"
    assert fp32.tokens_per_second == pytest.approx(batch / (flops / 1e12))
    bf16 = decode_ceiling(m, HW, batch, context=1, dtype="bfloat16")
    assert bf16.tokens_per_second == pytest.approx(batch / max(0.01, flops / 4e12))
    with pytest.raises(MinervaError, match="float32, bfloat16"):
        decode_ceiling(m, HW, batch, context=1, dtype="int4")


def test_kv_cache_reads_lower_decode_speed_as_context_grows():
    m = costs(kv_bytes_per_token=100_000)  # 100 KB per token of context, all layers
    # 1000 tokens of context add 100 MB to the 100 MB of weights: half the speed.
    assert decode_ceiling(m, HW, 1, 1000).tokens_per_second == pytest.approx(50.0)
    speeds = [decode_ceiling(m, HW, 8, ctx).tokens_per_second for ctx in (128, 512, 2048, 8192)]
    assert speeds == sorted(speeds, reverse=True) and speeds[-1] < speeds[0] / 2
    # Each sequence reads its own K/V: batch 8 at 1000 tokens reads 100 MB + 8 x 100 MB.
    assert decode_ceiling(m, HW, 8, 1000).tokens_per_second == pytest.approx(8 / 0.09)


def test_sliding_window_layers_cap_attention_flops_and_kv_reads():
    m = costs(windows=(None, 512, None, 512), kv_bytes_per_token=4000)
    assert m.keys_seen(100) == 4 * 100
    assert m.keys_seen(4096) == 2 * 4096 + 2 * 512
    assert m.attention_flops(4096) == 4 * 8 * 64 * (2 * 4096 + 2 * 512)
    # Past the window only the full layers grow.
    assert m.attention_flops(8192) - m.attention_flops(4096) == 4 * 8 * 64 * 2 * 4096
    assert m.kv_bytes_read(4096) == pytest.approx(1000 * (2 * 4096 + 2 * 512))
    full = costs(kv_bytes_per_token=4000)
    assert m.flops_per_token(4096) < full.flops_per_token(4096)


@pytest.mark.parametrize("prompt_len", [1, 300, 512, 513, 2000])
def test_prefill_flops_are_the_sum_over_the_prompts_positions(prompt_len):
    m = costs(windows=(None, 512, None, 512))
    assert m.prefill_flops(prompt_len) == sum(m.flops_per_token(c) for c in range(1, prompt_len + 1))


def test_a_prompt_needs_the_lm_heads_logits_once():
    """Prefill computes logits for the last prompt token only: a 262k-vocabulary head (Gemma 3)
    would otherwise make most of the FLOPs counted for a prompt ones that are never done."""
    m = costs(windows=(None, 512, None, 512), head_params=20_000_000, int8_params=30_000_000,
              head_int8_params=20_000_000)
    body = costs(windows=(None, 512, None, 512), matmul_params=30_000_000)
    for n in (1, 64, 700):
        assert m.prefill_flops(n) == body.prefill_flops(n) + 2 * 20_000_000
        assert m.prefill_int8_flops(n) == 2 * 10_000_000 * n + 2 * 20_000_000
    assert m.prefill_flops(1) == m.flops_per_token(1)  # one prompt token: one decode step's work


def test_prefill_ceiling():
    m = costs()
    long = prefill_ceiling(m, HW, 512)
    assert long.bound == "compute"
    assert long.tokens_per_second == pytest.approx(512 / (m.prefill_flops(512) / 1e12))
    # One prompt token costs what one decode step at context 1 costs.
    assert prefill_ceiling(m, HW, 1).tokens_per_second == pytest.approx(
        decode_ceiling(m, HW, 1, 1).tokens_per_second)
    # After a depth of 100 tokens, the prompt's tokens attend to those too.
    deep = prefill_ceiling(m, HW, 64, depth=100)
    flops = sum(m.flops_per_token(c) for c in range(101, 165))
    assert deep.tokens_per_second == pytest.approx(64 / max(flops / 1e12, m.weight_bytes_per_token / HW.bandwidth))


def test_matmuls_on_8_bit_activations_use_the_int8_peak():
    m = costs(int8_params=40_000_000)  # 40 M of the 50 M matmul weights take int8 activations
    hw = Hardware("test", bandwidth=10e9, fp32_flops=1e12, bf16_flops=4e12, source="given", int8_ops=8e12)
    flops = m.prefill_flops(512)
    int8 = 512 * 2 * 40_000_000
    c = prefill_ceiling(m, hw, 512)
    assert c.bound == "compute"
    assert c.compute_seconds == pytest.approx((flops - int8) / 1e12 + int8 / 8e12)
    batch = 1000
    d = decode_ceiling(m, hw, batch, context=1, dtype="bfloat16")
    assert d.compute_seconds == pytest.approx((batch * m.flops_per_token(1) - batch * int8 / 512) / 4e12
                                              + batch * int8 / 512 / 8e12)
    # No int8 peak known: those matmuls are costed at the float peak, as without int8.
    assert prefill_ceiling(m, HW, 512).compute_seconds == pytest.approx(flops / 1e12)
    assert "8.00 TOPS int8" in hw.describe() and "int8" not in HW.describe()


# ---------------------------------------------------------- the real model

def _file_linear_tensors(path) -> dict[str, GGUFTensor]:
    """Every matmul weight of the file: all 2-D tensors but the norms; token_embd is the
    (tied) output projection when there is no output.weight."""
    f = GGUFFile(path)
    assert "output.weight" not in f.tensors  # SmolLM2 ties its output to the embedding
    return {name: t for name, t in f.tensors.items() if len(t.shape) == 2 and "norm" not in name}


def test_model_costs_of_smollm2_match_its_file(smollm2_llm):
    tensors = _file_linear_tensors(smollm2_llm.path)
    assert len(tensors) == 30 * 7 + 1  # q, k, v, o, gate, up, down per layer + token_embd
    expected_bytes = expected_params = 0
    for t in tensors.values():
        rows, cols = t.shape
        block, type_size = gguf.GGML_QUANT_SIZES[t.qtype]
        assert t.raw().numel() == rows * cols // block * type_size
        expected_bytes += rows * cols // block * type_size
        expected_params += rows * cols

    m = model_costs(smollm2_llm.loaded)
    # Packed where the backend has kernels for the file's types; else dequantized at load to float32.
    linears = [mod for mod in smollm2_llm.loaded.model.modules() if isinstance(mod, Linear)]
    packed = all(getattr(mod.weight, "kernel", None) is not None for mod in linears)
    assert m.weight_bytes_per_token == (expected_bytes if packed else 4 * expected_params)
    assert m.matmul_params == expected_params
    assert 4 < m.bits_per_weight < 9 if packed else m.bits_per_weight == 32  # Q4_1 layers, Q8_0 embedding
    assert (m.num_layers, m.num_heads, m.head_dim) == (30, 9, 64)
    assert m.windows == (None,) * 30
    assert m.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4  # K and V, 3 KV heads, float32
    # int8 K/V: one byte per value plus a float32 scale per token and head.
    assert model_costs(smollm2_llm.loaded, "int8", "int8").kv_bytes_per_token == 2 * 30 * 3 * (64 + 4)
    assert model_costs(smollm2_llm.loaded, "bfloat16", "fp8").kv_bytes_per_token == 30 * 3 * (128 + 64 + 4)
    assert m.int8_params == 0  # float activations
    assert m.head_params == tensors["token_embd.weight"].shape[0] * tensors["token_embd.weight"].shape[1]


def test_model_costs_count_the_weights_on_8_bit_activations(smollm2_gguf):
    from minerva.models.loader import load_model

    loaded = load_model(smollm2_gguf, device="cpu", dtype=torch.float32, activations="int8")
    packed = [t for t in _file_linear_tensors(smollm2_gguf).values()
              if t.qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                                 gguf.GGMLQuantizationType.BF16)]
    assert packed  # Q4_1 layers, Q8_0 embedding
    m = model_costs(loaded)
    assert m.int8_params == sum(t.shape[0] * t.shape[1] for t in packed)
    assert m.head_int8_params == m.head_params > 0  # the tied Q8_0 head takes 8-bit activations too


def test_moe_costs_count_the_experts_a_token_uses(tmp_path):
    """Qwen3-MoE, 8 experts of which 2 per token, in 2 of its 3 layers (Q4_0 experts): against
    the file's 3-D expert tensors. Decode reads a quarter of the experts at batch 1 and
    nearly all of them for a long prompt; a token multiplies a quarter of their weights."""
    from minerva.models.loader import load_model
    from tests.helpers.tiny_gguf import write_gguf_from_hf
    from tests.helpers.tiny_hf import save

    path = tmp_path / "moe.gguf"
    write_gguf_from_hf(path, save(tmp_path, "qwen3-moe"), gguf.GGMLQuantizationType.Q4_0)
    exps = [t for name, t in GGUFFile(path).tensors.items() if "_exps" in name]
    assert len(exps) == 2 * 3 and all(t.shape[0] == 8 for t in exps)
    m = model_costs(load_model(path))
    assert m.expert_params == sum(math.prod(t.shape) for t in exps)
    assert m.expert_bytes == sum(t.raw().numel() for t in exps)
    assert m.expert_share == 2 / 8
    dense_bytes = m.weight_bytes_per_token - m.expert_bytes
    assert m.weight_bytes_read(1) == pytest.approx(dense_bytes + m.expert_bytes / 4)
    assert m.weight_bytes_read(2) == pytest.approx(dense_bytes + m.expert_bytes * (1 - 0.75**2))
    assert m.weight_bytes_read(512) == pytest.approx(m.weight_bytes_per_token)
    assert m.active_params == m.matmul_params - 0.75 * m.expert_params
    ceiling = decode_ceiling(m, HW, batch=1, context=1)
    assert ceiling.memory_seconds == pytest.approx((m.weight_bytes_read(1) + m.kv_bytes_read(1)) / HW.bandwidth)


# ---------------------------------------------------------------- hardware

def test_presets_and_hardware_from_args():
    assert set(PRESETS) == {"h100", "h200", "a100", "4090", "m2-ultra"}
    for hw in PRESETS.values():
        assert hw.source == "datasheet"
        assert hw.bandwidth > 0 and hw.fp32_flops > 0 and hw.bf16_flops >= hw.fp32_flops
    assert hardware_from_args() is None  # nothing named: probe this machine
    assert hardware_from_args("H100") == PRESETS["h100"]
    with pytest.raises(MinervaError) as e:
        hardware_from_args("tpu-v5")
    assert all(name in str(e.value) for name in PRESETS)
    given = hardware_from_args(bandwidth_gbs=100, tflops=2)
    assert (given.bandwidth, given.fp32_flops, given.bf16_flops) == (100e9, 2e12, 2e12)
    assert hardware_from_args("a100", bandwidth_gbs=1000).bandwidth == 1000e9
    with pytest.raises(MinervaError, match="both --bandwidth"):
        hardware_from_args(bandwidth_gbs=100)
    with pytest.raises(MinervaError, match="positive"):
        hardware_from_args("h100", tflops=-1)


def test_probe_returns_positive_finite_figures():
    start = time.perf_counter()
    hw = probe(seconds=0.5)
    # bounded even where a dtype has no fast path (bf16 without AVX-512 BF16: minutes per 2048^3)
    assert time.perf_counter() - start < 10
    assert hw.source == "measured"
    for value in (hw.bandwidth, hw.fp32_flops, hw.bf16_flops):
        assert math.isfinite(value) and value > 0
    if native.load() is not None:  # the int8 peak is measured with Minerva's kernels
        assert math.isfinite(hw.int8_ops) and hw.int8_ops > 0
        # multiply-adds done: 512-bit vpdpbusd where the kernels use it (AVX-512 VNNI), else 256-bit
        per_step = 512 if native.built == "avx512" and "avx512_vnni" in native.cpu_flags() else 256
        assert native.load().int8_peak_probe(3, 1000) == per_step * 3 * 1000


def test_probe_takes_the_fp32_peak_for_bf16_where_the_kernels_widen_it(monkeypatch):
    """The AVX2 build multiplies bf16 activations in float32: its bf16 ceiling is the fp32 one,
    not torch's emulated bf16 matmul (about 1 GFLOPS there)."""
    from minerva.bench import hardware
    probed = []
    monkeypatch.setattr(hardware, "_matmul_flops", lambda dtype, seconds: probed.append(dtype) or 1e11)
    monkeypatch.setattr(hardware, "_bandwidth", lambda seconds: 1e10)
    monkeypatch.setattr(native, "built", "avx2")
    hw = probe(seconds=0.2)
    assert probed == [torch.float32] and hw.bf16_flops == hw.fp32_flops == 1e11
    monkeypatch.setattr(native, "built", "avx512")
    probed.clear()
    assert probe(seconds=0.2).bf16_flops == 1e11 and probed == [torch.float32, torch.bfloat16]


def test_machine_describes_this_host():
    m = machine()
    assert m.physical_cores >= 1 and m.logical_cpus >= m.physical_cores
    assert m.cpu in m.describe() and "cores" in m.describe()


# --------------------------------------------------------------------- CLI

def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="minerva")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["roofline", *argv])


def test_roofline_command_for_other_hardware(smollm2_gguf, capsys):
    args = _parse([str(smollm2_gguf), "--hardware", "h100", "--context", "128,100000"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert f"machine:   {machine().describe()}" in out
    assert str(smollm2_gguf) in out and "NVIDIA H100 SXM (datasheet)" in out
    assert "decode, batch 1" in out and "decode, batch 32" in out and "prefill, 512-token prompt" in out
    assert "decode ceiling by context length" in out
    assert "peak RSS" in out and "loaded in" in out
    assert "\n   8192 " in out and "100000" not in out  # contexts capped at the model's 8192


def test_roofline_says_when_the_choices_were_planned_on_a_busy_machine(smollm2_gguf, capsys, monkeypatch):
    from minerva.kernels import tune
    planned = {"types": {}, "threads": 2, "cpu_share": 0.48, "busy": True}
    monkeypatch.setattr(tune, "in_force", lambda: ("planned: choices.json", planned))
    args = _parse([str(smollm2_gguf), "--hardware", "h100"])
    assert args.func(args) == 0
    assert "kernel choices" not in capsys.readouterr().out  # this CPU's: not shown for other hardware
    monkeypatch.setattr(roofline, "probe", lambda: PRESETS["h100"])  # this machine, without the probe's seconds
    args = _parse([str(smollm2_gguf)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "int8 kernel choices: planned: choices.json" in out
    assert "note: the machine was busy" in out and "48% of its 2 threads' time" in out and "minerva tune" in out


def test_tensor_parallel_prediction():
    """100 MB over 10 GB/s is 10 ms a token on one device; 4 layers, hidden 1000, vocab 8000 in
    float32 over 2 devices at 1 GB/s and 10 us: 9 all-reduces of 4 KB (a ring over 2 moves all
    4 KB, and 2 latencies) plus the gather of the other rank's 16 KB of logits (one latency) plus
    the step's broadcast (one latency)."""
    p = parallel_decode(costs(), HW, hidden=1000, vocab=8000, batch=1, context=1, world=2,
                        link_bandwidth=1e9, link_latency=10e-6)
    comm = 9 * (4e-6 + 20e-6) + (16e-6 + 10e-6) + 10e-6
    assert p.comm_seconds == pytest.approx(comm)
    assert p.one_device == pytest.approx(100.0)
    assert p.tokens_per_second == pytest.approx(1 / (0.005 + comm))
    free = parallel_decode(costs(), HW, hidden=1000, vocab=8000, batch=1, context=1, world=4,
                           link_bandwidth=1e30, link_latency=0.0)
    assert free.speedup == pytest.approx(4.0)


def test_roofline_command_predicts_tensor_parallelism(smollm2_gguf, capsys):
    args = _parse([str(smollm2_gguf), "--hardware", "h100", "--tensor-parallel-size", "2",
                   "--link-bandwidth", "50", "--link-latency", "3"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "tensor parallelism over 2 devices like this one, linked at 50 GB/s with 3 us latency" in out
    assert "61 all-reduces" in out and "speedup" in out


@pytest.mark.parametrize("flags, words", [
    (["--tensor-parallel-size", "1"], "--tensor-parallel-size must be at least 2"),
    (["--tensor-parallel-size", "2", "--link-bandwidth", "0"], "--link-bandwidth must be > 0"),
    (["--tensor-parallel-size", "2", "--link-latency", "-1"], "--link-latency >= 0"),
])
def test_roofline_refuses_bad_parallel_flags(smollm2_gguf, flags, words):
    args = _parse([str(smollm2_gguf), "--hardware", "h100", *flags])
    with pytest.raises(MinervaError, match=words):
        args.func(args)


def test_roofline_refuses_to_measure_other_hardware():
    args = _parse(["--hardware", "h100", "--measure"])
    with pytest.raises(MinervaError, match="--measure"):
        args.func(args)


@pytest.mark.slow
def test_roofline_measure_states_the_fraction_reached(smollm2_gguf, capsys):
    args = _parse([str(smollm2_gguf), "--measure", "--batch", "4", "--prompt", "64"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "measured" in out and "of ceiling" in out
    rows = [ln for ln in out.splitlines() if ln.startswith(("prefill, 64-token", "decode, batch 1,", "decode, batch 4,"))]
    assert len(rows) == 3 and all(ln.rstrip().endswith("%") for ln in rows), rows
