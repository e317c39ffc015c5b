"""Sliding-window layers' K/V in groups with their own block tables (minerva/kernels/kv_layout.py).

The reference is the engine with one block table for all layers (`hybrid_kv_cache=False`),
which keeps every layer's K/V for the whole context: the same kernels read the same keys,
so every token must come out the same. Around that: what the layouts are, how many
blocks a long request holds, and that a prompt too long for the one-table pool runs.
"""

from __future__ import annotations

import random

import pytest

from minerva import LLM, SamplingParams
from minerva.engine.block_manager import NULL, BlockManager
from minerva.errors import MinervaError
from minerva.kernels.kv_layout import kv_layout, single
from tests.helpers.tiny_hf import VOCAB, save


# --- layouts ---------------------------------------------------------------------------------

def test_gemma3_layout_groups_of_three():
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]  # Gemma 3 270M
    layout = kv_layout(windows, 32768)
    assert layout.group_windows == (512, 512, 512, 512, 512, None)
    assert layout.num_pools == 3
    assert [layout.layer_group[i] for i in (5, 11, 17)] == [5, 5, 5]
    assert layout.layer_group[:5] == (0, 0, 0, 1, 1) and layout.layer_pool[:5] == (0, 1, 2, 0, 1)
    # within a group, each layer has its own pool tensor
    for g in range(6):
        pools = [p for p, gg in zip(layout.layer_pool, layout.layer_group) if gg == g]
        assert sorted(pools) == [0, 1, 2]


def test_layouts_of_other_mixes():
    assert kv_layout([None] * 4, 100) == single(4)
    alone = kv_layout([8] * 4, 100)  # every layer windowed (Mistral): one windowed group
    assert alone.group_windows == (8,) and alone.layer_pool == (0, 1, 2, 3)
    assert kv_layout([8, None] * 2, 100).group_windows == (8, None)  # GPT-OSS: halves
    assert kv_layout([200, None] * 2, 100) == single(4)  # a window as long as the context frees nothing
    odd = kv_layout([None, 8, 8, 8, 8], 100)  # 1 and 4: groups of one layer
    assert odd.num_pools == 1 and odd.group_windows == (None, 8, 8, 8, 8)


def test_blocks_for_and_max_tokens():
    layout = kv_layout([8, None], 1000)  # groups (8,), (None,)
    # 100 tokens in blocks of 4: 25 global blocks; the windowed group at most its window of 8
    # behind a step of 16 tokens: (7 + 16) / 4 rounded up, plus the block cut by the window's start
    assert layout.blocks_for(100, 4, 16) == 25 + 7
    assert layout.blocks_for(10, 4, 16) == 3 + 3  # short: both groups hold every block
    assert layout.blocks_for(100, 4, None) == 50  # steps of any size: the whole context
    assert layout.max_tokens(32, 4, 16, 1000) == 100
    assert layout.max_tokens(31, 4, 16, 1000) == 96
    assert single(2).max_tokens(32, 4, None, 1000) == 128


# --- the block manager ---------------------------------------------------------------------

def test_windowed_group_gives_back_what_left_the_window():
    bm = BlockManager(20, 4, layout=kv_layout([6, None], 100))
    tokens = list(range(30))
    assert bm.allocate("r", tokens, 30) == 0
    assert bm.num_used_blocks == 16
    bm.commit("r", tokens, 30)  # the next query, at 30, sees 25..30: blocks 6 and 7 of the window
    windowed, full = map(list, bm.block_tables("r"))
    assert windowed[:6] == [NULL] * 6 and NULL not in windowed[6:] and NULL not in full
    assert bm.num_used_blocks == 8 + 2
    assert bm.allocate("r", tokens + [1, 2, 3], 33) == 0  # a ninth block in each group
    assert bm.num_used_blocks == 9 + 3
    bm.free("r")
    assert bm.num_used_blocks == 0


