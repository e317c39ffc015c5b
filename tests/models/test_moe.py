"""Mixture-of-experts models (Qwen3-MoE, Mixtral, GPT-OSS) and Qwen3: GGUF files written the way
llama.cpp's converter writes them, against transformers on the same weights; the MoE layer's
batch invariance; and the engine's guarantees (batched = alone, prefix-cache hit = cold,
speculative greedy = plain) on a MoE model."""

from __future__ import annotations

import shutil

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from minerva import LLM, SamplingParams
from minerva.errors import MinervaError
from minerva.kernels import native
from minerva.models.layers import MoE
from minerva.models.loader import load_model
from tests.helpers.paged import paged_logits
from tests.helpers.tiny_gguf import write_gguf_from_hf
from tests.helpers.tiny_hf import VOCAB, save, to_mxfp4
from tests.engine.test_engine import GREEDY, SAMPLED, make_llm, prompts, run_alone

Q = gguf.GGMLQuantizationType


def reference_dir(hf_dir, replaced: dict, out):
    """A copy of the checkpoint with some tensors replaced (experts by their dequantized values)."""
    out.mkdir()
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    tensors = load_file(hf_dir / "model.safetensors")
    tensors.update({k: torch.from_numpy(v.copy()) for k, v in replaced.items()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("name,expert_type", [("qwen3", None), ("qwen3-moe", None), ("qwen3-moe", Q.Q8_0),
                                              ("qwen3-moe", Q.Q4_0), ("mixtral-full", Q.Q4_1), ("gpt-oss", None),
                                              ("gpt-oss", Q.MXFP4)])
def test_gguf_matches_transformers(tmp_path, name, expert_type):
    """Experts stay packed in their 3-D GGUF tensors, one slice per expert; transformers runs
    the dequantized values."""
    hf_dir = save(tmp_path, name)
    path = tmp_path / f"{name}.gguf"
    dequantized = write_gguf_from_hf(path, hf_dir, expert_type)
    assert bool(dequantized) == (expert_type is not None and name != "qwen3")
    loaded = load_model(path)
    moes = [layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, MoE)]
    assert len(moes) == {"qwen3": 0, "qwen3-moe": 2, "mixtral-full": 3, "gpt-oss": 4}[name]  # qwen3-moe: layer 1 dense
    if expert_type is not None:
        assert all(lin.weight.qtype == expert_type for m in moes for e in m.experts for lin in e.gate_up.linears())
    ref_dir = reference_dir(hf_dir, dequantized, tmp_path / "reference")
    ids = torch.randint(0, VOCAB, (40,)).tolist()
    mine = paged_logits(loaded.model, ids, chunk=16)
    with torch.inference_mode():
        ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4), (mine - ref).abs().max()


def test_safetensors_mxfp4_experts_stay_packed_and_match_transformers(tmp_path):
    """GPT-OSS's published layout (`*_blocks`, `*_scales`) loads into GGML's MXFP4 blocks; the
    reference is transformers dequantizing the same checkpoint by its own reading of it."""
    hf_dir = to_mxfp4(save(tmp_path, "gpt-oss"))
    loaded = load_model(hf_dir, activations="float")
    experts = [lin.weight for layer in loaded.model.layers for e in layer.mlp.experts
               for lin in (*e.gate_up.linears(), e.down)]
    assert all(w.qtype == Q.MXFP4 and (w.kernel is not None) == native.capable() for w in experts)
    ids = torch.randint(0, VOCAB, (40,)).tolist()
    mine = paged_logits(loaded.model, ids, chunk=16)
    with torch.inference_mode():
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4), (mine - ref).abs().max()


def test_mxfp4_blocks_of_the_wrong_dtype_are_refused(tmp_path):
    """A `*_blocks` tensor that is not uint8 (a float tensor under that name) is refused by name."""
    hf_dir = to_mxfp4(save(tmp_path, "gpt-oss"))
    tensors = load_file(hf_dir / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj_blocks"
    tensors[name] = tensors[name].float()
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MinervaError, match=f"'{name}' has dtype torch.float32; packed blocks are uint8"):
        load_model(hf_dir)


@pytest.mark.parametrize("expert_type", [None, Q.Q4_0])
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_moe_layer_is_batch_invariant(tmp_path, expert_type, activations):
    """Each token's output from a batch of 37 equals its output alone, bit for bit, although
    the batch sends many tokens to each expert."""
    hf_dir = save(tmp_path, "qwen3-moe")
    path = tmp_path / "m.gguf"
    write_gguf_from_hf(path, hf_dir, expert_type)
    moe = load_model(path, activations=activations).model.layers[0].mlp
    assert isinstance(moe, MoE)
    x = torch.randn(37, 64)
    with torch.inference_mode():
        _, ids = moe.route(x)
        assert len(set(ids.flatten().tolist())) == 8  # every expert has tokens
        batched = moe(x)
        alone = torch.cat([moe(x[t:t + 1]) for t in range(37)])
        halves = torch.cat([moe(x[:20]), moe(x[20:])])
    assert torch.equal(batched, alone) and torch.equal(batched, halves)


