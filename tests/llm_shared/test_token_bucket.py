"""Token buckets (a session's audio rate, its recognition budget, a key's grammar compiles), on a clock the test drives."""

from __future__ import annotations

import pytest

from llm_shared.token_bucket import TokenBucket


def test_a_burst_then_the_sustained_rate() -> None:
    limiter = TokenBucket(rate_per_s=1000, burst=3000, now=0.0)
    assert limiter.take(3000, now=0.0)  # the burst at once
    assert not limiter.take(1, now=0.0)
    assert limiter.retry_after_s(500) == pytest.approx(0.5)
    assert not limiter.take(600, now=0.5)  # 500 refilled
    assert limiter.take(500, now=0.5)
    assert limiter.take(1000, now=1.5)


def test_idle_time_refills_only_up_to_the_burst() -> None:
    limiter = TokenBucket(rate_per_s=1000, burst=2000, now=0.0)
    assert limiter.take(2000, now=100.0)
    assert not limiter.take(1, now=100.0)


def test_a_clock_going_back_gives_nothing() -> None:
    limiter = TokenBucket(rate_per_s=1000, burst=1000, now=10.0)
    assert limiter.take(1000, now=10.0)
    assert not limiter.take(1, now=5.0)
    assert not limiter.take(1, now=10.0)
    assert limiter.take(1000, now=11.0)


def test_bad_rates() -> None:
    with pytest.raises(ValueError):
        TokenBucket(0, 10, now=0.0)


def test_work_that_never_ran_is_given_back_up_to_the_burst() -> None:
    bucket = TokenBucket(rate_per_s=1, burst=10, now=0.0)
    assert bucket.take(8, now=0.0)
    assert bucket.level(now=0.0) == 2
    bucket.give_back(8)
    assert bucket.level(now=0.0) == 10  # full again
    bucket.give_back(5)
    assert not bucket.take(11, now=0.0)  # never past the burst
    assert bucket.take(10, now=0.0)


def test_work_charged_after_it_ran_may_leave_a_debt_that_refuses_until_repaid() -> None:
    bucket = TokenBucket(rate_per_s=1, burst=2, now=0.0)
    assert bucket.take(0.0, now=0.0)
    bucket.debit(5, now=0.0)  # it cost more than the bucket held
    assert not bucket.take(0.0, now=2.9)
    assert bucket.retry_after_s(0.0) == pytest.approx(0.1)
    assert bucket.take(0.0, now=3.0)
