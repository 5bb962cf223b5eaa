"""KV block pool with automatic prefix caching. Integers only: block ids, never tensors.

Every block is in exactly one of three states:
  used    ref_count > 0, in some live sequence's block table;
  cached  ref_count == 0 but holding a full, hashed block another request may reuse;
          kept in LRU order and evicted oldest-first when a fresh block is needed;
  free    ref_count == 0 and holding nothing reusable.

A full block is identified by a chained hash of (previous block's hash, its token ids), so a
hit on block i implies the whole prefix up to i matches. The token ids are compared on a hit
as well. A block becomes findable only once its KV is computed (``publish_full_blocks``, called
after the step ran), never at allocation, so a hit can never read KV that is still being written.

Tenants are kept apart by the request's cache salt (``Engine.generate(cache_salt=...)``): the
chain of a salted sequence starts from a seed derived from its salt instead of b"", so its
blocks hash differently from the same tokens under another salt or none, and the salt is
compared on a hit too. Unsalted chains are exactly what they were before salts existed.
``block_hashes`` computes the chain outside any pool (a router finding which replica holds a
prompt's prefix) with the same code the pool uses.

Every operation costs O(blocks it touches); nothing scans the pool, except ``check_invariants``
which tests call.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC

from engine_gpu.sequence import Sequence

# blake2b personalisation of a salt's seed: a seed is never the hash of any block (those are
# computed without one), so no salted chain can continue an unsalted one by construction.
SALT_PERSON = b"kv-prefix-salt1"


def chain_hash(prev: bytes, token_ids: SequenceABC[int]) -> bytes:
    """Hash of a full block given its predecessor's hash (its chain's seed for the first block).

    A cryptographic hash rather than Python's ``hash``: users choose the tokens, and a
    crafted collision would let one user's prompt reuse KV computed for another prefix.
    """
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def salt_seed(cache_salt: str) -> bytes:
    """What a chain starts from: b"" unsalted (the hashes as they always were), else a 16-byte
    digest of the salt under its own personalisation."""
    if not cache_salt:
        return b""
    return hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=16, person=SALT_PERSON).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: SequenceABC[int], block_size: int, num_blocks: int,
                        seed: bytes) -> None:
    """Append to ``hashes`` (the chain of ``token_ids``' first ``len(hashes)`` full blocks, from
    ``seed``) until it covers ``num_blocks`` blocks. The one place a chain is computed."""
    while len(hashes) < num_blocks:
        i = len(hashes)
        prev = hashes[-1] if hashes else seed
        hashes.append(chain_hash(prev, token_ids[i * block_size : (i + 1) * block_size]))


def block_hashes(token_ids: SequenceABC[int], block_size: int, cache_salt: str = "") -> list[bytes]:
    """The chained hashes of every full block of ``token_ids``, bit for bit those the block
    manager registers for a sequence with these tokens and ``cache_salt``. Pure: no pool, no torch."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, block_size, len(token_ids) // block_size, salt_seed(cache_salt))
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_count = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks  # set only while registered in _by_hash
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # compared on every hit
        self._salts: list[str] = [""] * num_blocks  # the publishing request's cache salt, compared on every hit
        self._by_hash: dict[bytes, int] = {}
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack; pops block 0 first
        self._cached: OrderedDict[int, None] = OrderedDict()  # oldest-freed first: the eviction order

    # ---- counts (O(1)) ----

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation may take: free ones first, then cached ones by eviction."""
        return len(self._free) + len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_count[block_id]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache lookup ----

    def _seq_block_hash(self, seq: Sequence, index: int) -> bytes:
        """Hash of the seq's full block ``index``, extending its memoised chain as needed."""
        if len(seq.block_hashes) <= index:
            seed = salt_seed(seq.cache_salt) if not seq.block_hashes else b""  # the seed matters only at block 0
            extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, index + 1, seed)
        return seq.block_hashes[index]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of ``seq.token_ids``; no side effects.

        Stops one token short of the end: the last token must be computed so that the
        step produces logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // bs):
            block_id = self._by_hash.get(self._seq_block_hash(seq, i))
            if (block_id is None or self._salts[block_id] != seq.cache_salt
                    or self._tokens[block_id] != tuple(seq.token_ids[i * bs : (i + 1) * bs])):
                break
            hits.append(block_id)
        return hits

    # ---- allocation ----

    def can_allocate(self, cached_blocks: list[int], num_tokens: int) -> bool:
        """Whether a waiting seq can take ``cached_blocks`` and fresh blocks up to ``num_tokens``."""
        fresh = self.blocks_for(num_tokens) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self._ref_count[b] == 0)  # leave the cached pool
        return fresh + revived <= self.num_available_blocks

    def allocate(self, seq: Sequence, cached_blocks: list[int], num_tokens: int) -> None:
        """Give a seq with no blocks the ``cached_blocks`` hits plus fresh blocks covering ``num_tokens``."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        assert self.can_allocate(cached_blocks, num_tokens)
        for block_id in cached_blocks:  # claim hits before fresh blocks can evict them
            if self._ref_count[block_id] == 0:
                del self._cached[block_id]
            self._ref_count[block_id] += 1
        seq.block_table = list(cached_blocks)
        seq.table_snapshot = None
        seq.num_published_blocks = len(cached_blocks)
        self.may_append(seq, num_tokens)

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.num_available_blocks

    def may_append(self, seq: Sequence, num_tokens: int) -> None:
        """Grow the seq's table to cover positions [0, num_tokens); a no-op inside its last block."""
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_fresh())
            seq.table_snapshot = None

    def _take_fresh(self) -> int:
        if self._free:
            block_id = self._free.pop()
        else:
            block_id, _ = self._cached.popitem(last=False)  # evict the least recently freed
            h = self._hash[block_id]
            assert h is not None and self._by_hash[h] == block_id
            del self._by_hash[h]
            self._hash[block_id] = None
            self._tokens[block_id] = None
            self._salts[block_id] = ""
        assert self._ref_count[block_id] == 0
        self._ref_count[block_id] = 1
        return block_id

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        """Give back the seq's blocks past those covering positions [0, num_tokens): the blocks
        that rejected draft tokens were written to. Never published (only computed tokens are),
        so they go straight to the free pool. Returns how many were freed."""
        keep = max(self.blocks_for(num_tokens), seq.num_published_blocks)
        tail = seq.block_table[keep:]
        for block_id in reversed(tail):
            assert self._ref_count[block_id] == 1 and self._hash[block_id] is None, f"block {block_id} is shared"
            self._ref_count[block_id] = 0
            self._free.append(block_id)
        del seq.block_table[keep:]
        seq.table_snapshot = None
        return len(tail)

    def deallocate(self, seq: Sequence) -> None:
        """Drop the seq's references. Tail blocks go into the LRU first, so they are evicted
        before the prefix blocks that other requests are likelier to share."""
        for block_id in reversed(seq.block_table):
            assert self._ref_count[block_id] > 0, f"block {block_id} freed more often than taken"
            self._ref_count[block_id] -= 1
            if self._ref_count[block_id] == 0:
                if self._hash[block_id] is not None:
                    self._cached[block_id] = None
                else:
                    self._free.append(block_id)
        seq.block_table = []
        seq.table_snapshot = None
        seq.num_published_blocks = 0

    # ---- publishing computed blocks ----

    def publish_full_blocks(self, seq: Sequence) -> None:
        """Make the seq's blocks that are full of computed KV findable by later requests.

        Call after ``seq.num_computed_tokens`` advanced. If an identical block is already
        registered (two requests computed the same prefix in the same step), this copy stays
        private and returns to the free pool when released.
        """
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if self.enable_prefix_caching:
            bs = self.block_size
            for i in range(seq.num_published_blocks, full):
                h = self._seq_block_hash(seq, i)
                if h in self._by_hash:
                    continue
                block_id = seq.block_table[i]
                assert self._hash[block_id] is None and self._ref_count[block_id] > 0
                self._by_hash[h] = block_id
                self._hash[block_id] = h
                self._tokens[block_id] = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self._salts[block_id] = seq.cache_salt
        seq.num_published_blocks = max(seq.num_published_blocks, full)

    # ---- testing aid ----

    def check_invariants(self, block_tables: Iterable[list[int]]) -> None:
        """Raise AssertionError unless the pool is consistent with the live ``block_tables``.
        O(pool size): for tests and debugging, not for the step loop."""
        expected = [0] * self.num_blocks
        for table in block_tables:
            for block_id in table:
                expected[block_id] += 1
        if expected != self._ref_count:
            bad = [b for b in range(self.num_blocks) if expected[b] != self._ref_count[b]]
            raise AssertionError(f"ref counts disagree with block tables at blocks {bad[:10]}")
        free, cached = set(self._free), set(self._cached)
        if len(free) != len(self._free) or free & cached:
            raise AssertionError("a block is listed twice among free and cached blocks")
        for block_id in range(self.num_blocks):
            in_pool = block_id in free or block_id in cached
            if in_pool == (self._ref_count[block_id] > 0):
                raise AssertionError(f"block {block_id}: ref {self._ref_count[block_id]}, in free/cached pool {in_pool}")
            if (block_id in cached) != (self._ref_count[block_id] == 0 and self._hash[block_id] is not None):
                raise AssertionError(f"block {block_id}: cached-pool membership does not match its hash")
        for h, block_id in self._by_hash.items():
            if self._hash[block_id] != h or self._tokens[block_id] is None:
                raise AssertionError(f"hash index points at block {block_id}, which holds something else")
        if sum(h is not None for h in self._hash) != len(self._by_hash):
            raise AssertionError("a block carries a hash that the index does not know")
        if any(salt and h is None for salt, h in zip(self._salts, self._hash, strict=True)):
            raise AssertionError("an unregistered block still carries a cache salt")
