"""BlockManager: allocation, reference counts, prefix-cache hits, eviction order, rollback.

The reference for the property test is a model of the KV cache itself: every slot
written records the token prefix its K/V were computed from, and every request must
read back exactly its own prefix at every position it counts as computed. That holds
only if hits, sharing, eviction and rollback are all right.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minerva.engine.block_manager import NULL, BlockManager, block_hash, root_hash
from minerva.kernels.kv_layout import kv_layout


def snapshot(bm: BlockManager):
    return (list(bm._ref), list(bm._hash), dict(bm._cached), list(bm._free),
            {r: [list(g) for g in t] for r, t in bm._tables.items()}, {r: list(c) for r, c in bm._chains.items()},
            bm.prefix_queries, bm.prefix_hits)


def run(bm: BlockManager, rid: str, tokens: list[int]) -> int:
    """Allocate a new request for its whole prompt and commit it, as if prefilled."""
    hit = bm.allocate(rid, tokens, len(tokens))
    assert hit is not None
    bm.commit(rid, tokens, len(tokens))
    return hit


# --- allocation ---------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_allocation_covers_num_tokens(block_size):
    for n in range(20):
        bm = BlockManager(20, block_size)
        assert bm.allocate("r", [7] * max(n, 1), n) == 0
        need = math.ceil(n / block_size)
        assert len(bm.block_table("r")) == need
        assert len(set(bm.block_table("r"))) == need
        assert (bm.num_used_blocks, bm.num_free_blocks) == (need, 20 - need)
        assert bm.usage == need / 20


def test_growth_and_num_blocks_needed():
    bm = BlockManager(8, 4)
    assert bm.num_blocks_needed("r", 9) == 3
    assert bm.allocate("r", [1] * 5, 5) == 0
    assert bm.num_blocks_needed("r", 5) == 0
    assert bm.num_blocks_needed("r", 9) == 1
    table = bm.block_table("r")
    assert bm.allocate("r", [1] * 6, 9) == 0
    assert bm.block_table("r")[:2] == table and len(bm.block_table("r")) == 3
    assert bm.allocate("r", [1] * 6, 2) == 0  # already covered: nothing changes
    assert len(bm.block_table("r")) == 3
    assert bm.block_table("unknown") == []


def test_all_or_nothing():
    bm = BlockManager(4, 4)
    bm.allocate("a", [1] * 8, 8)
    before = snapshot(bm)
    assert bm.allocate("b", [2] * 12, 12) is None
    assert bm.allocate("a", [1] * 8, 17) is None
    assert snapshot(bm) == before
    assert bm.block_table("b") == []
    assert bm.allocate("b", [2] * 8, 8) == 0
    assert bm.num_free_blocks == 0 and bm.usage == 1.0


def test_all_or_nothing_keeps_free_cached_hits_in_place():
    bm = BlockManager(3, 2)
    run(bm, "a", [1, 2, 3, 4, 5])
    bm.free("a")
    before = snapshot(bm)
    # Two cached blocks would be hits, but 9 tokens need three more fresh blocks.
    assert bm.allocate("b", list(range(1, 10)), 9) is None
    assert snapshot(bm) == before
    assert bm.allocate("c", [1, 2, 3, 4, 5], 5) == 4


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    bm = BlockManager(4, 4)
    with pytest.raises(ValueError, match="at least one token"):
        bm.allocate("r", [], 0)
    with pytest.raises(ValueError, match="num_tokens"):
        bm.allocate("r", [1], -1)
    with pytest.raises(ValueError, match="unknown request"):
        bm.commit("r", [1], 1)
    with pytest.raises(ValueError, match="unknown request"):
        bm.rollback("r", 0)
    bm.allocate("r", [1] * 6, 4)
    with pytest.raises(ValueError, match="slots allocated"):
        bm.commit("r", [1] * 6, 5)
    bm.free("nobody")  # no-op


# --- reference counts and hits ------------------------------------------------------------

def test_shared_prefix_reference_counts():
    bm = BlockManager(8, 4)
    prompt = list(range(10))  # two full blocks and a partial one
    run(bm, "a", prompt)
    assert bm.allocate("b", prompt, len(prompt)) == 8
    a, b = bm.block_table("a"), bm.block_table("b")
    assert a[:2] == b[:2] and a[2] != b[2]
    assert [bm._ref[x] for x in a] == [2, 2, 1]
    assert bm.num_used_blocks == 4
    bm.free("a")
    assert bm.num_used_blocks == 3 and [bm._ref[x] for x in b] == [1, 1, 1]
    bm.free("b")
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8
    assert bm.allocate("c", prompt, len(prompt)) == 8  # still cached after both freed
    assert bm.block_table("c")[:2] == a[:2]


@pytest.mark.parametrize("length, hit", [(1, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12)])
def test_same_prompt_hits_full_blocks_but_never_the_last_token(length, hit):
    bm = BlockManager(16, 4)
    prompt = list(range(100, 100 + length))
    assert run(bm, "a", prompt) == 0
    assert (bm.prefix_queries, bm.prefix_hits) == (length, 0)
    assert bm.allocate("b", prompt, length) == hit
    assert (bm.prefix_queries, bm.prefix_hits) == (2 * length, hit)
    assert bm.allocate("b", prompt, length + 4) == 0  # later calls look nothing up
    assert (bm.prefix_queries, bm.prefix_hits) == (2 * length, hit)


@pytest.mark.parametrize("k", range(4))
def test_one_token_changed_in_block_k_hits_blocks_before_k(k):
    bm = BlockManager(16, 4)
    prompt = list(range(17))
    run(bm, "a", prompt)
    other = list(prompt)
    other[4 * k + 2] = 999
    assert bm.allocate("b", other, len(other)) == 4 * k
    assert bm.block_table("b")[:k] == bm.block_table("a")[:k]
    assert set(bm.block_table("b")[k:]).isdisjoint(bm.block_table("a"))
    # Same tokens at a later position are a different prefix: block 1 alone never hits.
    assert bm.allocate("c", prompt[4:], 13) == 0


def test_salt_separates_models():
    prompt = list(range(9))
    a, b, a2 = (BlockManager(8, 4, salt=salt) for salt in (b"model-a", b"model-b", b"model-a"))
    for bm in (a, b, a2):
        run(bm, "r", prompt)
    assert len(a._cached) == 2
    assert set(a._cached).isdisjoint(b._cached)
    assert set(a._cached) == set(a2._cached)
    assert root_hash(b"model-a") != root_hash(b"model-b")
    assert block_hash(root_hash(b"x"), [1, 2]) != block_hash(root_hash(b"y"), [1, 2])
    assert block_hash(root_hash(b"x"), [1, 2]) != block_hash(root_hash(b"x"), [2, 1])


def test_prefix_caching_off():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    prompt = list(range(7))
    run(bm, "a", prompt)
    assert bm.allocate("b", prompt, 7) == 0
    assert not bm._cached and all(h is None for h in bm._hash)
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)


def test_commit_is_idempotent_and_keeps_the_existing_entry():
    bm = BlockManager(8, 2)
    prompt = [1, 2, 3, 4, 5]
    bm.allocate("a", prompt, 5)
    bm.allocate("b", prompt, 5)  # both computed before either committed: no hits
    bm.commit("a", prompt, 5)
    entries = dict(bm._cached)
    bm.commit("a", prompt, 5)
    bm.commit("b", prompt, 5)
    bm.commit("b", prompt, 3)
    assert bm._cached == entries and set(entries.values()) == set(bm.block_table("a")[:2])
    bm.free("a")
    bm.free("b")
    # b's duplicates hold nothing findable, so they are reused before a's cached blocks.
    assert bm.allocate("c", [9, 9, 9], 3) == 0
    assert set(bm.block_table("c")).isdisjoint(entries.values())
    assert bm.allocate("d", prompt, 5) == 4


# --- eviction -----------------------------------------------------------------------------

def test_eviction_least_recently_freed_first_tail_before_head():
    bm = BlockManager(4, 2)
    run(bm, "a", [1, 2, 3, 4])
    run(bm, "b", [5, 6, 7, 8])
    a, b = bm.block_table("a"), bm.block_table("b")
    bm.free("a")
    bm.free("b")
    taken = []
    for i in range(4):
        assert bm.allocate(f"x{i}", [0, i], 1) == 0
        taken += bm.block_table(f"x{i}")
    assert taken == [a[1], a[0], b[1], b[0]]


def test_never_used_blocks_come_after_a_quarter_of_the_pool_in_cache():
    """Blocks never used (pool memory never touched) are handed out only while the cached
    blocks are at most `cache_blocks` (a quarter of the pool by default), so a stream of distinct prompts does not
    walk through the whole pool: resident memory follows use plus that much cache."""
    for cap, touched in ((None, range(25, 25 + 2 + 2)), (10, range(10, 10 + 2 + 2)), (100, [100])):
        bm = BlockManager(100, 4, cache_blocks=cap)
        for i in range(60):
            run(bm, f"r{i}", [1000 + 8 * i + j for j in range(8)])  # two full blocks, cached when freed
            bm.free(f"r{i}")
        assert bm.num_touched_blocks in touched
        assert bm.num_free_blocks == 100
        assert bm.allocate("again", [1000 + 8 * 59 + j for j in range(8)] + [0], 9) == 8  # the last is cached
    bm = BlockManager(100, 4, enable_prefix_caching=False)
    for i in range(60):
        run(bm, f"r{i}", list(range(8)))
        bm.free(f"r{i}")
    assert bm.num_touched_blocks == 2  # nothing cached: the same two blocks every time


def test_evicted_block_no_longer_hits():
    bm = BlockManager(4, 2)
    run(bm, "a", [1, 2, 3, 4, 5])  # blocks [1,2] [3,4] [5]; the first two cached
    run(bm, "b", [9])
    bm.free("a")
    bm.free("b")
    # Free queue: b's and a's partial blocks (un-hashed, reused first), then [3,4], then [1,2].
    assert bm.allocate("x", [0] * 5, 5) == 0  # three fresh blocks: the oldest cached one goes
    assert bm.allocate("w", [1, 2, 3, 4, 5], 1) == 2  # [3,4] was evicted; [1,2] still hits
    assert len(bm._cached) == 1


def test_cache_hit_takes_block_out_of_the_free_queue():
    bm = BlockManager(3, 2)
    run(bm, "a", [1, 2, 3])
    bm.free("a")
    assert bm.num_free_blocks == 3
    assert bm.allocate("b", [1, 2, 3], 3) == 2
    assert bm.num_free_blocks == 1
    hit = bm.block_table("b")[0]
    assert hit not in bm._free and bm._ref[hit] == 1
    assert bm.allocate("c", [7], 2) == 0
    assert bm.allocate("d", [7], 1) is None  # the hit block is not handed out again


# --- rollback -----------------------------------------------------------------------------

def test_rollback_releases_uncommitted_blocks_unhashed():
    bm = BlockManager(8, 4)
    tokens = list(range(6))
    bm.allocate("r", tokens, 6)
    bm.commit("r", tokens, 6)  # block 0 full and committed
    bm.allocate("r", tokens + [6, 7, 8, 9, 10], 11)  # drafts: blocks 1 and 2
    table = bm.block_table("r")
    bm.rollback("r", 7)
    assert bm.block_table("r") == table[:2]
    assert bm._ref[table[2]] == 0 and bm._hash[table[2]] is None
    assert next(iter(bm._free)) == table[2]  # un-hashed: reused first
    bm.rollback("r", 100)  # already smaller: nothing to do
    assert bm.block_table("r") == table[:2]
    bm.rollback("r", 0)
    assert bm.block_table("r") == [] and bm.num_used_blocks == 0
    assert bm.allocate("s", tokens, 6) == 4  # block 0 stays cached


def test_rollback_keeps_committed_blocks_past_the_cut_cached():
    bm = BlockManager(8, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    run(bm, "r", tokens)
    table = bm.block_table("r")
    bm.rollback("r", 2)
    assert bm.block_table("r") == table[:1]
    assert bm.allocate("s", tokens + [7], 7) == 6  # K/V of [3,4], [5,6] still match their hashes
    # Recommitting r with different tokens after the cut registers new content.
    new = [1, 2, 8, 8]
    bm.allocate("r", new, 4)
    bm.commit("r", new, 4)
    assert bm.allocate("t", new + [0], 5) == 4


def test_rollback_into_a_committed_block_unhashes_it():
    bm = BlockManager(8, 4)
    tokens = list(range(9))
    run(bm, "r", tokens)
    table = bm.block_table("r")
    bm.rollback("r", 6)  # cuts block 1, whose tail will be rewritten
    assert bm.block_table("r") == table[:2]
    assert bm._hash[table[1]] is None and bm._hash[table[0]] is not None
    assert bm.allocate("s", tokens, 9) == 4
    new = tokens[:6] + [50, 51]
    bm.commit("r", new, 8)
    assert bm._hash[table[1]] is not None
    assert bm.allocate("t", new + [0], 9) == 8


def test_rollback_into_a_shared_block_is_refused():
    bm = BlockManager(8, 4)
    tokens = list(range(9))
    run(bm, "a", tokens)
    assert bm.allocate("b", tokens, 9) == 8
    before = snapshot(bm)
    with pytest.raises(ValueError, match="shared"):
        bm.rollback("b", 6)
    assert snapshot(bm) == before
    bm.rollback("b", 4)  # a cut on a block boundary rewrites nothing
    assert bm.block_table("b") == bm.block_table("a")[:1]


# --- property test: random interleavings ---------------------------------------------------

ALPHABET = st.integers(0, 2)  # few symbols so prefixes repeat


def chain_hash(bm: BlockManager, prefix: tuple[int, ...]) -> bytes:
    h, bs = bm._root, bm.block_size
    for i in range(0, len(prefix), bs):
        h = block_hash(h, prefix[i:i + bs])
    return h


# one table for all layers; a global and a windowed group; one windowed group of two layers;
# a global group and two windowed ones
LAYOUTS = [None, kv_layout([None, 3], 99), kv_layout([2, 2], 99), kv_layout([None, None, 5, 5, 5, 5], 99)]


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(1, 16), caching=st.booleans(),
                salt=st.sampled_from([b"", b"m"]), system=st.lists(ALPHABET, min_size=12, max_size=12),
                layout=st.sampled_from(LAYOUTS))
    def setup(self, block_size, num_blocks, caching, salt, system, layout):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching, salt=salt, layout=layout)
        self.system = system  # a shared start most prompts take part of, so hits are common
        self.reqs: dict[str, dict] = {}  # rid -> tokens, computed, allocated
        self.kv: dict[tuple[int, int], tuple] = {}  # (block, slot) -> (group, prefix its K/V encode)
        self.queries = self.hits = 0
        self.next_id = 0

    def _write(self, rid: str, start: int, end: int) -> None:
        r, bs = self.reqs[rid], self.bm.block_size
        for g, table in enumerate(self.bm.block_tables(rid)):
            for p in range(start, end):
                self.kv[(table[p // bs], p % bs)] = (g, tuple(r["tokens"][:p + 1]))
        r["computed"] = end

    @rule(cut=st.integers(0, 12), suffix=st.lists(ALPHABET, max_size=4), frac=st.floats(0, 1))
    def add(self, cut, suffix, frac):
        prompt = self.system[:cut] + suffix
        if not prompt:
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        n = round(frac * len(prompt))
        before = snapshot(self.bm)
        hit = self.bm.allocate(rid, prompt, n)
        if hit is None:
            assert snapshot(self.bm) == before
            return
        assert hit % self.bm.block_size == 0 and hit < len(prompt)
        if self.bm.enable_prefix_caching:
            self.queries, self.hits = self.queries + len(prompt), self.hits + hit
        else:
            assert hit == 0
        self.reqs[rid] = {"tokens": list(prompt), "computed": hit, "allocated": max(hit, n)}
        # Compute what was allocated beyond the hits, as a prefill chunk would.
        self._write(rid, hit, max(hit, n))
        self.bm.commit(rid, prompt, max(hit, n))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), n=st.integers(1, 5), drafts=st.lists(ALPHABET, min_size=1, max_size=3))
    def grow(self, data, n, drafts):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs[rid]
        if r["computed"] == len(r["tokens"]):
            r["tokens"] += drafts  # a sampled token, maybe with speculative drafts
        end = min(len(r["tokens"]), r["computed"] + n)
        before = snapshot(self.bm)
        got = self.bm.allocate(rid, r["tokens"], end)
        if got is None:
            assert snapshot(self.bm) == before
            return
        assert got == 0
        r["allocated"] = max(r["allocated"], end)
        self._write(rid, r["computed"], end)
        self.bm.commit(rid, r["tokens"], end)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), k=st.integers(0, 4))
    def rollback(self, data, k):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs[rid]
        keep = max(0, len(r["tokens"]) - k)
        before = snapshot(self.bm)
        try:
            self.bm.rollback(rid, keep)
        except ValueError as e:
            bs, tables = self.bm.block_size, self.bm.block_tables(rid)
            if "window" in str(e):  # behind a windowed group's last commit
                assert any(NULL in t[max(0, keep - w + 1) // bs:] for t, w in zip(tables, self.bm.windows) if w)
            else:  # only a shared block refuses
                assert keep % bs and any(self.bm._ref[t[keep // bs]] > 1 for t in tables)
            assert snapshot(self.bm) == before
            return
        r["tokens"] = r["tokens"][:keep]
        r["computed"] = min(r["computed"], keep)
        r["allocated"] = min(r["allocated"], keep)
        assert len(self.bm.block_table(rid)) == min(len(before[4][rid][0]), math.ceil(keep / self.bm.block_size))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))  # finished or aborted: the same to blocks
        del self.reqs[rid]
        self.bm.free(rid)

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        refs = [0] * bm.num_blocks
        for rid, tables in bm._tables.items():
            held = [b for t in tables for b in t if b != NULL]
            assert len(set(held)) == len(held)
            for b in held:
                refs[b] += 1
        assert refs == bm._ref
        assert list(bm._free) == [b for b in bm._free if refs[b] == 0]  # keys are unique by construction
        never_used = range(bm.num_touched_blocks, bm.num_blocks)
        assert set(bm._free).isdisjoint(never_used)
        assert set(bm._free) | set(never_used) == {b for b in range(bm.num_blocks) if refs[b] == 0}
        assert all(bm._hash[b] is None for b in never_used)
        assert bm.num_free_blocks == sum(r == 0 for r in refs)
        assert bm.num_used_blocks == sum(r > 0 for r in refs)
        # Un-hashed free blocks are reused before cached ones.
        hashed = [bm._hash[b] is not None for b in bm._free]
        assert hashed == sorted(hashed)
        assert {bm._hash[b]: b for b in range(bm.num_blocks) if bm._hash[b] is not None} == bm._cached
        for h, b in bm._cached.items():  # every cache entry names exactly the K/V its block holds
            group, prefix = self.kv[(b, bm.block_size - 1)]
            assert h == bm._key(chain_hash(bm, prefix), group)
            for s in range(bm.block_size):
                assert self.kv[(b, s)] == (group, prefix[:len(prefix) - bm.block_size + s + 1])
        assert (bm.prefix_queries, bm.prefix_hits) == (self.queries, self.hits)
        assert set(bm._tables) == set(self.reqs)
        bs = bm.block_size
        for rid, r in self.reqs.items():
            for g, (table, window) in enumerate(zip(bm.block_tables(rid), bm.windows)):
                assert len(table) >= math.ceil(r["allocated"] / bs)
                # every computed position the next query can see reads back its own prefix
                lo = 0 if window is None else max(0, r["computed"] - window + 1)
                for p in range(lo, r["computed"]):
                    assert self.kv.get((table[p // bs], p % bs)) == (g, tuple(r["tokens"][:p + 1]))
                if window is not None:  # and a windowed group holds no block wholly behind it
                    assert all(b == NULL for b in table[:lo // bs])
                leading = next((i for i, b in enumerate(table) if b != NULL), len(table))
                assert NULL not in table[leading:] and bm._first[rid][g] == leading

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for rid in list(self.reqs):
            self.bm.free(rid)
        assert self.bm.num_used_blocks == 0 and self.bm.num_free_blocks == self.bm.num_blocks
        assert not any(self.bm._ref)


BlockManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                                 suppress_health_check=[HealthCheck.too_slow])
test_block_manager_random_interleavings = BlockManagerMachine.TestCase
