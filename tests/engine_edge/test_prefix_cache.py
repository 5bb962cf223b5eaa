"""The edge tier's slot and snapshot policy, with literal token lists (no model)."""

from __future__ import annotations

from engine_edge.prefix_cache import PrefixCache, Snapshot

CONV_A = list(range(100, 160))  # 60 tokens
CONV_B = list(range(500, 560))


def test_a_conversation_continues_in_the_slot_its_last_turn_left() -> None:
    cache = PrefixCache(n_slots=4, snapshot_budget_bytes=1 << 20)
    cache.finished(2, CONV_A, "a", 40)
    cache.finished(0, CONV_B, "b", 40)
    placement = cache.place([*CONV_A, 7, 8, 9], [0, 1, 2, 3])
    assert (placement.slot, placement.keep, placement.save, placement.restore) == (2, 60, None, None)
    assert 2 not in cache.resident and 0 in cache.resident


def test_the_last_prompt_token_is_always_computed() -> None:
    cache = PrefixCache(n_slots=1, snapshot_budget_bytes=0)
    cache.finished(0, CONV_A, "a", 40)
    assert cache.place(CONV_A, [0]).keep == len(CONV_A) - 1
    assert cache.place([5], [0]).keep == 0


def test_a_new_conversation_takes_an_empty_slot_before_a_warm_one() -> None:
    cache = PrefixCache(n_slots=3, snapshot_budget_bytes=1 << 20)
    cache.finished(0, CONV_A, "a", 40)
    placement = cache.place(CONV_B, [0, 1])
    assert (placement.slot, placement.keep, placement.save) == (1, 0, None)


def test_overwriting_a_warm_slot_saves_it_first_and_restoring_brings_it_back() -> None:
    cache = PrefixCache(n_slots=1, snapshot_budget_bytes=1 << 20)
    cache.finished(0, CONV_A, "a", 40)
    placement = cache.place(CONV_B, [0])
    assert placement.save is not None and placement.save.tokens == tuple(CONV_A) and placement.keep == 0
    cache.saved(placement.save, b"x" * 1000)
    assert cache.snapshot_bytes == 1000
    cache.finished(0, CONV_B, "b", 40)
    again = cache.place([*CONV_A, 1, 2], [0])
    assert again.restore is not None and again.restore.tokens == tuple(CONV_A) and again.keep == 60
    assert again.save is not None and again.save.tokens == tuple(CONV_B)  # B goes to host memory in turn
    assert cache.snapshot_bytes == 0 and not cache.snapshots  # the restored copy left the host tier


def test_restoring_is_chosen_only_when_it_is_cheaper_than_recomputing() -> None:
    cache = PrefixCache(n_slots=1, snapshot_budget_bytes=1 << 20)
    cache.snapshots[0] = Snapshot(tuple(CONV_A), b"x" * 100, "a")
    cache.snapshot_bytes = 100
    cache.stats.restore_s_per_token = 1.0  # measured: restoring is slow
    cache.stats.prefill_s_per_token = 0.001  # and computing fast
    placement = cache.place([*CONV_A, 1], [0])
    assert placement.restore is None and placement.keep == 0
    for _ in range(40):  # new measurements move the estimates
        cache.observe_restore(60, 60 * 1e-5)
        cache.observe_prefill(100, 100 * 3e-3)
    assert cache.place([*CONV_A, 1], [0]).restore is not None


def test_the_snapshot_budget_is_never_exceeded_oldest_go_first() -> None:
    cache = PrefixCache(n_slots=1, snapshot_budget_bytes=2500)
    for i, conv in enumerate([CONV_A, CONV_B, list(range(900, 960))]):
        cache.finished(0, conv, f"s{i}", 40)
        placement = cache.place(list(range(2000 + 100 * i, 2100 + 100 * i)), [0])
        assert placement.save is not None
        cache.saved(placement.save, b"x" * 1000)
        assert cache.snapshot_bytes <= 2500
    assert [s.session for s in cache.snapshots.values()] == ["s1", "s2"]
    assert cache.stats.snapshot_evictions == 1
    cache.finished(0, CONV_A, "big", 40)
    placement = cache.place(list(range(3000, 3050)), [0])
    assert placement.save is not None
    cache.saved(placement.save, b"x" * 3000)  # larger than the whole budget: not kept
    assert cache.snapshot_bytes == 2000


