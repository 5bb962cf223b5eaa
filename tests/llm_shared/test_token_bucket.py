"""A session's audio rate bound, on a clock the test drives."""

from __future__ import annotations

import pytest

from voice.limits import AudioRateLimiter


def test_a_burst_then_the_sustained_rate() -> None:
    limiter = AudioRateLimiter(bytes_per_s=1000, burst_bytes=3000, now=0.0)
    assert limiter.take(3000, now=0.0)  # the burst at once
    assert not limiter.take(1, now=0.0)
    assert limiter.retry_after_s(500) == pytest.approx(0.5)
    assert not limiter.take(600, now=0.5)  # 500 refilled
    assert limiter.take(500, now=0.5)
    assert limiter.take(1000, now=1.5)


def test_idle_time_refills_only_up_to_the_burst() -> None:
    limiter = AudioRateLimiter(bytes_per_s=1000, burst_bytes=2000, now=0.0)
    assert limiter.take(2000, now=100.0)
    assert not limiter.take(1, now=100.0)


def test_a_clock_going_back_gives_nothing() -> None:
    limiter = AudioRateLimiter(bytes_per_s=1000, burst_bytes=1000, now=10.0)
    assert limiter.take(1000, now=10.0)
    assert not limiter.take(1, now=5.0)
    assert not limiter.take(1, now=10.0)
    assert limiter.take(1000, now=11.0)


def test_bad_rates() -> None:
    with pytest.raises(ValueError):
        AudioRateLimiter(0, 10, now=0.0)
