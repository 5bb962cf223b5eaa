"""Which sequence slot a new request takes, and how much of its prompt's KV it finds there.

Plain integers and bytes, no llama.cpp: the worker asks ``place`` and carries the answer out.
A finished request leaves its KV in its slot (``resident``), so the conversation's next turn,
whose prompt extends it, computes only what is new. When a slot is needed for another
conversation, its KV is copied to host memory first (a ``Snapshot``, within a byte budget,
least recently used evicted) and can be loaded back into any slot on that conversation's next
turn, when loading is cheaper than computing the same prefix again (both costs are measured).

A request reuses the longest common token prefix, never its whole prompt: the last prompt
token is always computed again, since its logits are the first token's distribution. It reuses
only KV left by requests with its own cache salt (``Engine.generate(cache_salt=...)``, one per
API key when the gateway isolates tenants), so no tenant's timing or ``cached_tokens`` shows
what another sent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import count

from engine_edge.batch_plan import common_prefix

# First guesses, replaced by measurements: loading KV is a memcpy (~10 us a token for the 135M
# model), computing it a forward pass (~3-5 ms a token on two cores).
INITIAL_RESTORE_S_PER_TOKEN = 2e-5
INITIAL_PREFILL_S_PER_TOKEN = 3e-3
EMA = 0.2  # weight of the newest measurement


@dataclass(eq=False)
class Resident:
    """KV left in a free slot by the request that finished there."""

    tokens: tuple[int, ...]  # exactly the tokens whose KV the slot holds, from position 0
    session: str  # whose conversation ("" when the request named none); released with it
    last_used: int
    prompt_len: int  # the prompt part of ``tokens``: the conversation's next turn starts with all of it
    salt: str = ""  # the cache salt of the request that left it: only requests with the same one reuse it


@dataclass(eq=False)
class Snapshot:
    """A slot's KV copied to host memory."""

    tokens: tuple[int, ...]
    data: bytes
    session: str
    salt: str = ""  # carried over from the resident it was copied from


@dataclass(frozen=True)
class Placement:
    """What the worker does to admit a request: all of it before the request's first step."""

    slot: int
    keep: int  # prompt tokens whose KV is reused; computing starts at this position
    save: Resident | None = None  # the slot's resident KV to copy to host memory before anything else
    restore: Snapshot | None = None  # load this into the (emptied) slot, then cut it back to ``keep``


@dataclass
class CacheStats:
    queried_tokens: int = 0  # prompt tokens of admitted requests
    hit_tokens: int = 0  # of those, reused (resident or restored)
    restores: int = 0
    saves: int = 0
    snapshot_evictions: int = 0  # snapshots dropped for the budget
    restore_s_per_token: float = INITIAL_RESTORE_S_PER_TOKEN
    prefill_s_per_token: float = INITIAL_PREFILL_S_PER_TOKEN


