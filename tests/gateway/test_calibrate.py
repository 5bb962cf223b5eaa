"""Calibrating the cascade: the shipped prompt set, threshold choice for a target escalation
rate, agreement at that threshold, and the prompt file's validation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest
from fake_engine import FakeEngine, FakeTokenizer

from gateway.cascade.confidence import QuantileScorer
from gateway.tools.calibrate import (
    DEFAULT_PROMPTS,
    Prompt,
    Sample,
    collect,
    curve,
    evaluate,
    load_prompts,
    pick_threshold,
)
from llm_shared.contract import SamplingParams
from llm_shared.errors import ConfigError


def test_the_shipped_prompt_set_is_varied() -> None:
    prompts = load_prompts(DEFAULT_PROMPTS)
    categories = {p.category for p in prompts}
    assert categories == {"chit-chat", "factual", "arithmetic", "code", "long-instructions"}
    assert all(sum(p.category == c for p in prompts) >= 10 for c in categories)
    assert len({p.prompt for p in prompts}) == len(prompts)


@pytest.mark.parametrize("line, why", [
    ("not json", "not JSON"), ('{"prompt": ""}', "non-empty string 'prompt'"), ('["x"]', "non-empty string"),
    ('{"prompt": "x", "category": 3}', "'category' must be a string"),
    ('{"prompt": "' + "x" * 20_001 + '"}', "longer than"),
])
def test_a_bad_prompt_file_names_its_line(tmp_path: Path, line: str, why: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=f"prompts.jsonl:2: .*{why}"):
        load_prompts(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_prompts(tmp_path / "missing.jsonl")


def sample(confidence: float, agree: bool) -> Sample:
    return Sample("c", "p", confidence, "a", "a" if agree else "b", 0.1, 0.2)


def test_the_threshold_escalates_the_target_share_and_agreement_counts_escalations_as_agreeing() -> None:
    samples = [sample(c / 10, agree=c % 2 == 0) for c in range(1, 11)]  # confidences 0.1 .. 1.0
    threshold = pick_threshold([s.confidence for s in samples], 0.3)
    assert threshold == pytest.approx(0.35)  # the three lowest (0.1, 0.2, 0.3) escalate
    at = evaluate(samples, threshold)
    assert at["escalation_rate"] == pytest.approx(0.3) and at["edge_share"] == pytest.approx(0.7)
    kept_agreeing = sum(s.agree for s in samples if s.confidence >= threshold)  # 0.4, 0.6, 0.8, 1.0
    assert at["edge_served_agreement"] == pytest.approx(kept_agreeing / 7)
    assert at["agreement"] == pytest.approx((kept_agreeing + 3) / 10)
    assert pick_threshold([0.5, 0.6], 0.0) < 0.5 and pick_threshold([0.5, 0.6], 1.0) > 0.6
    points = curve(samples)
    assert points[0]["escalation_rate"] == 0.0 and points[-1]["escalation_rate"] == 1.0
    assert points[-1]["agreement"] == 1.0  # always escalating agrees with itself
    assert [p["escalation_rate"] for p in points] == sorted(p["escalation_rate"] for p in points)


async def test_collect_scores_the_edge_and_compares_the_two_answers() -> None:
    def unsure_on_arithmetic(prompt: Sequence[int], i: int) -> float:
        return math.log(0.05) if "plus" in FakeTokenizer().decode(prompt) else math.log(0.9)

    def reply(prompt: Sequence[int], params: SamplingParams) -> list[str]:
        return ["four "] if "plus" in FakeTokenizer().decode(prompt) else ["hi ", "there "]

    tokenizer = FakeTokenizer()
    edge = FakeEngine(tier="edge", tokenizer=tokenizer, logprob=unsure_on_arithmetic, reply=reply)
    gpu = FakeEngine(tier="gpu", tokenizer=tokenizer, reply=lambda p, q: ["4 "] if "plus" in tokenizer.decode(p)
                     else ["hi ", "there "])
    seen: list[int] = []
    samples = await collect({"edge": edge, "gpu": gpu}, [Prompt("two plus two", "arithmetic"), Prompt("hello")],
                            QuantileScorer(0.1), hold_tokens=8, max_tokens=16,
                            progress=lambda n, total, s: seen.append(n))
    assert seen == [1, 2]
    math_sample, hello = samples
    assert math_sample.confidence == pytest.approx(0.05) and not math_sample.agree
    assert hello.confidence == pytest.approx(0.9) and hello.agree and hello.edge_text == "hi there "
    assert edge.blocks_in_use == 0 and gpu.blocks_in_use == 0
    assert evaluate(samples, pick_threshold([s.confidence for s in samples], 0.5))["agreement"] == 1.0
