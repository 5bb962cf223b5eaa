"""Block pool and prefix cache, driven by hand: no scheduler, no model."""

from __future__ import annotations

import hashlib
from array import array

import pytest

from engine_gpu import block_manager as bm_module
from engine_gpu.block_manager import BlockManager, block_hashes
from engine_gpu.sequence import Sequence
from llm_shared.contract import Priority, SamplingParams

BS = 4


def make_seq(tokens: list[int], request_id: str = "r", cache_salt: str = "") -> Sequence:
    return Sequence(
        request_id=request_id,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        params=SamplingParams(),
        priority=Priority.INTERACTIVE,
        arrival=0.0,
        seq_no=0,
        cache_salt=cache_salt,
    )


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """Allocate the whole sequence with whatever the cache has, as the scheduler does."""
    hits = bm.match_prefix(seq)
    assert bm.can_allocate(hits, seq.num_tokens)
    bm.allocate(seq, hits, seq.num_tokens)
    seq.num_computed_tokens = len(hits) * BS
    return hits


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Pretend a step computed the rest of the sequence's KV."""
    seq.num_computed_tokens = seq.num_tokens
    bm.publish_full_blocks(seq)


def test_allocation_grows_at_block_boundaries_and_counts_add_up() -> None:
    bm = BlockManager(8, BS)
    seq = make_seq(list(range(10)))
    admit(bm, seq)
    assert len(seq.block_table) == 3
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.num_cached_blocks) == (3, 5, 0)
    bm.may_append(seq, 12)
    assert len(seq.block_table) == 3
    assert bm.can_append(seq, 13)
    bm.may_append(seq, 13)
    assert len(seq.block_table) == 4
    assert not bm.can_append(seq, 8 * BS + 1)
    bm.check_invariants([seq.block_table])
    bm.deallocate(seq)  # nothing was computed, so nothing is cacheable
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.num_cached_blocks) == (0, 8, 0)
    assert seq.block_table == []
    bm.check_invariants([])


def test_only_full_computed_blocks_become_cacheable() -> None:
    bm = BlockManager(8, BS)
    seq = make_seq(list(range(10)))
    admit(bm, seq)
    seq.num_computed_tokens = 7  # one full block computed; the second is only 3/4 done
    bm.publish_full_blocks(seq)
    assert seq.num_published_blocks == 1
    compute_all(bm, seq)  # 10 tokens: 2 full blocks and a partial one
    assert seq.num_published_blocks == 2
    bm.deallocate(seq)
    assert (bm.num_cached_blocks, bm.num_free_blocks) == (2, 6)
    bm.check_invariants([])


def test_shared_prefix_uses_the_same_blocks_with_refcount_two() -> None:
    bm = BlockManager(16, BS)
    prefix = [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]  # 3 full blocks
    a = make_seq([*prefix, 100], "a")
    b = make_seq([*prefix, 200, 201], "b")
    assert admit(bm, a) == []
    compute_all(bm, a)
    hits = admit(bm, b)
    assert hits == a.block_table[:3]
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert b.num_computed_tokens == 12
    assert all(bm.ref_count(block) == 2 for block in hits)
    bm.check_invariants([a.block_table, b.block_table])
    bm.deallocate(a)
    assert all(bm.ref_count(block) == 1 for block in hits)
    assert bm.num_cached_blocks == 0  # still in use by b, so not evictable
    bm.deallocate(b)
    assert bm.num_cached_blocks == 3 and bm.num_used_blocks == 0
    c = make_seq([*prefix, 300], "c")
    assert admit(bm, c) == hits  # freed blocks keep their contents until evicted
    bm.check_invariants([c.block_table])


def test_the_last_prompt_token_is_never_served_from_cache() -> None:
    bm = BlockManager(16, BS)
    prefix = list(range(12))
    a = make_seq([*prefix, 99], "a")
    admit(bm, a)
    compute_all(bm, a)
    exact = make_seq(prefix, "b")  # all 3 blocks are cached, but something must be computed
    assert len(admit(bm, exact)) == 2
    assert exact.num_computed_tokens == 8


