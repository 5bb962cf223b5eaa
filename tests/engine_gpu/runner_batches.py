"""Hand-built scheduler output for runner tests: the runner's batch is a list of ``ScheduledSeq``."""

from __future__ import annotations

from engine_gpu.sched_output import ScheduledSeq
from llm_shared.contract import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def scheduled(request_id: str, token_ids: list[int], start_pos: int, block_table: list[int], sample: bool = True,
              params: SamplingParams = GREEDY, output_index: int = 0) -> ScheduledSeq:
    """One batch item with no draft tokens, its fields in the order tests write them."""
    return ScheduledSeq(request_id=request_id, token_ids=token_ids, start_pos=start_pos, block_table=block_table,
                        sample=sample, num_draft_tokens=0, params=params, output_index=output_index)