@pytest.mark.skipif(not native.capable(), reason="this CPU cannot run the packed kernels")
@pytest.mark.parametrize("name,expert_type", [("qwen3-moe", Q.Q4_0), ("gpt-oss", Q.MXFP4), ("gpt-oss", None)])
@pytest.mark.parametrize("activations", ["float", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fused_experts_give_the_python_loops_bits(tmp_path, name, expert_type, activations, dtype):
    """The expert loop as one kernel call (csrc/module.cpp `Experts`) against the Python loop it
    replaces: the same bits, one token (decode), 3 alike (the other experts without tokens) or 37
    (grouped by expert), in float32 and bfloat16. With 8-bit activations and regrouped experts
    (Q4_0, MXFP4) the kernel runs every expert's matmuls in one parallel loop (`grouped`;
    for bf16, each output rounded to bf16 before its bf16 bias is added, as Linear does)."""
    path = tmp_path / "m.gguf"
    write_gguf_from_hf(path, save(tmp_path, name), expert_type)
    moe = load_model(path, dtype=dtype, activations=activations).model.layers[0].mlp
    assert moe.fused is not None
    assert moe.fused.grouped == (activations == "int8" and expert_type is not None)
    x = torch.randn(37, 64, dtype=dtype)
    assert moe.fused.groups(x) == moe.fused.grouped
    alike = x[5:6].repeat(3, 1)
    with torch.inference_mode():
        assert len(set(moe.route(alike)[1].flatten().tolist())) < len(moe.experts)
        fused = [moe(x), moe(x[5:6]), moe(alike)]
        moe.fused = None
        loop = [moe(x), moe(x[5:6]), moe(alike)]
    assert all(torch.equal(a, b) for a, b in zip(fused, loop))


def test_router_orders():
    """Softmax over all experts then top k (renormalised or not), and top-k logits then softmax."""
    from minerva.kernels.weights import DenseWeight
    from minerva.models.config import SOFTMAX_TOPK, TOPK_SOFTMAX
    from minerva.models.layers import Linear

    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    router = Linear(DenseWeight(torch.eye(4)))
    p = logits.softmax(-1)[0]
    for routing, renorm, expected in [(SOFTMAX_TOPK, False, p[[0, 2]]),
                                      (SOFTMAX_TOPK, True, p[[0, 2]] / p[[0, 2]].sum()),
                                      (TOPK_SOFTMAX, False, torch.tensor([2.0, 1.0]).softmax(-1))]:
        w, ids = MoE(router, [], 2, routing, renorm).route(logits)
        assert ids.tolist() == [[0, 2]]
        assert torch.allclose(w[0], expected)


@pytest.fixture(scope="module", params=["qwen3-moe", "gpt-oss"])
def moe_dir(request, tmp_path_factory):
    return save(tmp_path_factory.mktemp("moe"), request.param)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_batched_equals_alone(moe_dir, params):
    llm = make_llm(moe_dir)
    ps = prompts(8)
    assert [o.token_ids for o in llm.generate(ps, params)] == [run_alone(llm, p, params) for p in ps]


def test_prefix_cache_hit_equals_cold_run(moe_dir):
    cold, warm = make_llm(moe_dir, enable_prefix_caching=False), make_llm(moe_dir)
    p = prompts(1, 50, 50, seed=8)[0]
    expected = run_alone(cold, p, SAMPLED)
    assert run_alone(warm, p, SAMPLED) == expected
    hits = warm.engine.blocks.prefix_hits
    assert run_alone(warm, p, SAMPLED) == expected
    assert warm.engine.blocks.prefix_hits > hits


def test_matches_transformers_greedy(moe_dir):
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    llm = make_llm(moe_dir)
    ps = prompts(3, 5, 30, seed=6)
    for p, o in zip(ps, llm.generate(ps, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              eos_token_id=None, pad_token_id=0)[0, len(p):]
        assert o.token_ids == ref.tolist()


@pytest.mark.parametrize("method", ["ngram", "self:1"])
def test_speculative_greedy_equals_plain(moe_dir, method):
    motif = [5, 9, 200, 17]
    ps = [motif * 5 + [i] + motif for i in range(4)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = make_llm(moe_dir).generate(ps, params)
    llm = make_llm(moe_dir, speculative=method, num_speculative_tokens=3)
    spec = llm.generate(ps, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.speculator.stats.num_draft_tokens > 0
