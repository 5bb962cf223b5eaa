"""When to speculate, for whom and how far: every step priced before it is taken.

Each step the controller compares two ways of taking it, priced with what the engine measured
(``costs.CostCurve``: ``f(n)`` seconds of a target forward of ``n`` tokens, ``g(n)`` of a drafter
forward). Plain: one token for each of the ``b`` decoding sequences, in ``f(b)``. Speculative:
a set ``S`` of them, best acceptance rate first, drafts ``k`` tokens each, in ``k`` drafter
forwards (the first feeds each sequence what it lacks, the target's last token and often the
previous round's last draft; the others one token per sequence) and one target forward of
``b + k|S|`` tokens, for ``(b - |S|) + sum E(a_i, k)`` tokens, where
``E(a, k) = (1 - a^(k+1)) / (1 - a)`` is a round's expected tokens at acceptance rate ``a``
(Leviathan et al., 2023). The best ``(S, k)`` is taken if its tokens per second beat plain
steps by ``min_gain``; otherwise the step is plain.

A sequence the drafter has not followed (a new request's prompt, tokens it missed while it sat
out) must first be fed to the drafter: a one-off cost, at most ``draft_window`` tokens, that
pays only over the sequence's remaining tokens, so it enters the price spread over them,
``g(behind) * E / remaining`` a step. A batch where speculation would lose therefore never pays a
catch-up to find that out (the cost that made a bandit switch lose 30-45% at 4 and 8 requests),
and a request with few tokens left is not caught up for them.

Acceptance is measured per sequence, starting from the running mean of all; while a sequence
sits out, its estimate drifts back towards that mean, so one bad round (a draft that missed at
the start of an answer) does not shut it out for the rest of the request. The curves
start from a calibration at engine start and follow every forward after it, so a price that was
wrong is corrected by the step that paid it. Above ``max_batch`` decoding sequences nothing is
priced: a full batch already uses what verification would need.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine_gpu.config import SpeculativeConfig
from engine_gpu.speculative.costs import CostCurve

ACCEPT_EMA = 0.3  # weight of the newest round in a sequence's acceptance rate
PRIOR_EMA = 0.05  # weight of a round in the acceptance rate new sequences start from
RELAX = 0.1  # a step sitting out moves a sequence's acceptance this far back towards the prior
LENGTH_EMA = 0.1  # weight of a finished request in the expected output length
MAX_ACCEPTANCE = 0.99  # E(a, k) is finite only below 1
EXPECTED_OUTPUT_PRIOR = 128  # output tokens a request is assumed to run to, until some have finished
USUAL_BEHIND = 2  # a sequence that drafted last round lacks the target's bonus token and its last draft


@dataclass(frozen=True)
class Candidate:
    """A decoding sequence this step could draft for."""

    request_id: str
    room: int  # most drafts it may take: what it may still generate, less verification's own token
    behind: int  # tokens the drafter would feed before its first draft (<= USUAL_BEHIND if it drafted last round)
    remaining: int  # tokens it may still generate (max_tokens less those generated)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a round of ``k`` drafts emits on average: accepted drafts plus the target's own."""
    a = min(acceptance, MAX_ACCEPTANCE)
    return (1 - a ** (k + 1)) / (1 - a)