def test_a_hash_hit_with_different_tokens_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_module, "chain_hash", lambda prev, tokens: b"same for every block")
    bm = BlockManager(16, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    admit(bm, a)
    compute_all(bm, a)  # block 1 collides with block 0 and stays private
    other = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 9], "b")
    assert bm.match_prefix(other) == []
    same_first = make_seq([1, 2, 3, 4, 0, 0, 0, 0, 0], "c")
    assert bm.match_prefix(same_first) == a.block_table[:1]
    bm.check_invariants([a.block_table])


def test_identical_blocks_computed_twice_keep_one_cached_copy() -> None:
    bm = BlockManager(8, BS)
    a, b = make_seq(list(range(9)), "a"), make_seq(list(range(9)), "b")
    admit(bm, a)
    admit(bm, b)  # admitted before a's KV was computed: no hit
    compute_all(bm, a)
    compute_all(bm, b)
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 6
    bm.check_invariants([])


def test_eviction_takes_free_blocks_first_then_least_recently_freed() -> None:
    bm = BlockManager(6, BS)
    old = make_seq(list(range(100, 109)), "old")  # 2 full blocks + 1 partial
    new = make_seq(list(range(200, 209)), "new")
    for seq in (old, new):
        admit(bm, seq)
        compute_all(bm, seq)
    bm.deallocate(old)  # freed first: evicted first
    bm.deallocate(new)
    assert (bm.num_cached_blocks, bm.num_free_blocks) == (4, 2)

    filler = make_seq([1] * 8, "filler")  # 2 blocks: exactly the plain free ones
    admit(bm, filler)
    assert bm.num_cached_blocks == 4
    one = make_seq([2] * 3, "one")  # needs 1 block: evicts old's tail block first
    admit(bm, one)
    assert len(bm.match_prefix(make_seq(list(range(100, 109))))) == 1
    assert len(bm.match_prefix(make_seq(list(range(200, 209))))) == 2
    two = make_seq([3] * 3, "two")  # evicts old's head block, still before anything of new
    admit(bm, two)
    assert bm.match_prefix(make_seq(list(range(100, 109)))) == []
    assert len(bm.match_prefix(make_seq(list(range(200, 209))))) == 2
    bm.check_invariants([filler.block_table, one.block_table, two.block_table])


def test_a_cache_hit_refreshes_recency() -> None:
    bm = BlockManager(4, BS)
    first = make_seq(list(range(5)), "first")  # 1 full block + 1 partial
    second = make_seq(list(range(50, 55)), "second")
    for seq in (first, second):
        admit(bm, seq)
        compute_all(bm, seq)
    bm.deallocate(first)
    bm.deallocate(second)
    again = make_seq(list(range(5)), "again")  # reuses first's block, then frees it last
    assert len(admit(bm, again)) == 1
    bm.deallocate(again)
    big = make_seq([9] * 12, "big")
    admit(bm, big)  # takes the 2 free blocks and evicts second's cached block, now the oldest
    assert bm.match_prefix(make_seq(list(range(50, 55)))) == []
    assert len(bm.match_prefix(make_seq(list(range(5))))) == 1
    assert bm.num_available_blocks == 1
    bm.check_invariants([big.block_table])


def test_freeing_a_block_twice_is_caught() -> None:
    bm = BlockManager(4, BS)
    a = make_seq(list(range(6)), "a")
    admit(bm, a)
    forged = make_seq(list(range(6)), "forged")
    forged.block_table = list(a.block_table)  # never allocated: refcounts don't know about it
    with pytest.raises(AssertionError):
        bm.check_invariants([a.block_table, forged.block_table])
    bm.deallocate(a)
    with pytest.raises(AssertionError):
        bm.deallocate(forged)


def test_prefix_caching_off_never_hits_or_caches() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(list(range(9)), "a")
    admit(bm, a)
    compute_all(bm, a)
    bm.deallocate(a)
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8
    assert bm.match_prefix(make_seq(list(range(9)))) == []
    bm.check_invariants([])


