"""Waiting on the Python SDK's voice events, shared by the online and on-device voice tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

from rtgw.voice import VoiceEvent

WAIT_S = 240.0  # for the models on a busy 2-core machine
E = TypeVar("E")


async def until(events: AsyncIterator[VoiceEvent], kind: type[E]) -> tuple[E, list[VoiceEvent]]:
    """The first voice event of ``kind``, and every one before it."""
    seen: list[VoiceEvent] = []
    async with asyncio.timeout(WAIT_S):
        async for event in events:
            seen.append(event)
            if isinstance(event, kind):
                return event, seen
    raise AssertionError("the voice events ended")
