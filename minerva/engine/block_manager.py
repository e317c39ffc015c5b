"""KV block bookkeeping for the paged cache: block tables, reference counts, prefix caching.

The pool holds `num_blocks` blocks of `block_size` tokens; token p of a request
lives in block `table[p // block_size]`. This file only does the bookkeeping; the
tensors live in the model runner.

Prefix caching: once a full block's K/V are written (`commit`), the block is
registered under a hash chained to the hash of the block before it, so one digest
names every token from the start of the sequence to the block's end (K/V at a
position depend on all earlier tokens). A new request takes the leading blocks
whose hashes are cached instead of recomputing them. A block whose last user is
gone stays cached, and findable, until a fresh allocation needs it: free blocks
without a hash are reused first, then cached ones, least recently freed first.

Blocks never used yet are handed out last: a fresh allocation takes one only when no free
block is without a hash and the cached blocks number at most `cache_blocks` (the engine's
`--prefix-cache-memory`; a quarter of the pool by default). The pool's memory pages are
touched on first write, so a process's resident memory follows the blocks its requests
needed at once plus that much cache, not the pool's size.

Sliding-window layers (a `KVLayout` with windowed groups): each group of layers has its
own table per request, all drawing from the one pool. Once a windowed group's block lies
wholly behind the window of a request's next query, `commit` gives it back (it stays
cached like any freed block) and the table keeps NULL in its place. A prefix hit then
needs every global group's blocks up to the hit, and only the windowed groups' blocks
that the first query after it can see.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from minerva.kernels.kv_layout import KVLayout, single

DIGEST_SIZE = 16  # 128-bit blake2b: accidental collisions are out of reach
NULL = -1  # a windowed group's table entry whose block went back to the pool


def root_hash(salt: bytes) -> bytes:
    """The chain's parent for a sequence's first block: the model's identity enters every hash here."""
    return hashlib.blake2b(bytes(salt), digest_size=DIGEST_SIZE, person=b"minerva-kv").digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one full block, chained to its parent's hash (fixed-width input, so unambiguous)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=DIGEST_SIZE).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 salt: bytes = b"", layout: KVLayout | None = None, step_tokens: int | None = None,
                 cache_blocks: int | None = None):
        """`layout`: the groups of layers with a table each (default: one for all layers);
        `step_tokens`: the most new tokens of a request in one step, which bounds what a
        windowed group holds (`blocks_for`); `cache_blocks`: the cached blocks kept before
        a never-used block is taken (default a quarter of the pool; num_blocks: every block
        is used before any cached one is evicted)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.layout, self.step_tokens = layout or single(1), step_tokens
        self.windows = self.layout.group_windows
        self._salt, self._root = bytes(salt), root_hash(salt)
        self._roots: dict[str, bytes] = {}  # the requests whose blocks hash under a salt of their own
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks  # set while the block is in _cached
        self._cached: dict[bytes, int] = {}  # chained hash (+ group, see _key) -> block id
        # Used blocks with ref count 0 in reuse order: un-hashed ones first, then cached ones,
        # least recently freed first. An OrderedDict so a cache hit can take one from the middle.
        self._free: OrderedDict[int, None] = OrderedDict()
        self._high = 0  # blocks ever handed out: ids from here on were never used (all free)
        self._cache_cap = max(1, num_blocks // 4) if cache_blocks is None else max(0, cache_blocks)
        # per request, a table per group: int64 arrays, so a step's tables become one tensor at
        # the speed of a copy (a windowed group's table is mostly NULL at long contexts)
        self._tables: dict[str, list[array]] = {}
        self._chains: dict[str, list[bytes]] = {}  # hashes of each request's committed full blocks
        self._first: dict[str, list[int]] = {}  # per request and group, the table's first non-NULL entry
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found there

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - self._high

    @property
    def num_touched_blocks(self) -> int:
        """Blocks used at least once: the part of the pool whose memory is resident."""
        return self._high

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def cache_bytes(self, pool_bytes: int) -> int:
        """The most bytes of a `pool_bytes` pool that cached blocks of finished requests hold
        beyond what running requests touched."""
        return pool_bytes * self._cache_cap // self.num_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_table(self, req_id: str, group: int = 0) -> list[int]:
        tables = self._tables.get(req_id)
        return [] if tables is None else list(tables[group])

    def block_tables(self, req_id: str) -> list[array]:
        """req_id's table for each group as int64 arrays (NULL where a windowed group gave a
        block back)."""
        return [array("q", t) for t in self._tables.get(req_id, [()] * len(self.windows))]

    def blocks_for(self, num_tokens: int) -> int:
        """The most blocks one request of num_tokens tokens holds at once."""
        return self.layout.blocks_for(num_tokens, self.block_size, self.step_tokens)

    def num_blocks_needed(self, req_id: str, num_tokens: int) -> int:
        """Fresh blocks req_id needs to hold num_tokens tokens (for a new request: before prefix hits)."""
        n = self._blocks_for(num_tokens)
        return sum(max(0, n - len(t)) for t in self._tables.get(req_id, [[] for _ in self.windows]))

    def allocate(self, req_id: str, token_ids: Sequence[int], num_tokens: int, salt: bytes = b"") -> int | None:
        """Make req_id's tables cover its first num_tokens tokens, all or nothing.

        The first call for a request (no table yet) first takes the cached blocks matching
        the prefix of token_ids, never all of it: the last token must be computed to have
        logits; with a `salt` (a LoRA adapter's: its K/V differ from the base model's), only
        blocks cached under the same salt. Returns the tokens served from the cache (0 on
        later calls), or None, with nothing changed, when there are not enough free blocks.
        """
        if num_tokens < 0:
            raise ValueError(f"allocate({req_id!r}): num_tokens must be >= 0, got {num_tokens}")
        n = self._blocks_for(num_tokens)
        tables = self._tables.get(req_id)
        if tables is not None:
            if sum(max(0, n - len(t)) for t in tables) > self.num_free_blocks:
                return None
            for t in tables:
                t.extend(self._take_fresh() for _ in range(n - len(t)))
            return 0
        if len(token_ids) == 0:
            raise ValueError(f"allocate({req_id!r}): a new request needs at least one token")
        root = root_hash(self._salt + b"\x00" + salt) if salt else self._root
        hits, chain = self._lookup(token_ids, root)
        held = [b for t in hits for b in t if b != NULL]
        fresh = sum(max(0, n - len(t)) for t in hits)
        if sum(self._ref[b] == 0 for b in held) + fresh > self.num_free_blocks:
            return None
        for b in held:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        for t in hits:
            t.extend(self._take_fresh() for _ in range(n - len(t)))
        self._tables[req_id] = [array("q", t) for t in hits]
        self._chains[req_id] = chain
        if salt:
            self._roots[req_id] = root
        self._first[req_id] = [t.count(NULL) for t in hits]  # NULLs only ever lead a table
        hit_tokens = len(chain) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += hit_tokens
        return hit_tokens

    def commit(self, req_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """The first num_computed tokens of req_id have their K/V written: cache its full
        blocks, then give back the windowed groups' blocks that no later query can see.

        Idempotent. A block whose content is already cached under another block id is
        left out: the existing entry may be shared, and one entry per content suffices.
        """
        tables = self._tables.get(req_id)
        if tables is None:
            raise ValueError(f"commit({req_id!r}): unknown request; allocate it first")
        if num_computed > min(len(token_ids), len(tables[0]) * self.block_size):
            raise ValueError(f"commit({req_id!r}, num_computed={num_computed}): only {len(token_ids)} tokens "
                             f"known and {len(tables[0]) * self.block_size} slots allocated")
        if self.enable_prefix_caching:
            bs, chain = self.block_size, self._chains[req_id]
            for i in range(len(chain), num_computed // bs):
                h = block_hash(chain[-1] if chain else self._roots.get(req_id, self._root),
                               token_ids[i * bs:(i + 1) * bs])
                chain.append(h)
                for g, t in enumerate(tables):
                    b, key = t[i], self._key(h, g)
                    if b != NULL and self._hash[b] is None and key not in self._cached:
                        self._hash[b] = key
                        self._cached[key] = b
        first = self._first[req_id]
        for g, (window, t) in enumerate(zip(self.windows, tables)):
            if window is not None:  # the next query, at num_computed, sees from num_computed - window + 1
                behind = min(len(t), max(0, num_computed - window + 1) // self.block_size)
                if behind > first[g]:
                    self._release(list(t[first[g]:behind]))
                    t[first[g]:behind] = array("q", [NULL]) * (behind - first[g])
                    first[g] = behind

    def free(self, req_id: str) -> None:
        """Release req_id's blocks; cached ones stay findable until evicted. Unknown req_id: no-op."""
        tables = self._tables.pop(req_id, None)
        if tables is not None:
            del self._chains[req_id]
            self._roots.pop(req_id, None)
            for t, first in zip(tables, self._first.pop(req_id)):
                self._release(list(t[first:]))

    def rollback(self, req_id: str, num_tokens: int) -> None:
        """Shrink req_id's tables to the blocks that hold its first num_tokens tokens (rejected drafts).

        Blocks wholly past num_tokens are released; committed ones keep their hash, since
        their K/V still match the tokens they were hashed with. A committed block cut in
        the middle is kept but un-hashed, as its tail is about to be rewritten; if other
        requests share it, rewriting would corrupt their K/V, so that is a ValueError.
        """
        tables = self._tables.get(req_id)
        if tables is None:
            raise ValueError(f"rollback({req_id!r}): unknown request")
        if num_tokens < 0:
            raise ValueError(f"rollback({req_id!r}): num_tokens must be >= 0, got {num_tokens}")
        keep, full = self._blocks_for(num_tokens), num_tokens // self.block_size
        for window, t in zip(self.windows, tables):
            seen = max(0, num_tokens - window + 1) // self.block_size if window is not None else keep
            if NULL in t[seen:keep]:
                raise ValueError(f"rollback({req_id!r}, {num_tokens}): the K/V the next query's window needs "
                                 "were given back; roll back only tokens computed since the last commit")
        chain = self._chains[req_id]
        cut = [t[full] for t in tables if full < keep and full < len(chain) and t[full] != NULL]
        for b in cut:  # the cut block was committed
            if self._ref[b] > 1:
                raise ValueError(f"rollback({req_id!r}, {num_tokens}): block {b} is shared by "
                                 f"{self._ref[b] - 1} other request(s); roll back only uncommitted tokens")
        for b in cut:
            if self._hash[b] is not None:
                del self._cached[self._hash[b]]
                self._hash[b] = None
        del chain[full:]
        first = self._first[req_id]
        for g, t in enumerate(tables):
            self._release(list(t[max(keep, first[g]):]))
            del t[keep:]
            first[g] = min(first[g], keep)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def _key(h: bytes, group: int) -> bytes:
        """The cache key of group `group`'s block under chained hash h (group 0: h itself)."""
        return h if group == 0 else h + group.to_bytes(2, "little")

    def _lookup(self, token_ids: Sequence[int], root: bytes) -> tuple[list[list[int]], list[bytes]]:
        """Per group, the cached blocks matching token_ids' prefix (NULL where a windowed
        group needs none), leaving at least one token out, and their hashes."""
        empty: list[list[int]] = [[] for _ in self.windows]
        if not self.enable_prefix_caching:
            return empty, []
        bs, parent = self.block_size, root
        found: list[list[int | None]] = [[] for _ in self.windows]
        chain: list[bytes] = []
        for i in range((len(token_ids) - 1) // bs):
            parent = block_hash(parent, token_ids[i * bs:(i + 1) * bs])
            row = [self._cached.get(self._key(parent, g)) for g in range(len(self.windows))]
            if any(b is None for b, w in zip(row, self.windows) if w is None):
                break  # a global group must have every block up to the hit
            for f, b in zip(found, row):
                f.append(b)
            chain.append(parent)
        # the longest hit whose first query (at position n * bs) finds its window in every group
        for n in range(len(chain), 0, -1):
            first = [max(0, n * bs - w + 1) // bs if w is not None else 0 for w in self.windows]
            if all(None not in f[lo:n] for f, lo in zip(found, first)):
                tables = [[NULL] * lo + f[lo:n] for f, lo in zip(found, first)]
                return tables, chain[:n]
        return empty, []

    def _take_fresh(self) -> int:
        """A free block for new content, evicting its old cache entry if it had one: a used one
        without a hash, else a never-used one while the cache holds no more than its share,
        else the least recently freed cached one."""
        if self._high < self.num_blocks and (not self._free or (self._hash[next(iter(self._free))] is not None
                                                                 and len(self._free) <= self._cache_cap)):
            b = self._high
            self._high += 1
            self._ref[b] = 1
            return b
        b, _ = self._free.popitem(last=False)
        if self._hash[b] is not None:
            del self._cached[self._hash[b]]
            self._hash[b] = None
        self._ref[b] = 1
        return b

    def _release(self, block_ids: list[int]) -> None:
        # Last block first, so a request's tail is evicted before its head: later
        # requests more likely share the start of a prompt than its end.
        for b in reversed(block_ids):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if self._hash[b] is None:  # nothing worth keeping: reuse it first
                    self._free.move_to_end(b, last=False)
