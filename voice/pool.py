"""The worker pool that recognition and synthesis run on, off the event loop, within bounds.

Threads, because the work does not hold the GIL: CTranslate2 releases it while Whisper runs and
flite is a child process. Admission is bounded by the work outstanding (queued and running, in
seconds of audio processed: a recognition job counts its recognizer's whole window, since Whisper
encodes 30 s whatever the utterance) and by a job count; work past either bound is refused at once
with ``VoiceBusy``, so a burst of voice sessions is told "busy" instead of queueing minutes of work
while text sessions wait for the cores.

Fair between sessions: each job has an ``owner`` (its session), each owner at most
``max_jobs_per_owner`` jobs outstanding, and the workers take the owners' queues in turn (round
robin), so one session's backlog delays another session's next job by at most one job per worker.
With ``recognition_rate_s`` each owner also has a budget of recognition work (a ``TokenBucket``
of seconds, as the bound counts them: a short utterance is its recognizer's whole window), so one
session that commits tiny clips many times a second gets what the rate allows, not the workers
whenever the others pause; a job refused for it raises ``VoiceRateLimited`` and costs nothing, a
job that never ran is given back. A ``speculative`` recognition (one started at a pause, which the
user may make moot by going on) runs only while it leaves half the burst, so a long turn's early
jobs never spend what its final one needs.

A job is one unit the caller awaits: one utterance to transcribe, one phrase to speak. Cancelling
the awaiting task (a barge-in, a closed session) takes a queued job off the queue before it runs;
a running one cannot be stopped mid-call, but it is one phrase or one utterance, so a cancelled
answer holds the pool no longer than its current phrase. Its audio stays counted until it really
ends, so the bound is true occupancy. A timeout is the same as a cancel, reported as
``VoiceTimeout``.

Figures for /metrics: each finished job is reported to ``observer`` (on the event loop) and summed
in ``stats()`` per kind: audio seconds, compute seconds (their ratio is the real-time factor),
queue wait, and how many were refused, cancelled or timed out.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import numpy as np

from llm_shared.token_bucket import TokenBucket
from voice.asr import Recognizer, Transcription
from voice.audio import SPEECH_RATE, Float32Array
from voice.errors import VoiceBusy, VoiceRateLimited, VoiceTimeout
from voice.tts import Speech, Synthesizer

T = TypeVar("T")
Kind = Literal["asr", "tts"]
Outcome = Literal["done", "failed", "cancelled", "timeout"]
# flite speaks ~15 characters a second; a phrase's audio is estimated from its text before it
# exists, for admission only (its figures use the real length).
SPOKEN_CHARS_PER_S = 15.0


@dataclass(frozen=True)
class JobFigures:
    kind: Kind
    outcome: Outcome
    audio_s: float  # the input's length (asr) or the speech made (tts; the estimate if none was made)
    compute_s: float  # time the job ran on a worker (0 if it never started)
    wait_s: float  # time it queued before a worker took it (to its end if it never started)


@dataclass
class KindStats:
    jobs: int = 0
    audio_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0
    refused: int = 0
    cancelled: int = 0
    timed_out: int = 0
    failed: int = 0

    @property
    def real_time_factor(self) -> float:
        """Compute seconds per audio second over the jobs done so far."""
        return self.compute_s / self.audio_s if self.audio_s > 0 else 0.0


@dataclass(frozen=True)
class PoolStats:
    outstanding_audio_s: float  # queued and running, the quantity the bound applies to
    outstanding_jobs: int
    running_jobs: int
    by_kind: dict[str, KindStats] = field(default_factory=dict)


@dataclass
class _Job:
    kind: Kind
    audio_s: float  # what it counts against the bound (its cost)
    submitted: float
    started: float | None = None
    finished: float | None = None
    timed_out: bool = False
    abandoned: bool = False  # the caller stopped waiting (cancelled); the job may still have run
    completed: bool = False  # fn returned: real work, counted in the real-time factor whatever the caller did
    measured_audio_s: float | None = None
    owner: Hashable = None
    budget: TokenBucket | None = None  # the owner's recognition budget it was charged to


@dataclass
class _Queued:
    """A job waiting for a worker, in its owner's queue."""

    job: _Job
    execute: Callable[[], object]
    result: asyncio.Future[object]  # what the caller awaits; cancelled if it stops waiting


