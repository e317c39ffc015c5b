"""Tensor parallelism on this machine: two ranks (this process and one worker it starts),
against the one-process model on both real models, plus the faults a user can meet."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import gguf
import httpx
import pytest
import torch

from minerva.engine.runner import Seq
from minerva.engine.sampler import SamplingParams
from minerva.errors import MinervaError
from minerva.formats.gguf import GGUFFile
from minerva.models.config import ModelConfig
from minerva.models.loader import read_config
from minerva.parallel.shard import plan
from tests.helpers.cli import assert_clean_error, run

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colours:", "1, 2, 3, 4,"]


def config(heads: int, kv: int, ffn: int = 1536, vocab: int = 1000) -> ModelConfig:
    return ModelConfig("llama", vocab, 64 * heads, ffn, 2, heads, kv, 64, 1e-5, 1e4, 2048)


def test_heads_split_in_whole_kv_groups():
    # 9 query heads in 3 KV groups (SmolLM2): 1 group and 2 (rank 0, which also runs the engine, the fewer)
    a, b = plan(config(9, 3), 0, 2), plan(config(9, 3), 1, 2)
    assert (a.heads, a.kv_heads, b.heads, b.kv_heads) == ((0, 3), (0, 1), (3, 9), (1, 3))
    # one KV head (Gemma 3 270M) is replicated; its 4 query heads are shared out
    a, b = plan(config(4, 1), 0, 2), plan(config(4, 1), 1, 2)
    assert (a.heads, a.kv_heads, b.heads, b.kv_heads) == ((0, 2), (0, 1), (2, 4), (0, 1))
    # feed-forward columns in whole 256-blocks where the size allows, the vocabulary in equal rows
    assert (a.ffn, b.ffn) == ((0, 768), (768, 1536))
    assert (a.vocab, b.vocab, b.vocab_per_rank) == ((0, 500), (500, 1000), 500)
    with pytest.raises(MinervaError, match="9 attention heads .3 KV heads. do not split 4 ways"):
        plan(config(9, 3), 0, 4)
    with pytest.raises(MinervaError, match="feed-forward size of 96 does not split"):
        plan(config(8, 8, ffn=96), 0, 4)


def test_packed_shards_are_the_dequantized_slices(gemma3_gguf):
    """Every Q4_K/Q5_0/Q6_K/Q8_0 matrix of Gemma 3 cut as a rank holds it: the gguf package's
    dequantization of the cut bytes is its dequantization of the whole, sliced."""
    f = GGUFFile(gemma3_gguf)
    cfg = read_config(gemma3_gguf)
    seen = set()
    for rank in (0, 1):
        shard = plan(cfg, rank, 2)
        for blk_name, name in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_output", "o_proj"),
                               ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            for layer in (0, 5):
                t = f.tensors[f"blk.{layer}.{blk_name}.weight"]
                whole = torch.from_numpy(gguf.dequantize(t.read().numpy(), t.qtype)).reshape(t.shape)
                part, shape = shard.packed(f"layers.{layer}.{name}", t.read(), t.qtype, t.shape)
                got = torch.from_numpy(gguf.dequantize(part.contiguous().numpy(), t.qtype)).reshape(shape)
                axis, (lo, hi) = shard.rule(name)
                assert torch.equal(got, whole[:, lo:hi] if axis == "in" else whole[lo:hi]), (name, t.qtype)
                seen.add(t.qtype.name)
    assert {"Q5_0", "Q8_0"} & seen and len(seen) >= 2, seen


def _restore_threads(fn):
    threads = torch.get_num_threads()
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def pair(request):
    """(two-rank LLM, one-process LLM) of one real model, both float32 with float activations."""
    from minerva import LLM

    name = request.param
    single = request.getfixturevalue(f"{name}_llm")
    threads = torch.get_num_threads()
    # a small pool, so that the batched test below preempts
    tp = LLM(str(single.path), device="cpu", dtype="float32", activations="float", tensor_parallel_size=2,
             kv_cache_memory=(3 << 20) if name == "smollm2" else (8 << 20))
    yield tp, single
    tp.close()
    torch.set_num_threads(threads)


def engine_logits(llm, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits of `ids` through the engine's own runner and pool (on the workers too), in chunks."""
    blocks = llm.engine.blocks
    assert blocks.allocate("logits", ids, len(ids)) == 0  # nothing cached: every position computed here
    try:
        table = blocks.block_table("logits")
        return torch.cat([llm.engine.runner.forward([Seq(ids[s:s + chunk], s, table, len(ids[s:s + chunk]))])
                          for s in range(0, len(ids), chunk)])
    finally:
        blocks.free("logits")


