"""When to speculate, and how far: the self-disable switch and per-sequence draft lengths.

The switch is a small two-armed bandit per batch-size bucket (1, 2-3, 4-7, 8-15, ...): it keeps
a smoothed rate of tokens emitted per second for steps taken with speculation and for steps
without, and speculates when its rate is at least the plain one (a measured gain >= 1). The
losing arm is still tried once every ``probe_every`` steps of the bucket, so a switch that went
off comes back on when speculation would pay again (longer copies, a quieter machine), and one
that is on notices when it stops paying. A probe of speculation is not free (the drafter first
catches up on what it missed while off), so each probe that finds it still losing doubles that
bucket's interval, up to ``MAX_PROBE_BACKOFF`` times ``probe_every``; a win resets it. Above ``max_batch`` running sequences it is off: a
full batch already uses the hardware that verification would need.

Each sequence drafts ``k`` tokens with ``k`` chosen from its own running acceptance rate ``a``:
the ``k`` in ``1..num_draft_tokens`` maximising expected tokens per round,
``(1 - a^(k+1)) / (1 - a)``, over the round's cost in plain target steps, ``v(k) + k * c``:
``c`` is the drafter's cost per draft token and ``v(k)`` a verification step with ``k`` drafts,
both measured per bucket against that bucket's plain steps (``v(k)`` between measured ``k``s is
interpolated from ``v(0) = 1``). ``v`` is not linear: on these CPUs (float32) a 2-token forward
already costs ~1.85 plain steps and a 5-token one ~1.97, while on a GPU at small batch all are
close to 1. A sequence never drafts fewer than one token while the switch is on, so its
acceptance rate keeps being measured; the switch decides whether drafting pays at all.

Time spent feeding the drafter sequences that were far behind (a new request's prompt, tokens
missed while speculation was off) is a one-off per request and is left out of both rates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_gpu.config import SpeculativeConfig

RATE_EMA = 0.2  # weight of the newest step in a bucket's tokens/s
ACCEPT_EMA = 0.3  # weight of the newest round in a sequence's acceptance rate
COST_EMA = 0.2
MIN_SAMPLES = 3  # steps per arm before a bucket trusts its rates
MAX_PROBE_BACKOFF = 32


@dataclass
class _Arm:
    rate: float = 0.0  # tokens emitted per second, smoothed
    samples: int = 0

    def add(self, rate: float) -> None:
        self.rate = rate if self.samples == 0 else (1 - RATE_EMA) * self.rate + RATE_EMA * rate
        self.samples += 1


def _ema(old: float, new: float, weight: float) -> float:
    return new if old <= 0 else (1 - weight) * old + weight * new


@dataclass
class _Bucket:
    on: _Arm = field(default_factory=_Arm)
    off: _Arm = field(default_factory=_Arm)
    steps: int = 0
    next_probe: int = 0  # the step of the next probe of the losing arm
    backoff: int = 1  # probe interval in units of probe_every
    plain_step_s: float = 0.0  # a plain step's seconds, smoothed
    draft_cost: float = -1.0  # drafter seconds per draft position / plain step (-1: not measured yet)
    verify_cost: dict[int, float] = field(default_factory=dict)  # most drafts in a round -> its step / plain step

    def verify(self, k: int) -> float:
        """A verification step with ``k`` drafts, in plain steps: measured, else interpolated."""
        if k in self.verify_cost:
            return self.verify_cost[k]
        points = sorted({0: 1.0, **self.verify_cost}.items())
        below = max((p for p in points if p[0] < k), key=lambda p: p[0])
        above = [p for p in points if p[0] > k]
        if not above:
            return below[1]
        (k0, v0), (k1, v1) = below, above[0]
        return v0 + (v1 - v0) * (k - k0) / (k1 - k0)


def bucket_of(batch_size: int) -> int:
    return max(1, batch_size).bit_length() - 1  # 1 -> 0, 2-3 -> 1, 4-7 -> 2, ...


class SpecController:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._buckets: dict[int, _Bucket] = {}
        self._acceptance: dict[str, float] = {}
        self.enabled = config.method != "off"  # the latest decision, for stats
        self.rounds = 0
        self.disabled_by_batch = 0
        self.disabled_by_gain = 0

    # ---- decisions ----

    def speculate(self, batch_size: int) -> bool:
        """Whether this step drafts, for ``batch_size`` decoding sequences."""
        cfg = self.config
        if cfg.method == "off" or batch_size == 0:
            self.enabled = False
            return False
        if batch_size > cfg.max_batch:
            self.disabled_by_batch += 1
            self.enabled = False
            return False
        if not cfg.adaptive:
            self.enabled = True
            return True
        bucket = self._bucket(batch_size)
        bucket.steps += 1
        on, off = bucket.on, bucket.off
        if on.samples < MIN_SAMPLES or off.samples < MIN_SAMPLES:
            choice = on.samples < off.samples  # explore both arms first, plain steps first
        else:
            best = on.rate >= off.rate
            if best:
                bucket.backoff = 1
            probe = bucket.steps >= bucket.next_probe
            if probe:
                bucket.next_probe = bucket.steps + cfg.probe_every * bucket.backoff
                if not best:
                    bucket.backoff = min(2 * bucket.backoff, MAX_PROBE_BACKOFF)
            choice = (not best) if probe else best
            if not best:
                self.disabled_by_gain += 1
        self.enabled = choice
        return choice

    def draft_len(self, request_id: str, batch_size: int = 1) -> int:
        """Drafts for this sequence's next round (0: it sits this round out)."""
        k_max = self.config.num_draft_tokens
        if not self.config.adaptive:
            return k_max
        a = min(self._acceptance.get(request_id, self.config.initial_acceptance), 0.999)
        c = self.draft_cost(batch_size)
        bucket = self._bucket(batch_size)
        best_k, best_value = 1, 0.0
        for k in range(1, k_max + 1):
            value = (1 - a ** (k + 1)) / (1 - a) / (bucket.verify(k) + k * c)
            if value > best_value:
                best_k, best_value = k, value
        return best_k

    # ---- observations ----

    def _bucket(self, batch_size: int) -> _Bucket:
        return self._buckets.setdefault(bucket_of(batch_size), _Bucket())

    def draft_cost(self, batch_size: int) -> float:
        cost = self._bucket(batch_size).draft_cost
        return cost if cost >= 0 else self.config.initial_cost_ratio

    def observe_step(self, batch_size: int, speculated: bool, tokens: int, seconds: float, *,
                     draft_seconds: float = 0.0, draft_positions: int = 0, verify_width: int = 0) -> None:
        """A finished step: ``tokens`` emitted by the decoding sequences in ``seconds`` (one-off
        catch-up feeding left out); with speculation, ``draft_seconds`` of it were ``draft_positions``
        drafter rounds, and the most drafts one sequence verified were ``verify_width``."""
        if seconds <= 0 or tokens <= 0:
            return
        bucket = self._bucket(batch_size)
        (bucket.on if speculated else bucket.off).add(tokens / seconds)
        if not speculated:
            bucket.plain_step_s = _ema(bucket.plain_step_s, seconds, COST_EMA)
            return
        if bucket.plain_step_s <= 0:
            return
        if draft_positions > 0:
            ratio = draft_seconds / draft_positions / bucket.plain_step_s
            bucket.draft_cost = ratio if bucket.draft_cost < 0 else _ema(bucket.draft_cost, ratio, COST_EMA)
        if verify_width > 0:
            verify = max(1.0, (seconds - draft_seconds) / bucket.plain_step_s)
            bucket.verify_cost[verify_width] = _ema(bucket.verify_cost.get(verify_width, 0.0), verify, COST_EMA)

    def observe_round(self, request_id: str, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.rounds += 1
        rate = accepted / proposed
        old = self._acceptance.get(request_id)
        self._acceptance[request_id] = rate if old is None else (1 - ACCEPT_EMA) * old + ACCEPT_EMA * rate

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)

    # ---- introspection ----

    def gain(self, batch_size: int) -> float:
        """Measured tokens/s with speculation over without, for this batch size's bucket (0: unknown)."""
        bucket = self._buckets.get(bucket_of(batch_size))
        if bucket is None or not bucket.on.samples or not bucket.off.samples or bucket.off.rate <= 0:
            return 0.0
        return bucket.on.rate / bucket.off.rate

    def stats(self) -> dict[str, float]:
        return {
            "spec_enabled": float(self.enabled),
            "spec_rounds": float(self.rounds),
            "spec_draft_cost_ratio": self.draft_cost(1),
            "spec_verify_cost_batch1": self._bucket(1).verify(self.config.num_draft_tokens),
            "spec_gain_batch1": self.gain(1),
            "spec_off_by_batch": float(self.disabled_by_batch),
            "spec_off_by_gain": float(self.disabled_by_gain),
        }