def test_the_next_turn_of_the_same_conversation_snapshots_nothing() -> None:
    cache = PrefixCache(n_slots=1, snapshot_budget_bytes=1 << 20)
    cache.finished(0, CONV_A, "a", 40)  # a 40-token prompt and a 20-token reply
    # The reply was cut (barge-in) or re-tokenizes differently: the new prompt parts inside it.
    assert cache.place([*CONV_A[:45], 1, 2], [0]).save is None
    cache.finished(0, CONV_A, "a", 40)
    # Only a shared system prompt in common: A's conversation would be lost, so it is saved.
    assert cache.place([*CONV_A[:5], 9, 9, 9], [0]).save is not None


def test_ending_a_session_forgets_its_slots_and_snapshots() -> None:
    cache = PrefixCache(n_slots=2, snapshot_budget_bytes=1 << 20)
    cache.finished(0, CONV_A, "a", 40)
    cache.finished(1, CONV_B, "b", 40)
    cache.snapshots[7] = Snapshot((1, 2), b"xy", "a")
    cache.snapshot_bytes = 2
    assert cache.end_session("a") == [0]
    assert list(cache.resident) == [1] and cache.snapshot_bytes == 0
    assert cache.end_session("") == []  # requests without a session are only evicted by need


def test_switched_off_nothing_is_kept_or_reused() -> None:
    cache = PrefixCache(n_slots=1, snapshot_budget_bytes=1 << 20, enabled=False)
    cache.finished(0, CONV_A, "a", 40)
    assert not cache.resident
    assert cache.place([*CONV_A, 1], [0]).keep == 0


def test_kv_left_under_one_cache_salt_is_reused_only_under_it() -> None:
    cache = PrefixCache(n_slots=3, snapshot_budget_bytes=1 << 20)
    cache.finished(0, CONV_A, "a", 40, salt="tenant-a")
    for slot, salt in ((1, "tenant-b"), (2, "")):  # another tenant, or no salt: nothing to reuse, an empty slot
        placement = cache.place([*CONV_A, 1], [0, 1, 2], salt)
        assert (placement.slot, placement.keep, placement.restore) == (slot, 0, None)
        cache.finished(slot, [*CONV_A, 1], "other", 61, salt=salt)  # what it computed stays under its own salt
    placement = cache.place([*CONV_A, 2], [0, 1, 2], "tenant-a")
    assert (placement.slot, placement.keep) == (0, 60)
    assert cache.place([*CONV_A, 1, 5], [1, 2], "").keep == 61  # and the unsalted turn's KV serves unsalted turns


def test_a_snapshot_keeps_its_salt_and_is_restored_only_under_it() -> None:
    cache = PrefixCache(n_slots=1, snapshot_budget_bytes=1 << 20)
    cache.finished(0, CONV_A, "a", 40, salt="tenant-a")
    placement = cache.place(CONV_B, [0], "tenant-b")  # A's KV moves to host memory, salt and all
    assert placement.save is not None and placement.keep == 0
    cache.saved(placement.save, b"x" * 100)
    assert [snap.salt for snap in cache.snapshots.values()] == ["tenant-a"]
    cache.finished(0, CONV_B, "b", 40, salt="tenant-b")
    stolen = cache.place([*CONV_A, 1], [0], "tenant-b")
    assert stolen.restore is None and stolen.keep == 0
    cache.finished(0, [*CONV_A, 1], "b", 61, salt="tenant-b")
    own = cache.place([*CONV_A, 2], [0], "tenant-a")
    assert own.restore is not None and own.keep == 60
