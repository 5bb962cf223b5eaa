"""The session's active response as its items (``Writer``) and speech in (``Turns``) see it: the
only way they reach back into the session, through the few calls the session hands over."""

from __future__ import annotations

from collections.abc import Callable

from gateway.ws.fields import ProtocolError
from gateway.ws.responses import ResponseStream


class ActiveResponse:
    def __init__(self, current: Callable[[], ResponseStream | None], cancel: Callable[[ResponseStream, str], None],
                 release_held: Callable[[], None], error: Callable[[ProtocolError], None], *,
                 foresee: Callable[[str, int, str], None], drop_foresight: Callable[[], None]) -> None:
        """``current``: the active response, if any; ``cancel``: end it with a reason;
        ``release_held``: start a response waiting for transcripts if they are in; ``error``: tell
        the client (an ``error`` event), the session going on; ``foresee``, ``drop_foresight``: start
        the answer a turn would get if it ended at a pause, or drop it (``gateway.ws.foresight``)."""
        self._current = current
        self._cancel = cancel
        self._release_held = release_held
        self._error = error
        self.foresee = foresee
        self.drop_foresight = drop_foresight

    def writes(self, item_id: str) -> bool:
        active = self._current()
        return active is not None and active.owns(item_id)

    def reserved_items(self) -> int:
        active = self._current()
        return 1 if active is not None and active.needs_slot else 0

    def stop_writing(self, item_id: str) -> None:
        active = self._current()
        if active is not None and active.owns(item_id):
            self._cancel(active, "client_cancelled")

    def interrupt(self) -> None:
        active = self._current()
        if active is not None and active.in_conversation:
            self._cancel(active, "turn_detected")

    def responding(self) -> bool:
        return self._current() is not None

    def transcripts_changed(self) -> None:
        self._release_held()

    def error(self, e: ProtocolError) -> None:
        self._error(e)
