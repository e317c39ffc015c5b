"""Tensor parallelism on this machine: two ranks (this process and one worker it starts),
against the one-process model on both real models, plus the faults a user can meet."""

from __future__ import annotations

import json
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
    # a small pool, so that the batched test below preempts; guesses verified over several rows
    # of logits gathered from both ranks: prompt lookup's, and for Gemma 3 the early exit's,
    # whose draft forwards run on both ranks' shards too
    tp = LLM(str(single.path), device="cpu", dtype="float32", activations="float", tensor_parallel_size=2,
             kv_cache_memory=(3 << 20) if name == "smollm2" else (8 << 20),
             speculative="ngram" if name == "smollm2" else "self:4")
    yield tp, single
    tp.close()
    torch.set_num_threads(threads)


def engine_logits(llm, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits of `ids` through the engine's own runner and pool (on the workers too), in chunks."""
    blocks = llm.engine.blocks
    assert blocks.allocate("logits", ids, len(ids)) == 0  # nothing cached: every position computed here
    try:
        tables = blocks.block_tables("logits")
        return torch.cat([llm.engine.runner.forward([Seq(ids[s:s + chunk], s, tables, len(ids[s:s + chunk]))])
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
    engine = tp.engine  # speculating with prompt lookup (see the fixture)
    before = engine.scheduler.num_preemptions
    batched = [o.outputs[0].token_ids for o in tp.generate(PROMPTS * 2, params)]  # the repeats hit the prefix cache
    alone = [tp.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    want = [single.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == alone * 2
    assert alone == want
    if tp.config.architecture == "llama":  # the small pool of SmolLM2's pair: ten requests cannot all fit
        assert engine.scheduler.num_preemptions > before
    assert engine.speculator.stats.num_draft_tokens > 0  # the requests alone ran with guesses


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


@pytest.mark.parametrize("args, env, words", [
    (["-tp", "0"], {}, "--tensor-parallel-size must be an integer >= 1, got 0"),
    (["-tp", "-2"], {}, "--tensor-parallel-size must be an integer >= 1, got -2"),
    (["-tp", "2"], {"MINERVA_TP_TIMEOUT": "soon"}, "MINERVA_TP_TIMEOUT must be a number of seconds > 0"),
    (["-tp", "2"], {"MINERVA_TP_EXCHANGE": "carrier-pigeon"}, "MINERVA_TP_EXCHANGE must be auto, gloo or shm"),
    (["-tp", "2", "--speculative", "self:30"], {}, "--speculative self:30 must use fewer layers than the model's 30"),
])
def test_bad_parallel_settings_are_one_error_before_any_rank_starts(smollm2_gguf, args, env, words):
    proc = subprocess.run([sys.executable, "-m", "minerva", "generate", str(smollm2_gguf), "hi", "-n", "2", *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert_clean_error(proc, words)  # one error line: no worker started to repeat it


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


# ------------------------------------------------------------------ two hosts


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: (namespace, address, interface) of each."""
    tag = f"{os.getpid() % 10000}"
    hosts = [(f"minerva-a{tag}", "10.231.7.1", f"mva{tag}"), (f"minerva-b{tag}", "10.231.7.2", f"mvb{tag}")]
    made = _sh("ip", "netns", "add", hosts[0][0])
    if made.returncode != 0:
        pytest.skip(f"cannot create network namespaces here ({made.stderr.strip() or 'ip netns add failed'})")
    try:
        _sh("ip", "netns", "add", hosts[1][0])
        steps = [("ip", "link", "add", hosts[0][2], "type", "veth", "peer", "name", hosts[1][2])]
        for ns, addr, dev in hosts:
            steps += [("ip", "link", "set", dev, "netns", ns),
                      ("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                      ("ip", "-n", ns, "link", "set", dev, "up"),
                      ("ip", "-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            done = _sh(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot join the namespaces with a veth pair: {' '.join(step)}: {done.stderr.strip()}")
        yield hosts
    finally:
        for ns, _, _ in hosts:
            _sh("ip", "netns", "del", ns)


def test_two_hosts_over_gloo(two_hosts, smollm2_gguf):
    """One rank in each namespace, started as torchrun starts them; the second sees a /dev/shm of
    its own, so the ranks find they cannot share memory and talk gloo over TCP. Rank 0 serves an
    OpenAI request in its namespace; the answer equals the one-process greedy reply."""
    (ns0, addr0, dev0), (ns1, _, dev1) = two_hosts
    port, master = 8931, 29731
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": addr0, "MASTER_PORT": str(master),
           "MINERVA_TP_TIMEOUT": "60"}
    serve = [sys.executable, "-m", "minerva", "serve", str(smollm2_gguf), "--served-model-name", "m",
             "--kv-cache-memory", str(64 << 20), "--dtype", "float32", "--activations", "float"]
    rank0 = subprocess.Popen(["ip", "netns", "exec", ns0, *serve, "--host", addr0, "--port", str(port)],
                             env={**env, "RANK": "0", "GLOO_SOCKET_IFNAME": dev0},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    private_shm = f"mount -t tmpfs tmpfs /dev/shm && exec {' '.join(serve)}"
    rank1 = subprocess.Popen(["ip", "netns", "exec", ns1, "unshare", "-m", "sh", "-c", private_shm],
                             env={**env, "RANK": "1", "GLOO_SOCKET_IFNAME": dev1},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client = ("import httpx, json, sys, time\n"
              "for _ in range(600):\n"
              "    try:\n"
              f"        r = httpx.post('http://{addr0}:{port}/v1/chat/completions', timeout=60, json=json.loads(sys.argv[1]))\n"
              "        break\n"
              "    except httpx.TransportError:\n"
              "        time.sleep(0.2)\n"
              "print(r.status_code)\n"
              "print(r.json()['choices'][0]['message']['content'] if r.status_code == 200 else r.text)\n")
    body = {"model": "m", "max_tokens": 16, "temperature": 0, "messages": [{"role": "user", "content": "Say hello."}]}
    try:
        asked = subprocess.run(["ip", "netns", "exec", ns0, sys.executable, "-c", client, json.dumps(body)],
                               capture_output=True, text=True, timeout=180)
        assert asked.returncode == 0, (asked.stderr, rank0.poll(), rank1.poll())
        status, text = asked.stdout.split("\n", 1)
        assert status == "200", asked.stdout
        from minerva import LLM

        single = LLM(str(smollm2_gguf), dtype="float32", activations="float", kv_cache_memory=64 << 20)
        want = single.chat([{"role": "user", "content": "Say hello."}],
                           SamplingParams(max_tokens=16, temperature=0)).outputs[0].text
        assert text.rstrip("\n") == want
        # rank 1 dies: the next request fails with the reason and rank 0 exits 1 (gloo sees the closed socket)
        rank1.kill()
        rank1.wait()
        again = subprocess.run(["ip", "netns", "exec", ns0, sys.executable, "-c", client, json.dumps(body)],
                               capture_output=True, text=True, timeout=180)
        assert again.stdout.startswith("500"), (again.stdout, again.stderr)
        code = rank0.wait(timeout=60)
        assert code == 1, rank0.stderr.read()[-3000:]
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in (rank0, rank1):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    err0 = rank0.stderr.read()
    assert "exchanging over gloo" in err0, err0
    assert "tensor parallelism failed" in err0 and "Traceback" not in err0, err0


# ------------------------------------------------------- every architecture


TINY_RUN = r"""
import json, sys, torch
from minerva import LLM
from minerva.engine.runner import Seq

def logits(path, quantize, tp):
    llm = LLM(path, dtype="float32", activations="float", quantize=quantize, tensor_parallel_size=tp,
              kv_cache_memory=8 << 20)
    ids = [(7 * i + 3) % 250 + 1 for i in range(40)]
    blocks = llm.engine.blocks
    blocks.allocate("x", ids, len(ids))
    tables = blocks.block_tables("x")
    out = torch.cat([llm.engine.runner.forward([Seq(ids[s:s + 16], s, tables, len(ids[s:s + 16]))])
                     for s in range(0, len(ids), 16)])
    llm.close()
    return out

result = {}
for path, quantize in json.loads(sys.argv[1]):
    want, got = logits(path, quantize, 1), logits(path, quantize, 2)
    err = ((got - want).abs().max(-1).values / want.abs().max(-1).values).max().item()
    result[path] = [err, bool(torch.equal(got.argmax(-1), want.argmax(-1)))]
print("RESULT " + json.dumps(result))
"""


def test_tiny_architectures_split_like_one_process(tmp_path):
    """Each architecture's own parts through two ranks against one process, on tiny random
    checkpoints: Llama quantized to Q8_0 at load, Mistral (sliding window) to Q4_1, Gemma 3
    (QK-norm, sandwich norms), Qwen3-MoE (a router on every rank, the experts split) and
    GPT-OSS (attention sinks and biases split by head, MXFP4 experts cut in whole blocks)."""
    from transformers import GptOssConfig, Qwen3MoeConfig

    from tests.helpers.tiny_hf import CONFIGS, MOE, save, to_mxfp4

    wide = {**MOE, "moe_intermediate_size": 64}  # 2 ranks x 32-column blocks
    gpt_oss = CONFIGS["gpt-oss"]()
    gpt_oss.intermediate_size = 64
    runs = [(save(tmp_path, "llama-untied"), "int8"), (save(tmp_path, "mistral-sliding"), "int4"),
            (save(tmp_path, "gemma3"), None),
            (save(tmp_path, "qwen3-moe-wide", config=Qwen3MoeConfig(**wide, num_experts=4, num_experts_per_tok=2,
                                                                     tie_word_embeddings=False)), None),
            (to_mxfp4(save(tmp_path, "gpt-oss-wide", config=gpt_oss)), None)]
    assert isinstance(gpt_oss, GptOssConfig)
    proc = subprocess.run([sys.executable, "-c", TINY_RUN, json.dumps([[str(p), q] for p, q in runs])],
                          capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    for path, (err, same_argmax) in json.loads(line[len("RESULT "):]).items():
        assert err < 1e-4 and same_argmax, (path, err)
