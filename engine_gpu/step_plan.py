"""The step the scheduler is building: which sequences run how many tokens, in batch order, and
the token budget left. Pure Python, no torch; ``Scheduler.schedule`` fills it, then emits it as a
``SchedulerOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_gpu.sequence import Sequence


@dataclass
class StepPlan:
    """The step being built. Preempting a request already in it gives its budget back."""

    budget: int  # tokens the step may still take (max_num_batched_tokens to begin with)
    tokens: dict[Sequence, int] = field(default_factory=dict)  # insertion order is batch order
    cached_tokens: dict[str, int] = field(default_factory=dict)  # prefix-cache hits of first admissions, reported once
    preempted: list[str] = field(default_factory=list)  # their ids go out with the step; nobody is admitted after one
    num_decodes: int = 0  # sequences decoding in it: while any does, prompt chunks are capped

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.tokens[seq] = num_tokens
        self.budget -= num_tokens
        self.num_decodes += int(seq.is_caught_up)

    def drop(self, seq: Sequence) -> None:
        if seq in self.tokens:
            self.budget += self.tokens.pop(seq)
            self.num_decodes -= int(seq.is_caught_up)