@dataclass
class PrefixCache:
    n_slots: int
    snapshot_budget_bytes: int
    enabled: bool = True  # False: every request starts from an empty slot (benchmarks compare)
    resident: dict[int, Resident] = field(default_factory=dict)  # free slots that hold KV
    snapshots: OrderedDict[int, Snapshot] = field(default_factory=OrderedDict)  # least recently used first
    stats: CacheStats = field(default_factory=CacheStats)
    snapshot_bytes: int = 0
    _clock: count = field(default_factory=count)
    _ids: count = field(default_factory=count)

    # ---- admission -------------------------------------------------------------------------

    def place(self, prompt: Sequence[int], free_slots: Sequence[int], salt: str = "") -> Placement:
        """Where a request with ``prompt`` and cache ``salt`` goes, among ``free_slots`` (at least
        one). KV left under another salt is never reused; its slot is only taken as an empty one."""
        assert free_slots, "place() needs a free slot"
        limit = len(prompt) - 1  # the last prompt token is always computed
        self.stats.queried_tokens += len(prompt)
        if not self.enabled or limit <= 0:
            return self._take(self._emptiest(free_slots), 0, None)
        best_slot, best = None, 0
        for slot in free_slots:
            resident = self.resident.get(slot)
            if resident is not None and resident.salt == salt:
                n = min(common_prefix(resident.tokens, prompt), limit)
                if n > best:
                    best_slot, best = slot, n
        snapshot_id, snapshot_keep = None, 0
        for sid, snap in self.snapshots.items():
            if snap.salt != salt:
                continue
            n = min(common_prefix(snap.tokens, prompt), limit)
            if n > snapshot_keep:
                snapshot_id, snapshot_keep = sid, n
        if snapshot_id is not None and snapshot_keep > best and self._restore_pays(
                len(self.snapshots[snapshot_id].tokens), snapshot_keep - best):
            snapshot = self.snapshots.pop(snapshot_id)
            self.snapshot_bytes -= len(snapshot.data)
            self.stats.restores += 1
            return self._take(self._emptiest(free_slots), snapshot_keep, snapshot)
        if best_slot is not None:
            return self._take(best_slot, best, None)
        return self._take(self._emptiest(free_slots), 0, None)

    def _restore_pays(self, restored_tokens: int, gained_tokens: int) -> bool:
        s = self.stats
        return restored_tokens * s.restore_s_per_token < gained_tokens * s.prefill_s_per_token

    def _emptiest(self, free_slots: Sequence[int]) -> int:
        """A free slot holding no KV, else the one whose KV was used longest ago."""
        empty = [slot for slot in free_slots if slot not in self.resident]
        return min(empty) if empty else self.least_recent(free_slots)

    def least_recent(self, slots: Iterable[int]) -> int:
        """Of ``slots`` (each holding resident KV), the one used longest ago: the first to give way."""
        return min(slots, key=lambda slot: self.resident[slot].last_used)

    def _take(self, slot: int, keep: int, restore: Snapshot | None) -> Placement:
        resident = self.resident.pop(slot, None)
        save = None
        # The conversation's own next turn repeats its whole last prompt (it may cut the reply);
        # anything else placed here (another conversation, even one sharing the system prompt,
        # or any restore) overwrites it, so it keeps a host copy.
        continues = resident is not None and restore is None and keep >= resident.prompt_len
        if resident is not None and not continues and self.snapshot_budget_bytes > 0:
            save = resident
        self.stats.hit_tokens += keep
        return Placement(slot, keep, save, restore)

    # ---- results the worker reports --------------------------------------------------------

    def finished(self, slot: int, tokens: Sequence[int], session: str, prompt_len: int, salt: str = "") -> None:
        """A request whose prompt was ``prompt_len`` tokens, with cache ``salt``, left ``tokens`` of
        KV in ``slot`` (freed with it)."""
        if tokens and self.enabled:
            self.resident[slot] = Resident(tuple(tokens), session, next(self._clock), min(prompt_len, len(tokens)),
                                           salt)

    def dropped(self, slot: int) -> None:
        """The slot's KV is gone (an error, or the worker cleared it)."""
        self.resident.pop(slot, None)

    def saved(self, resident: Resident, data: bytes) -> None:
        """Host copy of an evicted resident; older snapshots go first if the budget needs room."""
        if len(data) > self.snapshot_budget_bytes:
            return
        while self.snapshot_bytes + len(data) > self.snapshot_budget_bytes:
            _, old = self.snapshots.popitem(last=False)
            self.snapshot_bytes -= len(old.data)
            self.stats.snapshot_evictions += 1
        self.snapshots[next(self._ids)] = Snapshot(resident.tokens, data, resident.session, resident.salt)
        self.snapshot_bytes += len(data)
        self.stats.saves += 1

    def observe_restore(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            s = self.stats
            s.restore_s_per_token = (1 - EMA) * s.restore_s_per_token + EMA * seconds / tokens

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            s = self.stats
            s.prefill_s_per_token = (1 - EMA) * s.prefill_s_per_token + EMA * seconds / tokens

    # ---- sessions ------------------------------------------------------------------------------

    def end_session(self, session: str) -> list[int]:
        """Forget what ``session`` left behind; the free slots whose KV the worker must clear."""
        if not session:
            return []
        slots = [slot for slot, r in self.resident.items() if r.session == session]
        for slot in slots:
            del self.resident[slot]
        for sid in [sid for sid, snap in self.snapshots.items() if snap.session == session]:
            self.snapshot_bytes -= len(self.snapshots.pop(sid).data)
        return slots

    @property
    def resident_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.resident.values())