class SpecController:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.target = CostCurve()  # f: seconds of a decode-like target forward of n tokens
        self.drafter = CostCurve()  # g: seconds of a drafter forward of n tokens
        self._acceptance: dict[str, float] = {}
        self._prior_acceptance = config.initial_acceptance
        self._expected_output = float(EXPECTED_OUTPUT_PRIOR)
        self.enabled = config.method != "off"  # the latest decision, for stats
        self.predicted_gain = 0.0  # the latest priced step's best speculative tokens/s over plain
        self.rounds = 0
        self.disabled_by_batch = 0
        self.disabled_by_gain = 0

    # ---- decisions ----

    def prices(self, batch_size: int) -> bool:
        """Whether a step of ``batch_size`` decoding sequences would be priced, changing nothing:
        a step that would not be may be planned before the previous step's tokens are known."""
        return self.config.method != "off" and 0 < batch_size <= self.config.max_batch

    def may_speculate(self, batch_size: int) -> bool:
        """Whether a step with ``batch_size`` decoding sequences is priced at all (no: plain)."""
        if self.config.method == "off" or batch_size == 0:
            self.enabled = False
            return False
        if batch_size > self.config.max_batch:
            self.disabled_by_batch += 1
            self.enabled = False
            return False
        return True

    def plan(self, candidates: Sequence[Candidate]) -> dict[str, int]:
        """Drafts per request for this step; requests left out (all, for a plain step) draft none."""
        cfg = self.config
        b = len(candidates)
        if not self.may_speculate(b):
            return {}
        if not cfg.adaptive:
            self.enabled = True
            return {c.request_id: min(cfg.num_draft_tokens, c.room) for c in candidates if c.room > 0}
        if not self.target.known:  # nothing measured yet: take it plain and measure
            self.enabled = False
            return {}
        plain_rate = b / self.target(b)
        ranked = sorted((c for c in candidates if c.room > 0), key=lambda c: -self.acceptance(c.request_id))
        acceptance = [self.acceptance(c.request_id) for c in ranked]
        # a catch-up spread over the tokens it will serve: seconds per emitted token of that sequence
        catch_up_per_token = [
            self.draft_seconds(c.behind - 1) / max(1.0, min(float(c.remaining), self._expected_output))
            if c.behind > USUAL_BEHIND else 0.0 for c in ranked]
        draft_round = [0.0, *(self.draft_seconds(j) for j in range(1, len(ranked) + 1))]
        # the first round's tokens for the first j sequences: what each lacks, 1 after a catch-up
        first_round = list(itertools.accumulate((c.behind if c.behind <= USUAL_BEHIND else 1 for c in ranked),
                                                initial=0))
        first_round_s = {n: self.draft_seconds(n) for n in set(first_round[1:])}
        target: dict[int, float] = {}
        best_rate, best = 0.0, (0, 0)
        for k in range(1, cfg.num_draft_tokens + 1):
            tokens, rows, catch_up = float(b), b, 0.0
            for j, c in enumerate(ranked, 1):
                drafts = min(k, c.room)
                gained = expected_tokens(acceptance[j - 1], drafts)
                tokens += gained - 1
                rows += drafts
                catch_up += catch_up_per_token[j - 1] * gained
                if rows not in target:
                    target[rows] = self.target(rows)
                drafting = first_round_s[first_round[j]] + (k - 1) * draft_round[j]
                rate = tokens / (target[rows] + drafting + catch_up)
                if rate > best_rate:
                    best_rate, best = rate, (k, j)
        self.predicted_gain = best_rate / plain_rate
        if best_rate < plain_rate * cfg.min_gain:
            self.disabled_by_gain += 1
            self.enabled = False
            self._relax(c.request_id for c in ranked)
            return {}
        self.enabled = True
        k, j = best
        self._relax(c.request_id for c in ranked[j:])
        return {c.request_id: min(k, c.room) for c in ranked[:j]}

    def _relax(self, sitting_out: Iterable[str]) -> None:
        prior = self._prior_acceptance
        for request_id in sitting_out:
            rate = self._acceptance.get(request_id)
            if rate is not None:
                self._acceptance[request_id] = rate + RELAX * (prior - rate)

    def acceptance(self, request_id: str) -> float:
        return self._acceptance.get(request_id, self._prior_acceptance)

    def draft_seconds(self, tokens: int) -> float:
        """A drafter forward of ``tokens``: measured, else ``initial_cost_ratio`` of the target's."""
        if self.drafter.known:
            return self.drafter(tokens)
        return self.config.initial_cost_ratio * self.target(tokens)

    # ---- observations ----

    def observe_target(self, tokens: int, seconds: float) -> None:
        """A decode-like step (every sequence in it sampled at each of its tokens), drafting excluded."""
        self.target.observe(tokens, seconds)

    def observe_drafter(self, forwards: Sequence[tuple[int, float]]) -> None:
        self.drafter.observe_all(forwards)

    def observe_round(self, request_id: str, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.rounds += 1
        rate = accepted / proposed
        old = self._acceptance.get(request_id, self._prior_acceptance)
        self._acceptance[request_id] = (1 - ACCEPT_EMA) * old + ACCEPT_EMA * rate
        self._prior_acceptance += PRIOR_EMA * (rate - self._prior_acceptance)

    def observe_finished(self, request_id: str, output_tokens: int) -> None:
        """A request ended (however): its length teaches how long requests run; forget it."""
        self._expected_output += LENGTH_EMA * (max(1, output_tokens) - self._expected_output)
        self._acceptance.pop(request_id, None)

    # ---- introspection ----

    def stats(self) -> dict[str, float]:
        k = self.config.num_draft_tokens
        known = self.target.known
        plain = self.target(1) if known else 0.0
        return {
            "spec_enabled": float(self.enabled),
            "spec_rounds": float(self.rounds),
            "spec_predicted_gain": self.predicted_gain,
            "spec_prior_acceptance": self._prior_acceptance,
            "spec_draft_cost_ratio": self.draft_seconds(1) / plain if known else 0.0,
            "spec_verify_cost_batch1": self.target(1 + k) / plain if known else 0.0,
            "spec_off_by_batch": float(self.disabled_by_batch),
            "spec_off_by_gain": float(self.disabled_by_gain),
        }
