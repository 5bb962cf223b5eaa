"""A sans-I/O Realtime session for literal-event tests: started, its opening events drained, ids
counted from 1; and ``drain``, which checks every event against the official SDK's types."""

from __future__ import annotations

import itertools
from typing import Any

from realtime_sdk_check import check_server_event

from gateway.ws.server_events import to_wire
from gateway.ws.session import RealtimeSession, SessionLimits
from llm_shared.structured import ToolCallFamily


def make(*, beta: bool = False, limits: SessionLimits | None = None,
         family: ToolCallFamily | None = None) -> RealtimeSession:
    counter = itertools.count(1)
    session = RealtimeSession(session_id="sess_1", model="smollm2-135m", limits=limits or SessionLimits(), beta=beta,
                              id_factory=lambda prefix: f"{prefix}_{next(counter)}", family=family)
    session.start()
    drain(session)
    return session


def drain(session: RealtimeSession) -> list[dict[str, Any]]:
    events = [to_wire(e) for e in session.events_to_send()]
    for event in events:
        check_server_event(event, beta=session.beta)
    return events
