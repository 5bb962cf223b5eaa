"""The ids one Realtime session draws (items, responses, events)."""

from __future__ import annotations

import base64
import secrets


class SessionIds:
    """The ids one session draws. What a client can name (items, responses, the conversation) is
    random, so a client-created item can never take the id of one the server makes next; event
    ids (one per token) only need to be unique, so they count up after a random per-session tag."""

    RANDOM_BYTES = 12  # 16 characters, as secrets.token_urlsafe(12)
    BATCH = 32  # ids drawn from the OS's generator at once: one getrandom() a response was ~5 µs under load

    def __init__(self) -> None:
        self._tag = secrets.token_urlsafe(9)  # 12 characters
        self._events = 0
        self._random = b""
        self._used = 0

    def __call__(self, prefix: str) -> str:
        if prefix == "event":
            self._events += 1
            return f"event_{self._tag}{self._events:x}"
        if self._used == len(self._random):
            self._random, self._used = secrets.token_bytes(self.RANDOM_BYTES * self.BATCH), 0
        start, self._used = self._used, self._used + self.RANDOM_BYTES
        return f"{prefix}_{base64.urlsafe_b64encode(self._random[start:self._used]).decode()}"
