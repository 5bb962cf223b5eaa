"""A token bucket, sans-I/O (the caller passes the clock), for the bounds on work one client can
make a process do:

- a session's audio rate (``gateway.ws.audio_input``): bytes of appended audio,
  ``max_audio_bytes_per_s`` with a burst, so one client cannot make the server resample, score
  and buffer audio at any speed it likes;
- a session's recognition budget (``voice.pool``): seconds of recognizer work (the window Whisper
  encodes, what a job costs), so a session committing tiny clips many times a second gets about
  one recognition a second, not the workers;
- a key's grammar compiles (``gateway.shaping``): seconds of compile thread, charged after each
  compile (``debit``: the bucket may go into debt), refused while in debt;
- a key's requests, tokens and audio seconds in this process (``gateway.auth.MinuteBucket``,
  refilled a capacity a minute, for ``gateway.limits.memory``).

What ``take`` refuses is refused whole and nothing is counted for it; the client gets an error
event or status and its session lives on.
"""

from __future__ import annotations


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: float, now: float) -> None:
        if rate_per_s <= 0 or burst <= 0:
            raise ValueError("rate_per_s and burst must be > 0")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._tokens = float(burst)  # a new session may use its burst at once
        self._at = now

    def _refill(self, now: float) -> None:
        self._tokens = min(self.burst, self._tokens + max(now - self._at, 0.0) * self.rate_per_s)
        self._at = max(now, self._at)

    def take(self, amount: float, now: float, keep: float = 0.0) -> bool:
        """Whether ``amount`` more may be used at time ``now`` (seconds, monotonic) leaving at least
        ``keep`` (work that may be skipped leaves room for work that may not); if so, it is counted."""
        self._refill(now)
        if amount + keep > self._tokens:
            return False
        self._tokens -= amount
        return True

    def debit(self, amount: float, now: float) -> None:
        """Count work done whose cost was known only after it ran: the bucket may go into debt,
        and ``take`` refuses until it has refilled past it (negative: a refund, up to the burst)."""
        self._refill(now)
        self._tokens = min(self.burst, self._tokens - amount)

    def level(self, now: float) -> float:
        """What the bucket holds at ``now`` (negative: a debt)."""
        self._refill(now)
        return self._tokens

    def give_back(self, amount: float) -> None:
        """Return what was taken for work that never ran (up to the burst)."""
        self._tokens = min(self.burst, self._tokens + amount)

    def retry_after_s(self, amount: float) -> float:
        """How long until ``amount`` would be accepted (for the error message)."""
        return max(amount - self._tokens, 0.0) / self.rate_per_s
