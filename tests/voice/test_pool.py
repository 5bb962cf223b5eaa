"""The voice worker pool: bounds, cancellation, timeouts and figures, with jobs that block on an
event so the tests decide when work ends (no sleeps), then once with the real synthesizer."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from voice.asr import Transcription
from voice.errors import VoiceBusy, VoiceRateLimited, VoiceTimeout
from voice.pool import JobFigures, VoicePool
from voice.tts import FliteSynthesizer

WAIT = 30.0  # a bound on every wait in these tests, far above what any takes


class Gate:
    """A job body that blocks until opened, and says when it started."""

    def __init__(self, result: object = "done") -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.ran = False
        self.result = result

    def __call__(self) -> object:
        self.ran = True
        self.started.set()
        assert self.release.wait(WAIT)
        return self.result


@pytest.fixture
def figures() -> list[JobFigures]:
    return []


@pytest.fixture
def pool(figures: list[JobFigures]) -> Iterator[VoicePool]:
    p = VoicePool(threads=1, max_outstanding_audio_s=10.0, max_outstanding_jobs=3, job_timeout_s=WAIT,
                  observer=figures.append)
    yield p
    p.close()


async def started(gate: Gate) -> None:
    assert await asyncio.to_thread(gate.started.wait, WAIT)


async def settle(pool: VoicePool, until: Callable[[], bool]) -> None:
    """Let the loop run the pool's done callbacks (a worker hands them over with call_soon_threadsafe)."""
    for _ in range(1000):
        if until():
            return
        await asyncio.sleep(0)  # one loop turn: no wall-clock wait
        await asyncio.to_thread(lambda: None)
    raise AssertionError(f"never settled: {pool.stats()}")


async def test_a_job_runs_off_the_loop_and_its_figures_are_kept(pool: VoicePool, figures: list[JobFigures]) -> None:
    loop_thread = threading.get_ident()
    ran_on: list[int] = []

    def job() -> Transcription:
        ran_on.append(threading.get_ident())
        return Transcription("hi", 2.0, 0.5)

    result = await pool.run("asr", job, audio_s=2.0)
    assert result.text == "hi" and ran_on and ran_on[0] != loop_thread
    await settle(pool, lambda: pool.stats().outstanding_jobs == 0)
    stats = pool.stats()
    assert stats.outstanding_audio_s == 0.0 and stats.by_kind["asr"].jobs == 1
    assert stats.by_kind["asr"].audio_s == 2.0 and stats.by_kind["asr"].compute_s > 0
    assert [f.outcome for f in figures] == ["done"] and figures[0].kind == "asr"


async def test_work_past_the_job_bound_is_refused_at_once(pool: VoicePool) -> None:
    gates = [Gate() for _ in range(3)]
    tasks = [asyncio.create_task(pool.run("tts", g, audio_s=1.0)) for g in gates]
    await started(gates[0])
    with pytest.raises(VoiceBusy) as info:
        await pool.run("tts", Gate(), audio_s=1.0)
    assert info.value.code == "voice_busy" and "3 jobs" in info.value.message
    assert pool.stats().by_kind["tts"].refused == 1
    for g in gates:
        g.release.set()
    assert await asyncio.gather(*tasks) == ["done"] * 3
    await settle(pool, lambda: pool.stats().outstanding_jobs == 0)
    assert await pool.run("tts", lambda: "again", audio_s=1.0) == "again"  # room again once they are done


async def test_work_past_the_audio_bound_is_refused(pool: VoicePool) -> None:
    first = Gate()
    task = asyncio.create_task(pool.run("asr", first, audio_s=6.0))
    await started(first)
    with pytest.raises(VoiceBusy):
        await pool.run("asr", Gate(), audio_s=5.0)  # 6 + 5 > 10 s outstanding
    assert pool.stats().outstanding_audio_s == 6.0
    first.release.set()
    await task


async def test_a_cancelled_queued_job_never_runs_and_frees_its_share_at_once(pool: VoicePool,
                                                                             figures: list[JobFigures]) -> None:
    running, queued = Gate(), Gate()
    first = asyncio.create_task(pool.run("tts", running, audio_s=2.0))
    await started(running)
    second = asyncio.create_task(pool.run("tts", queued, audio_s=3.0))
    await asyncio.sleep(0)  # let it be submitted
    assert pool.stats().outstanding_audio_s == 5.0
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    await settle(pool, lambda: pool.stats().outstanding_audio_s == 2.0)  # freed while the first still runs
    running.release.set()
    await first
    assert not queued.ran
    await settle(pool, lambda: len(figures) == 2)
    assert sorted(f.outcome for f in figures) == ["cancelled", "done"]