def test_pool_must_not_be_empty() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, BS)


# ---- tenants: cache salts ----

SALT_A, SALT_B = "a" * 32, "b" * 32


def registered(bm: BlockManager, seq: Sequence) -> list[bytes]:
    """The hashes the pool registered the seq's published blocks under."""
    by_block = {block_id: h for h, block_id in bm._by_hash.items()}
    return [by_block[block_id] for block_id in seq.block_table[: seq.num_published_blocks]]


@pytest.mark.parametrize("salt", ["", SALT_A])
def test_block_hashes_are_what_the_block_manager_registers(salt: str) -> None:
    """A router imports ``block_hashes`` to find the replica holding a prompt's prefix: it must
    give the engine's hashes bit for bit (partial last block excluded)."""
    tokens = [(7 * i + 3) % 1000 for i in range(4 * BS + 3)]
    bm = BlockManager(16, BS)
    seq = make_seq(tokens, "a", salt)
    admit(bm, seq)
    compute_all(bm, seq)
    assert seq.num_published_blocks == 4
    assert registered(bm, seq) == block_hashes(tokens, BS, salt) == block_hashes(tuple(tokens), BS, salt)
    assert block_hashes(tokens[: BS - 1], BS, salt) == []


def test_unsalted_hashes_are_unchanged_and_salted_ones_never_meet_them() -> None:
    tokens = list(range(3 * BS))
    unsalted = block_hashes(tokens, BS)
    # exactly the chain from before salts existed: blake2b-128 of (previous hash, int64 token ids) from b""
    prev, expected = b"", []
    for i in range(3):
        prev = hashlib.blake2b(prev + array("q", tokens[i * BS:(i + 1) * BS]).tobytes(), digest_size=16).digest()
        expected.append(prev)
    assert unsalted == expected
    a, b = block_hashes(tokens, BS, SALT_A), block_hashes(tokens, BS, SALT_B)
    assert len({*unsalted, *a, *b}) == 9  # no block hash shared between salts, or with no salt
    # nor does a salted chain continue an unsalted one: its seed is no block's hash
    assert not set(block_hashes([*tokens, *tokens], BS, SALT_A)) & set(block_hashes([*tokens, *tokens], BS))


def test_a_prefix_cached_under_one_salt_is_found_only_under_that_salt() -> None:
    bm = BlockManager(32, BS)
    prefix = list(range(100, 100 + 3 * BS))
    owner = make_seq([*prefix, 1], "owner", SALT_A)
    admit(bm, owner)
    compute_all(bm, owner)
    bm.deallocate(owner)
    assert bm.match_prefix(make_seq([*prefix, 2], "other", SALT_B)) == []
    assert bm.match_prefix(make_seq([*prefix, 2], "unsalted")) == []
    again = make_seq([*prefix, 2], "again", SALT_A)
    assert len(admit(bm, again)) == 3
    bm.check_invariants([again.block_table])
    # and the other way round: unsalted blocks serve unsalted requests only
    plain = make_seq([*prefix[::-1], 1], "plain")
    admit(bm, plain)
    compute_all(bm, plain)
    assert bm.match_prefix(make_seq([*prefix[::-1], 2], "salted", SALT_A)) == []
    assert len(bm.match_prefix(make_seq([*prefix[::-1], 2], "plain2"))) == 3


def test_even_a_hash_collision_across_salts_is_no_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The salt is compared on a hit as the tokens are, so tenancy does not rest on the hash alone."""
    monkeypatch.setattr(bm_module, "chain_hash", lambda prev, tokens: b"same for every block")
    bm = BlockManager(16, BS)
    a = make_seq(list(range(9)), "a", SALT_A)
    admit(bm, a)
    compute_all(bm, a)
    assert bm.match_prefix(make_seq(list(range(9)), "b", SALT_B)) == []
    assert bm.match_prefix(make_seq(list(range(9)), "c", SALT_A)) == a.block_table[:1]
    bm.check_invariants([a.block_table])
