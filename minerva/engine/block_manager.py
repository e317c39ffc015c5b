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
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

DIGEST_SIZE = 16  # 128-bit blake2b: accidental collisions are out of reach


def root_hash(salt: bytes) -> bytes:
    """The chain's parent for a sequence's first block: the model's identity enters every hash here."""
    return hashlib.blake2b(bytes(salt), digest_size=DIGEST_SIZE, person=b"minerva-kv").digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one full block, chained to its parent's hash (fixed-width input, so unambiguous)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=DIGEST_SIZE).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 salt: bytes = b""):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._root = root_hash(salt)
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks  # set while the block is in _cached
        self._cached: dict[bytes, int] = {}  # chained hash -> block id
        # Blocks with ref count 0 in reuse order: un-hashed ones first, then cached ones,
        # least recently freed first. An OrderedDict so a cache hit can take one from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._chains: dict[str, list[bytes]] = {}  # hashes of each request's committed full blocks
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found there

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_table(self, req_id: str) -> list[int]:
        return list(self._tables.get(req_id, ()))

    def num_blocks_needed(self, req_id: str, num_tokens: int) -> int:
        """Fresh blocks req_id needs to hold num_tokens tokens (for a new request: before prefix hits)."""
        return max(0, self._blocks_for(num_tokens) - len(self._tables.get(req_id, ())))

    def allocate(self, req_id: str, token_ids: Sequence[int], num_tokens: int) -> int | None:
        """Make req_id's table cover its first num_tokens tokens, all or nothing.

        The first call for a request (no table yet) first takes the cached blocks matching
        the prefix of token_ids, never all of it: the last token must be computed to have
        logits. Returns the tokens served from the cache (0 on later calls), or None, with
        nothing changed, when there are not enough free blocks.
        """
        if num_tokens < 0:
            raise ValueError(f"allocate({req_id!r}): num_tokens must be >= 0, got {num_tokens}")
        table = self._tables.get(req_id)
        if table is not None:
            fresh = self._blocks_for(num_tokens) - len(table)
            if fresh > len(self._free):
                return None
            table.extend(self._take_fresh() for _ in range(fresh))
            return 0
        if len(token_ids) == 0:
            raise ValueError(f"allocate({req_id!r}): a new request needs at least one token")
        hits, chain = self._lookup(token_ids)
        fresh = max(0, self._blocks_for(num_tokens) - len(hits))
        if sum(self._ref[b] == 0 for b in hits) + fresh > len(self._free):
            return None
        for b in hits:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        self._tables[req_id] = hits + [self._take_fresh() for _ in range(fresh)]
        self._chains[req_id] = chain
        hit_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += hit_tokens
        return hit_tokens

    def commit(self, req_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """The first num_computed tokens of req_id have their K/V written: cache its full blocks.

        Idempotent. A block whose content is already cached under another block id is
        left out: the existing entry may be shared, and one entry per content suffices.
        """
        table = self._tables.get(req_id)
        if table is None:
            raise ValueError(f"commit({req_id!r}): unknown request; allocate it first")
        if num_computed > min(len(token_ids), len(table) * self.block_size):
            raise ValueError(f"commit({req_id!r}, num_computed={num_computed}): only {len(token_ids)} tokens "
                             f"known and {len(table) * self.block_size} slots allocated")
        if not self.enable_prefix_caching:
            return
        bs, chain = self.block_size, self._chains[req_id]
        for i in range(len(chain), num_computed // bs):
            h = block_hash(chain[-1] if chain else self._root, token_ids[i * bs:(i + 1) * bs])
            chain.append(h)
            b = table[i]
            if self._hash[b] is None and h not in self._cached:
                self._hash[b] = h
                self._cached[h] = b

    def free(self, req_id: str) -> None:
        """Release req_id's blocks; cached ones stay findable until evicted. Unknown req_id: no-op."""
        table = self._tables.pop(req_id, None)
        if table is not None:
            del self._chains[req_id]
            self._release(table)

    def rollback(self, req_id: str, num_tokens: int) -> None:
        """Shrink req_id's table to the blocks that hold its first num_tokens tokens (rejected drafts).

        Blocks wholly past num_tokens are released; committed ones keep their hash, since
        their K/V still match the tokens they were hashed with. A committed block cut in
        the middle is kept but un-hashed, as its tail is about to be rewritten; if other
        requests share it, rewriting would corrupt their K/V, so that is a ValueError.
        """
        table = self._tables.get(req_id)
        if table is None:
            raise ValueError(f"rollback({req_id!r}): unknown request")
        if num_tokens < 0:
            raise ValueError(f"rollback({req_id!r}): num_tokens must be >= 0, got {num_tokens}")
        keep, full = self._blocks_for(num_tokens), num_tokens // self.block_size
        chain = self._chains[req_id]
        if full < keep and full < len(chain):  # the cut block was committed
            b = table[full]
            if self._ref[b] > 1:
                raise ValueError(f"rollback({req_id!r}, {num_tokens}): block {b} is shared by "
                                 f"{self._ref[b] - 1} other request(s); roll back only uncommitted tokens")
            if self._hash[b] is not None:
                del self._cached[self._hash[b]]
                self._hash[b] = None
        del chain[full:]
        self._release(table[keep:])
        del table[keep:]

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _lookup(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """The cached blocks matching token_ids' prefix, leaving at least one token out, and their hashes."""
        if not self.enable_prefix_caching:
            return [], []
        bs, parent = self.block_size, self._root
        hits: list[int] = []
        chain: list[bytes] = []
        for i in range((len(token_ids) - 1) // bs):
            parent = block_hash(parent, token_ids[i * bs:(i + 1) * bs])
            b = self._cached.get(parent)
            if b is None:
                break
            hits.append(b)
            chain.append(parent)
        return hits, chain

    def _take_fresh(self) -> int:
        """A free block for new content, evicting its old cache entry if it had one."""
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
