"""A session's audio rate bound: a token bucket of bytes, sans-I/O (the caller passes the clock).

Audio arriving faster than ``bytes_per_s`` for longer than the burst allows is refused append by
append (``take`` returns False), so one client cannot make the server resample, score and buffer
audio at any speed it likes; the session answers with an error event and lives on.
"""

from __future__ import annotations


class AudioRateLimiter:
    def __init__(self, bytes_per_s: float, burst_bytes: float, now: float) -> None:
        if bytes_per_s <= 0 or burst_bytes <= 0:
            raise ValueError("bytes_per_s and burst_bytes must be > 0")
        self.bytes_per_s = bytes_per_s
        self.burst_bytes = burst_bytes
        self._tokens = float(burst_bytes)  # a new session may send its burst at once
        self._at = now

    def take(self, n_bytes: int, now: float) -> bool:
        """Whether ``n_bytes`` more may be accepted at time ``now`` (seconds, monotonic); if so, they are counted."""
        self._tokens = min(self.burst_bytes, self._tokens + max(now - self._at, 0.0) * self.bytes_per_s)
        self._at = max(now, self._at)
        if n_bytes > self._tokens:
            return False
        self._tokens -= n_bytes
        return True

    def retry_after_s(self, n_bytes: int) -> float:
        """How long until ``n_bytes`` would be accepted (for the error message)."""
        return max(n_bytes - self._tokens, 0.0) / self.bytes_per_s
