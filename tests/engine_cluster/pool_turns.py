"""One request through a ReplicaPool, with the replica that served it (both cluster test files)."""

from __future__ import annotations

from collections.abc import Sequence

from engine_cluster.pool import ReplicaPool
from llm_shared.contract import FinishEvent, Priority, SamplingParams, TokenEvent


async def run_turn(pool: ReplicaPool, rid: str, prompt: Sequence[int], params: SamplingParams,
                   ) -> tuple[list[int], FinishEvent, str]:
    """Tokens, the finish and the id of the replica that served the request (its last attempt)."""
    tokens: list[int] = []
    served_by = ""
    async for event in pool.generate(rid, prompt, params, Priority.REALTIME):
        stream = pool._streams.get(rid)
        if stream is not None and stream._replica is not None:
            served_by = stream._replica.replica_id
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
        else:
            assert isinstance(event, FinishEvent)
            return tokens, event, served_by
    raise AssertionError("the stream ended without a FinishEvent")