async def test_a_cancelled_running_job_holds_its_share_until_it_ends(pool: VoicePool,
                                                                     figures: list[JobFigures]) -> None:
    gate = Gate()
    task = asyncio.create_task(pool.run("tts", gate, audio_s=2.0))
    await started(gate)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.stats().outstanding_audio_s == 2.0 and pool.stats().running_jobs == 1  # it is still running
    gate.release.set()
    await settle(pool, lambda: pool.stats().outstanding_jobs == 0)
    assert pool.stats().outstanding_audio_s == 0.0
    assert [f.outcome for f in figures] == ["cancelled"]
    assert pool.stats().by_kind["tts"].compute_s > 0  # it did run: its work counts in the real-time factor


async def test_a_job_past_its_timeout_is_a_voice_timeout(pool: VoicePool, figures: list[JobFigures]) -> None:
    gate = Gate()
    with pytest.raises(VoiceTimeout):
        await pool.run("asr", gate, audio_s=1.0, timeout_s=0.05)
    gate.release.set()
    await settle(pool, lambda: pool.stats().outstanding_jobs == 0)
    assert [f.outcome for f in figures] == ["timeout"] and pool.stats().by_kind["asr"].timed_out == 1


async def test_a_failing_job_raises_its_error_and_is_counted(pool: VoicePool) -> None:
    def broken() -> None:
        raise RuntimeError("flite exited with 1")

    with pytest.raises(RuntimeError, match="flite"):
        await pool.run("tts", broken, audio_s=1.0)
    await settle(pool, lambda: pool.stats().by_kind["tts"].failed == 1)
    assert pool.stats().outstanding_jobs == 0


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        VoicePool(threads=0)
    with pytest.raises(ValueError):
        VoicePool(max_outstanding_audio_s=0)


async def test_real_synthesis_and_its_real_time_factor(figures: list[JobFigures]) -> None:
    pool = VoicePool(threads=2, observer=figures.append)
    try:
        speech = await pool.synthesize(FliteSynthesizer(), "One phrase of an answer, spoken off the loop.", "ash")
        assert speech.seconds > 1.0
        await settle(pool, lambda: len(figures) == 1)
        tts = pool.stats().by_kind["tts"]
        assert tts.audio_s == pytest.approx(speech.seconds)  # the real length, not the estimate
        assert 0 < tts.real_time_factor < 1
    finally:
        pool.close()


async def test_transcribe_copies_the_samples_before_queueing(pool: VoicePool) -> None:
    class Recorder:
        def transcribe(self, samples_16k: np.ndarray) -> Transcription:
            return Transcription(str(samples_16k[0]), len(samples_16k) / 16_000, 0.0)

    busy = Gate()
    first = asyncio.create_task(pool.run("asr", busy, audio_s=1.0))
    await started(busy)
    samples = np.ones(16_000, np.float32)
    job = asyncio.create_task(pool.transcribe(Recorder(), samples))
    await asyncio.sleep(0)  # submitted: it waits behind the first job
    samples[0] = 5.0  # the session's buffer is reused while the job waits
    busy.release.set()
    await first
    assert (await job).text == "1.0"


# --- fairness between sessions (issue 39, item 2) ------------------------------------------------

async def test_one_sessions_backlog_delays_anothers_next_job_by_one_job_at_most() -> None:
    """The workers take the sessions' queues in turn: a session that queued several jobs does
    not make another session's job wait behind all of them."""
    pool = VoicePool(threads=1, max_outstanding_audio_s=100.0, max_outstanding_jobs=16, max_jobs_per_owner=8,
                     job_timeout_s=WAIT)
    order: list[str] = []
    first = Gate()

    def job(name: str, gate: Gate | None = None) -> Callable[[], object]:
        def run() -> object:
            order.append(name)
            return gate() if gate is not None else name
        return run

    try:
        hog = [asyncio.ensure_future(pool.run("asr", job("hog0", first), audio_s=1.0, owner="hog"))]
        await started(first)  # the hog's first job holds the only worker
        hog += [asyncio.ensure_future(pool.run("asr", job(f"hog{i}"), audio_s=1.0, owner="hog")) for i in (1, 2, 3)]
        other = asyncio.ensure_future(pool.run("asr", job("other"), audio_s=1.0, owner="other"))
        first.release.set()
        await asyncio.wait_for(asyncio.gather(*hog, other), WAIT)
        assert order == ["hog0", "hog1", "other", "hog2", "hog3"]
    finally:
        first.release.set()
        pool.close()