class VoicePool:
    """One per gateway process, shared by every voice session; used from one event loop."""

    def __init__(self, *, threads: int = 2, max_outstanding_audio_s: float = 600.0, max_outstanding_jobs: int = 64,
                 job_timeout_s: float = 30.0, max_jobs_per_owner: int = 4,
                 recognition_rate_s: float | None = None, recognition_burst_s: float = 0.0,
                 observer: Callable[[JobFigures], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if (threads < 1 or max_outstanding_jobs < 1 or max_jobs_per_owner < 1 or max_outstanding_audio_s <= 0
                or job_timeout_s <= 0):
            raise ValueError("threads and the job bounds must be >= 1, the audio bound and timeout > 0")
        if recognition_rate_s is not None and (recognition_rate_s <= 0 or recognition_burst_s <= 0):
            raise ValueError("recognition_rate_s and recognition_burst_s must be > 0")
        self.recognition_rate_s = recognition_rate_s
        self.recognition_burst_s = recognition_burst_s
        self._clock = clock
        # owner -> its recognition budget, for as long as the owner (a session) lives
        self._budgets: weakref.WeakKeyDictionary[object, TokenBucket] = weakref.WeakKeyDictionary()
        self.threads = threads
        self.max_outstanding_audio_s = max_outstanding_audio_s
        self.max_outstanding_jobs = max_outstanding_jobs
        self.max_jobs_per_owner = max_jobs_per_owner
        self.job_timeout_s = job_timeout_s
        self.observer = observer
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="voice")
        self._audio_s = 0.0
        self._jobs = 0
        self._running = 0  # written by worker threads, read for stats only
        self._running_lock = threading.Lock()
        self._kinds: dict[str, KindStats] = {"asr": KindStats(), "tts": KindStats()}
        self._queues: OrderedDict[Hashable, deque[_Queued]] = OrderedDict()  # owners in turn order
        self._owned: dict[Hashable, int] = {}  # owner -> its jobs outstanding
        self._free = threads  # workers not running one of our jobs
        self._closed = False

    async def transcribe(self, recognizer: Recognizer, samples_16k: Float32Array,
                         timeout_s: float | None = None, owner: Hashable = None,
                         speculative: bool = False) -> Transcription:
        audio_s = len(samples_16k) / SPEECH_RATE
        samples = np.array(samples_16k, np.float32)  # the caller's buffer may change while the job waits
        return await self.run("asr", lambda: recognizer.transcribe(samples), audio_s=audio_s, timeout_s=timeout_s,
                              owner=owner, speculative=speculative)

    async def synthesize(self, synthesizer: Synthesizer, text: str, voice: str | None = None,
                         timeout_s: float | None = None, owner: Hashable = None) -> Speech:
        estimate = max(len(text.strip()), 1) / SPOKEN_CHARS_PER_S
        return await self.run("tts", lambda: synthesizer.synthesize(text, voice), audio_s=estimate,
                              timeout_s=timeout_s, measure=lambda speech: speech.seconds, owner=owner)

    async def run(self, kind: Kind, fn: Callable[[], T], *, audio_s: float, timeout_s: float | None = None,
                  measure: Callable[[T], float] | None = None, owner: Hashable = None,
                  speculative: bool = False) -> T:
        """Run ``fn`` on a worker, in ``owner``'s turn; ``audio_s`` is what it counts against the
        bound (and, for a recognition, against the owner's budget; ``speculative``: only while it
        leaves half the budget's burst). Raises ``VoiceBusy`` at once past a bound, ``VoiceTimeout`` after ``timeout_s``
        (default: the pool's), and ``CancelledError`` if the caller is cancelled; ``fn``'s own
        errors pass through."""
        if self._closed:
            raise VoiceBusy("voice is shutting down")
        self._admit(kind, audio_s, owner)
        job = _Job(kind, audio_s, time.perf_counter(), owner=owner,
                   budget=self._charge(kind, audio_s, owner, speculative))
        self._audio_s += audio_s
        self._jobs += 1
        self._owned[owner] = self._owned.get(owner, 0) + 1

        def execute() -> T:
            job.started = time.perf_counter()
            with self._running_lock:
                self._running += 1
            try:
                result = fn()
                job.completed = True
                if measure is not None:
                    job.measured_audio_s = measure(result)
                return result
            finally:
                job.finished = time.perf_counter()
                with self._running_lock:
                    self._running -= 1

        queued = _Queued(job, execute, asyncio.get_running_loop().create_future())
        self._queues.setdefault(owner, deque()).append(queued)
        self._dispatch()
        try:
            return await asyncio.wait_for(queued.result, timeout_s or self.job_timeout_s)  # type: ignore[return-value]
        except asyncio.CancelledError:
            job.abandoned = True
            self._drop(queued)  # still queued: it never runs and frees its share now
            raise
        except TimeoutError:
            job.timed_out = True
            self._drop(queued)
            raise VoiceTimeout(f"voice {kind} job took longer than {timeout_s or self.job_timeout_s:g} s") from None

    def _admit(self, kind: Kind, audio_s: float, owner: Hashable) -> None:
        if self._jobs + 1 > self.max_outstanding_jobs or self._audio_s + audio_s > self.max_outstanding_audio_s:
            self._kinds[kind].refused += 1
            raise VoiceBusy(f"the voice workers are busy ({self._audio_s:.1f} s of audio in {self._jobs} jobs "
                            f"outstanding); try again shortly")
        if owner is not None and self._owned.get(owner, 0) + 1 > self.max_jobs_per_owner:
            self._kinds[kind].refused += 1
            raise VoiceBusy(f"this session has {self._owned[owner]} voice jobs outstanding (at most "
                            f"{self.max_jobs_per_owner}); wait for them")

    def _charge(self, kind: Kind, audio_s: float, owner: Hashable, speculative: bool) -> TokenBucket | None:
        """Take a recognition's cost from its owner's budget, or refuse it (``VoiceRateLimited``)."""
        if kind != "asr" or owner is None or self.recognition_rate_s is None:
            return None
        budget = self._budgets.get(owner)
        if budget is None:
            budget = self._budgets[owner] = TokenBucket(self.recognition_rate_s, self.recognition_burst_s,
                                                        self._clock())
        cost = min(audio_s, self.recognition_burst_s)  # the longest recording a session may send always fits
        if not budget.take(cost, self._clock(), keep=self.recognition_burst_s / 2 if speculative else 0.0):
            self._kinds[kind].refused += 1
            raise VoiceRateLimited(
                f"this session asks for speech recognition faster than it is served ({self.recognition_rate_s:g} s "
                f"of recognizer work a second, this one {cost:g} s): it was not transcribed; retry in "
                f"{budget.retry_after_s(cost):.1f}s")
        return budget

    def _dispatch(self) -> None:
        """Hand queued jobs to free workers, the owners in turn."""
        loop = asyncio.get_running_loop()
        while self._free > 0 and self._queues:
            owner, queue = next(iter(self._queues.items()))
            queued = queue.popleft()
            if queue:
                self._queues.move_to_end(owner)  # its next job waits for the others' turns
            else:
                del self._queues[owner]
            self._free -= 1
            try:
                future = self._executor.submit(queued.execute)
            except RuntimeError:  # closed: the gateway is shutting down
                self._free += 1
                self._fail_queued(queued, VoiceBusy("voice is shutting down"))
                continue

            def ended(f: Future[object], queued: _Queued = queued) -> None:
                try:
                    loop.call_soon_threadsafe(self._ended, queued, f)
                except RuntimeError:  # the loop closed while a worker ran: nothing left to account to
                    pass

            future.add_done_callback(ended)

    def _ended(self, queued: _Queued, future: Future[object]) -> None:
        """On the event loop: a job a worker took has ended; its worker takes the next turn."""
        self._free += 1
        result = queued.result
        if not result.done() and future.cancelled():
            result.set_exception(VoiceBusy("voice is shutting down"))
        elif not result.done():
            error = future.exception()
            if error is not None:
                result.set_exception(error)
            else:
                result.set_result(future.result())
        self._finish(queued.job, future)
        self._dispatch()

    def _drop(self, queued: _Queued) -> None:
        """Take a job its caller stopped waiting for out of its owner's queue (if a worker has not
        taken it yet) and account for it now."""
        queue = self._queues.get(queued.job.owner)
        if queue is None or queued not in queue:
            return  # running (accounted when it ends) or ended
        queue.remove(queued)
        if not queue:
            del self._queues[queued.job.owner]
        self._finish_unstarted(queued.job)

    def _fail_queued(self, queued: _Queued, error: BaseException) -> None:
        if not queued.result.done():
            queued.result.set_exception(error)
        self._finish_unstarted(queued.job)

    def _finish_unstarted(self, job: _Job) -> None:
        """Account for a job no worker ran: it ends as cancelled, its cost given back."""
        if job.budget is not None:
            job.budget.give_back(min(job.audio_s, self.recognition_burst_s))
        never: Future[object] = Future()
        never.cancel()
        self._finish(job, never)

    def _finish(self, job: _Job, future: Future[T]) -> None:
        """On the event loop, once the job really ended (ran, failed, or was cancelled unstarted)."""
        self._audio_s = max(self._audio_s - job.audio_s, 0.0)
        self._jobs -= 1
        left = self._owned.get(job.owner, 0) - 1
        if left > 0:
            self._owned[job.owner] = left
        else:
            self._owned.pop(job.owner, None)
        stats = self._kinds[job.kind]
        if job.timed_out:
            outcome: Outcome = "timeout"
            stats.timed_out += 1
        elif future.cancelled() or job.abandoned:
            outcome = "cancelled"
            stats.cancelled += 1
        elif future.exception() is not None:
            outcome = "failed"
            stats.failed += 1
        else:
            outcome = "done"
        end = job.finished or time.perf_counter()
        compute = end - job.started if job.started is not None else 0.0
        wait = (job.started if job.started is not None else end) - job.submitted
        audio = job.measured_audio_s if job.measured_audio_s is not None else job.audio_s
        if job.completed:
            stats.jobs += 1
            stats.audio_s += audio
            stats.compute_s += compute
            stats.wait_s += wait
        if self.observer is not None:
            self.observer(JobFigures(job.kind, outcome, audio, compute, wait))

    def stats(self) -> PoolStats:
        with self._running_lock:
            running = self._running
        return PoolStats(self._audio_s, self._jobs, running,
                         {k: KindStats(**vars(v)) for k, v in self._kinds.items()})

    def close(self) -> None:
        """Stop taking work; queued jobs are dropped (their callers get ``VoiceBusy``), running
        ones finish in their threads."""
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        queues, self._queues = self._queues, OrderedDict()
        for queue in queues.values():
            for queued in queue:
                self._fail_queued(queued, VoiceBusy("voice is shutting down"))
