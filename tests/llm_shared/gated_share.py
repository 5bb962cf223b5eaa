"""A ``CoreShare`` for tests of a tier's side of the moving CPU budget (llm_shared.cores)."""

from __future__ import annotations

import asyncio


class GatedShare:
    """Claims answer ``threads`` once ``open`` is set; counts claims and releases."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.open = asyncio.Event()
        self.claims = 0
        self.releases = 0

    async def claim(self) -> int:
        self.claims += 1
        await self.open.wait()
        return self.threads

    def release(self) -> None:
        self.releases += 1