async def test_a_session_past_its_job_bound_is_refused_and_others_are_not() -> None:
    pool = VoicePool(threads=1, max_outstanding_audio_s=100.0, max_outstanding_jobs=16, max_jobs_per_owner=2,
                     job_timeout_s=WAIT)
    gate = Gate()
    try:
        held = [asyncio.ensure_future(pool.run("asr", gate, audio_s=1.0, owner="a")) for _ in range(2)]
        await started(gate)
        with pytest.raises(VoiceBusy, match="this session has 2 voice jobs outstanding"):
            await pool.run("asr", gate, audio_s=1.0, owner="a")
        other = asyncio.ensure_future(pool.run("asr", lambda: "b", audio_s=1.0, owner="b"))
        gate.release.set()
        assert await asyncio.wait_for(other, WAIT) == "b"
        await asyncio.wait_for(asyncio.gather(*held), WAIT)
    finally:
        gate.release.set()
        pool.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Owner:
    """A session: the pool keeps its budget for as long as it lives."""


@contextlib.contextmanager
def budgeted(burst_s: float, **bounds: int) -> Iterator[tuple[VoicePool, Clock]]:
    """A pool whose sessions may ask for one short utterance (12 s of recognizer work) a second
    and ``burst_s`` at once, on a clock the test moves."""
    clock = Clock()
    pool = VoicePool(threads=1, max_outstanding_audio_s=600.0, job_timeout_s=WAIT, recognition_rate_s=12.0,
                     recognition_burst_s=burst_s, clock=clock, **bounds)
    try:
        yield pool, clock
    finally:
        pool.close()


async def test_a_session_flooding_recognitions_gets_its_rate_and_the_others_theirs() -> None:
    flood, quiet = Owner(), Owner()
    with budgeted(36.0, max_outstanding_jobs=64, max_jobs_per_owner=64) as (pool, clock):
        for _ in range(3):  # its burst: three short utterances at once
            assert await pool.run("asr", lambda: "heard", audio_s=12.0, owner=flood) == "heard"
        with pytest.raises(VoiceRateLimited) as info:
            await pool.run("asr", lambda: "heard", audio_s=12.0, owner=flood)
        assert info.value.code == "recognition_rate_limited" and "retry in 1.0s" in info.value.message
        assert pool.stats().by_kind["asr"].refused == 1
        assert await pool.run("asr", lambda: "mine", audio_s=12.0, owner=quiet) == "mine"  # a budget of its own
        assert await pool.run("tts", lambda: "spoken", audio_s=12.0, owner=flood) == "spoken"  # speech is not counted
        clock.now = 1.0  # a second refills one short utterance
        assert await pool.run("asr", lambda: "heard", audio_s=12.0, owner=flood) == "heard"
        with pytest.raises(VoiceRateLimited):
            await pool.run("asr", lambda: "heard", audio_s=12.0, owner=flood)


async def test_a_recording_longer_than_the_burst_is_served_from_a_full_budget() -> None:
    owner = Owner()
    with budgeted(120.0) as (pool, _):
        assert await pool.run("asr", lambda: "long", audio_s=150.0, owner=owner) == "long"
        with pytest.raises(VoiceRateLimited):
            await pool.run("asr", lambda: "more", audio_s=12.0, owner=owner)


async def test_a_recognition_cancelled_before_it_ran_costs_the_session_nothing() -> None:
    owner, other = Owner(), Owner()
    running = Gate()
    with budgeted(24.0) as (pool, _):
        first = asyncio.create_task(pool.run("asr", running, audio_s=12.0, owner=other))
        await started(running)
        moot = asyncio.create_task(pool.run("asr", Gate(), audio_s=12.0, owner=owner))
        kept = asyncio.create_task(pool.run("asr", lambda: "kept", audio_s=12.0, owner=owner))
        await asyncio.sleep(0)  # both queued behind the running job: the budget is spent
        with pytest.raises(VoiceRateLimited):
            await pool.run("asr", lambda: "refused", audio_s=12.0, owner=owner)
        moot.cancel()  # the user went on speaking: that cut is moot
        with pytest.raises(asyncio.CancelledError):
            await moot
        running.release.set()
        assert await first == "done" and await kept == "kept"
        assert await pool.run("asr", lambda: "again", audio_s=12.0, owner=owner) == "again"  # the moot job's share


async def test_a_recognition_started_at_a_pause_leaves_room_for_the_turns_end() -> None:
    """Server VAD starts a recognition at each pause of a long turn; those may be skipped, the
    turn's final one may not: a speculative job runs only while it leaves half the burst."""
    owner = Owner()
    with budgeted(48.0, max_jobs_per_owner=64) as (pool, _):
        assert await pool.run("asr", lambda: "pause", audio_s=12.0, owner=owner, speculative=True) == "pause"
        assert await pool.run("asr", lambda: "pause", audio_s=12.0, owner=owner, speculative=True) == "pause"
        with pytest.raises(VoiceRateLimited):  # 24 s left: one more would leave less than half of 48
            await pool.run("asr", lambda: "pause", audio_s=12.0, owner=owner, speculative=True)
        assert await pool.run("asr", lambda: "end", audio_s=12.0, owner=owner) == "end"
        assert await pool.run("asr", lambda: "end", audio_s=12.0, owner=owner) == "end"
