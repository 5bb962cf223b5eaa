"""A tier's claim on the host's cores, for a gateway that moves threads to where the work is.

The gateway (``gateway/tiers/cores.py``) holds the host's CPU budget. A tier with work computes
on the threads it was given; a tier with none computes nothing and counts for nothing, so its
cores may serve the others. Before a tier that was idle starts work it ``claim``s: the answer
comes once the busy tiers have shrunk to make room, and is the thread count to compute with. When
its last work ends it ``release``s. The other way round, the gateway changes a busy tier's threads
with the tier's ``set_threads`` (in force from the tier's next step; the call returns then).

``ClaimOnWork`` is a tier's side of it: await ``ready()`` before handing work to the compute loop,
call ``settle()`` whenever work may have ended. Torch-free; the tiers import it, not the gateway.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, runtime_checkable

log = logging.getLogger(__name__)


class CoreShare(Protocol):
    async def claim(self) -> int:
        """The threads to compute with, once the cores are free for them."""
        ...

    def release(self) -> None:
        """The tier has no work left: its cores may serve the others."""
        ...


@runtime_checkable
class SharesCores(Protocol):
    """A tier whose threads can follow the load (the llama.cpp edge, the torch engine's client)."""

    def share_cores(self, share: CoreShare) -> bool:
        """Claim ``share`` before work reaches the idle tier, release it when the tier is idle;
        False where this tier's threads are fixed (it keeps its static share)."""
        ...

    async def set_threads(self, threads: int) -> None:
        """Returns once the tier computes on ``threads`` threads (from its next step)."""
        ...


class ClaimOnWork:
    """Claims ``share`` when work arrives at an idle tier and releases it when the tier is idle again.

    ``apply(threads)`` sets the tier's thread count, ordered before the work that waited for the
    claim; ``busy()`` says whether the tier has work (checked when a claim comes back, so a tier
    whose work ended meanwhile releases at once). Runs on the tier's event loop."""

    def __init__(self, share: CoreShare, apply: Callable[[int], None], busy: Callable[[], bool]) -> None:
        self._share = share
        self._apply = apply
        self._busy = busy
        self._claimed = False
        self._claiming: asyncio.Task[None] | None = None

    @property
    def claimed(self) -> bool:
        return self._claimed

    async def ready(self) -> None:
        """Returns once the tier may compute (at once while it holds its claim)."""
        if self._claimed:
            return
        if self._claiming is None:
            self._claiming = asyncio.get_running_loop().create_task(self._claim(), name="claim-cores")
        await asyncio.shield(self._claiming)

    async def _claim(self) -> None:
        try:
            threads = await self._share.claim()
        except Exception:  # the tier must still run: on the threads it has
            log.exception("claiming cores failed; computing on the threads this tier has")
            threads = 0
        if threads > 0:
            self._apply(threads)
        self._claimed = True
        self._claiming = None
        self.settle()

    def settle(self) -> None:
        """Release the claim if the tier has no work now."""
        if self._claimed and not self._busy():
            self._claimed = False
            self._share.release()

    def cancel(self) -> None:
        """The tier is closing: a claim in flight is dropped; a held one released."""
        if self._claiming is not None:
            self._claiming.cancel()
            self._claiming = None
        if self._claimed:
            self._claimed = False
            self._share.release()