def test_logits_match_one_process(pair):
    tp, single = pair
    ids = tp.tokenizer.encode(" ".join(PROMPTS) * 4)
    got = engine_logits(tp, ids, chunk=37)
    want = engine_logits(single, ids, chunk=37)
    assert got.shape == want.shape == (len(ids), single.config.vocab_size)
    err = ((got - want).abs().max(dim=-1).values / want.abs().max(dim=-1).values).max().item()
    assert err < 1e-4, err
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_batched_equals_alone_and_one_process(pair):
    tp, single = pair
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine = tp.engine
    before = engine.scheduler.num_preemptions
    batched = [o.outputs[0].token_ids for o in tp.generate(PROMPTS * 2, params)]  # the repeats hit the prefix cache
    alone = [tp.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    want = [single.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == alone * 2
    assert alone == want
    if tp.config.architecture == "llama":  # the small pool of SmolLM2's pair: ten requests cannot all fit
        assert engine.scheduler.num_preemptions > before


def test_each_rank_holds_its_share(pair):
    tp, single = pair
    whole = single.loaded.compute_bytes
    assert len(tp.group.weight_bytes) == 2
    for b in tp.group.weight_bytes:
        assert 0.4 * whole < b <= 0.6 * whole, (b, whole)
    assert tp.group.comm.stats()["all_reduce_calls"] > 0


# ------------------------------------------------------------------ faults


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_that_never_arrive_end_with_one_error(smollm2_gguf):
    """Rank 0 of two under torchrun's variables, and no rank 1: a clear error within the timeout."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "MINERVA_TP_TIMEOUT": "3"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "minerva", "generate", str(smollm2_gguf), "hi", "-n", "2"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert_clean_error(proc, "rank 0 of 2 could not join", "MASTER_PORT")
    assert time.monotonic() - start < 60


def test_a_port_in_use_ends_with_one_error(smollm2_gguf):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(busy.getsockname()[1]), "MINERVA_TP_TIMEOUT": "3"}
        proc = subprocess.run([sys.executable, "-m", "minerva", "generate", str(smollm2_gguf), "hi", "-n", "2"],
                              capture_output=True, text=True, timeout=120, env=env)
    assert_clean_error(proc, "could not join the tensor-parallel group")


def test_a_model_that_does_not_split_fails_before_any_rank_starts(smollm2_gguf):
    assert_clean_error(run("generate", str(smollm2_gguf), "hi", "--tensor-parallel-size", "4"),
                       "--tensor-parallel-size 4 cannot split this model", "9 attention heads")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_serve_answers_and_exits_when_a_worker_dies(smollm2_gguf):
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "minerva", "serve", str(smollm2_gguf), "--port", str(port),
                               "--tensor-parallel-size", "2", "--kv-cache-memory", str(96 << 20),
                               "--served-model-name", "smollm2-135m"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.communicate()[1]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        body = {"model": "smollm2-135m", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "Say hello."}]}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        workers = [p for p in _children(server.pid) if "minerva.parallel.worker" in open(f"/proc/{p}/cmdline").read()]
        assert len(workers) == 1
        # a long request in flight when the worker dies: it fails with the reason, and the server exits 1
        pool = ThreadPoolExecutor(1)
        long = pool.submit(httpx.post, url + "/v1/chat/completions", timeout=120,
                           json={**body, "max_tokens": 3000, "ignore_eos": True})
        time.sleep(2.0)
        assert not long.done()
        os.kill(workers[0], signal.SIGKILL)
        r = long.result(timeout=60)
        assert r.status_code == 500 and "tensor-parallel rank 1" in r.json()["error"]["message"], r.text
        code = server.wait(timeout=30)
        err = server.stderr.read()
        assert code == 1, err
        assert "tensor-parallel rank 1" in err and "Traceback" not in err, err
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