def committed_and_freed(bm: BlockManager, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Run a request over tokens, commit and free it; its tables as they were at the end."""
    bm.allocate("a", tokens, len(tokens))
    bm.commit("a", tokens, len(tokens))
    windowed, full = map(list, bm.block_tables("a"))
    bm.free("a")
    return windowed, full


def test_prefix_hit_needs_only_the_window():
    bm = BlockManager(40, 4, layout=kv_layout([6, None], 100), cache_blocks=40)
    tokens = list(range(40))
    windowed, _ = committed_and_freed(bm, tokens)
    assert windowed[:8] == [NULL] * 8  # gone back at the commit: behind the window of the query at 40
    assert len(bm._cached) == 20
    # a fresh request takes the 20 blocks never used, then the oldest cached ones: the
    # windowed group's first 8
    assert bm.allocate("x", [7] * 56, 56) == 0
    bm.free("x")
    assert len(bm._cached) == 12
    assert bm.allocate("b", tokens + [99], 41) == 40  # the query at 40 sees 35..40: blocks 8, 9
    windowed, full = map(list, bm.block_tables("b"))
    assert windowed[:8] == [NULL] * 8 and NULL not in windowed[8:] and NULL not in full


def test_prefix_hit_shortens_when_its_window_was_evicted():
    bm = BlockManager(40, 4, layout=kv_layout([6, None], 100))
    tokens = list(range(40))
    windowed, _ = committed_and_freed(bm, tokens)
    for b in (windowed[8], windowed[9]):  # make them the next blocks handed out, and take them
        bm._free.move_to_end(b, last=False)
    assert bm.allocate("x", [7] * 4, 4) == 0
    # a hit at 40 or 36 needs block 8; at 32 the query sees 27..32: blocks 6 and 7, still cached
    assert bm.allocate("b", tokens + [99], 41) == 32
    windowed, full = map(list, bm.block_tables("b"))
    assert windowed[:6] == [NULL] * 6 and NULL not in windowed[6:] and NULL not in full


# --- the engine ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return save(tmp_path_factory.mktemp("hybrid-gemma"), "gemma3")  # windows of 8 on layers 0 and 2


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    return save(tmp_path_factory.mktemp("hybrid-gpt-oss"), "gpt-oss")


def make_llm(path, **options):
    options.setdefault("kv_cache_memory", 16 << 20)
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, **options)


def long_prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(40, 120))] for _ in range(n)]


@pytest.mark.parametrize("path", ["gemma_dir", "gpt_oss_dir"])
@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 24}, {"speculative": "ngram"}],
                         ids=["whole-prompts", "chunks-of-24", "ngram-guesses"])
def test_same_tokens_as_one_table(request, path, options):
    path = request.getfixturevalue(path)
    ps = long_prompts(6)
    ps.append(ps[0] + ps[1][:30])  # a prefix hit past the window
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)]
    outs = {}
    for hybrid in (True, False):
        llm = make_llm(path, hybrid_kv_cache=hybrid, **options)
        assert llm.engine.cache.layout.num_groups == (2 if hybrid else 1)
        first = llm.generate(ps[:3], [params[i % 2] for i in range(3)], use_tqdm=False)
        rest = llm.generate(ps[3:], [params[i % 2] for i in range(3, len(ps))], use_tqdm=False)
        outs[hybrid] = [o.outputs[0].token_ids for o in first + rest]
        assert llm.engine.blocks.prefix_hits > 0
        llm.close()
    assert outs[True] == outs[False]


def test_long_request_holds_only_its_window(gemma_dir):
    llm = make_llm(gemma_dir, max_num_batched_tokens=16)
    e = llm.engine
    prompt = long_prompts(1, seed=3)[0] * 3  # 40-120 tokens a copy
    stream = llm.stream(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    most = 0
    for _ in stream:
        most = max(most, e.blocks.num_used_blocks)
    n = len(prompt) + 8
    global_blocks = -(-n // 4)
    assert most <= e.blocks.blocks_for(n) < 2 * global_blocks
    assert most > global_blocks  # the windowed group holds some
    llm.close()


def test_prompt_too_long_for_one_table_runs(gemma_dir):
    one = make_llm(gemma_dir, hybrid_kv_cache=False)
    per_block = one.engine.cache.nbytes // one.engine.cache.num_blocks  # all 4 layers' K/V of 4 tokens
    one.close()
    budget = 40 * per_block  # 160 tokens in one table
    prompt = long_prompts(1, seed=4)[0] * 3
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    one = make_llm(gemma_dir, hybrid_kv_cache=False, kv_cache_memory=budget)
    assert len(prompt) + 16 > one.engine.max_model_len
    with pytest.raises(MinervaError, match="KV cache"):
        one.generate([prompt], params, use_tqdm=False)
    one.close()
    hybrid = make_llm(gemma_dir, kv_cache_memory=budget, max_num_batched_tokens=16)
    assert hybrid.engine.max_model_len >= len(prompt) + 16
    out = hybrid.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    hybrid.close()
    roomy = make_llm(gemma_dir, hybrid_kv_cache=False)
    assert out == roomy.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    roomy.close()


def test_int8_pools_same_tokens_as_one_table(gemma_dir):
    ps = long_prompts(3, seed=7)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = []
    for hybrid in (True, False):
        llm = make_llm(gemma_dir, hybrid_kv_cache=hybrid, kv_cache_dtype_k="int8", kv_cache_dtype_v="int8",
                       max_num_batched_tokens=32)
        outs.append([o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)])
        llm.close()
    assert outs[0] == outs[1]


def test_gemma3_file_past_its_window(gemma3_gguf):
    """The real Gemma 3 270M: its GGUF's 512-token window on 15 of 18 layers, a 700-token
    prompt computed in chunks of 256, then a prefix hit past the window."""
    rng = random.Random(1)
    prompt = [rng.randrange(1000, 20000) for _ in range(700)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = []
    for hybrid in (True, False):
        llm = LLM(str(gemma3_gguf), device="cpu", kv_cache_memory=64 << 20, max_num_batched_tokens=256,
                  hybrid_kv_cache=hybrid)
        layout = llm.engine.cache.layout
        assert layout.group_windows == ((512,) * 5 + (None,) if hybrid else (None,))
        first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        again = llm.generate([prompt + [1234, 5678]], params, use_tqdm=False)[0].outputs[0].token_ids
        assert llm.engine.blocks.prefix_hits >= 688
        outs.append((first, again))
        llm.close()
    assert outs[0] == outs[1]
