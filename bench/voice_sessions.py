"""Voice sessions over the Realtime WebSocket, with the real models: latency, barge-in, capacity.

    .venv/bin/python bench/voice_sessions.py [--sessions 1 2 4 8] [--listening-turns 6] [--semantic-turns 32]
        [--format audio/pcmu] [--smoke]

One ``python -m gateway serve`` subprocess with the shipped config on the edge route (the
llama.cpp tier alone, the embedded model; voice as shipped: Silero VAD, Whisper tiny.en, flite),
only its per-key limits raised. Each session is a client as a voice app is one: a microphone
that streams 24 kHz PCM16 in real time (40 ms chunks, silence between utterances), server VAD
with the API's defaults (``--silence-ms`` to change), answers spoken (``output_modalities
["audio"]``) and played back in real time (simulated: played = time since the first audio).
Questions are flite's speech of a few short sentences.

The users listen: at a level of several sessions each user asks the next question once the last
answer has played (and a 0.5 s reply gap), and the users' first questions fall at random moments
of the first 6 s (seeded), as independent people's turns do (``--listening-turns`` each). A user
alone asks ``--turns`` questions back to back (nothing else runs, so waiting out the playback would
only lengthen the run). The stress form (``--back-to-back`` levels: ``by_sessions_back_to_back``,
``max_voice_sessions_back_to_back``) is how every level ran before 2026-11-29 10:30: all the users
start at once and each asks again at the last answer's ``response.done``, talking over an answer
that would still be playing for seconds, a load several times a listening user's.

Measured:
- ``speech_to_first_audio_ms``: from the moment the last sample of the user's speech was sent to
  the first ``response.output_audio.delta`` (the VAD's silence window is inside it).
- ``barge_in_cancel_ms``: in a barge-in turn the user speaks again 0.4, 0.9, 1.5 or 2.2 s into
  the answer (in turn); from the first sample of that speech to the answer's ``response.done``
  (cancelled).
- ``truncate_exact``: after each barge-in the client truncates the answer at the ms it played;
  the stored transcript is compared with the words whose sound ended by then, by a clock
  independent of the synthesizer: CMU Sphinx's forced alignment (pocketsphinx, its own en-US
  acoustic model; pronunciations its dictionary lacks from flite's lexicon and letter-to-sound rules) of all
  the answer's audio that arrived to the text that came with it, run after the gateway stopped.
  The share of cuts where both keep the same words (a cut it cannot align counts as not exact).
  On flite's speech of 11 sentences its word ends lie within 13 ms of flite's own phone timing on
  average (median -4 ms, 37 ms at most inside a sentence). Also against Whisper's word timestamps
  as before (``truncate_exact_whisper``; ``truncate_within_one_word``: off by at most one word),
  whose word ends on the same speech run late (median +86 ms, 5-95% -67..+197 ms).
- ``asr_rtf``, ``tts_rtf``: the gateway's own figures (/metrics: compute seconds / audio seconds).
- ``max_voice_sessions``: the most concurrent sessions (of ``--sessions``) whose
  speech-to-first-audio p99 stays under 1.2 s (server VAD); ``max_voice_sessions_semantic``: the
  same under ``semantic_vad`` (eagerness ``auto``, levels ``--semantic-sessions``).
- ``semantic_first_audio_ms_p50`` / ``_p99``: speech to first audio at one session under
  ``semantic_vad`` (eagerness ``auto``), over ``--semantic-turns`` (32) turns: the time from the
  turn's end to its first audio moves with the answer's first phrase, sampled anew each run
  (207-333 ms at the p50 in three runs of one tree with 16 turns).
- ``false_endpoint_rate``: under ``semantic_vad``, the share of questions said with a 300-800 ms
  pause inside them ("I'd like to book a table for ... four people tonight.") whose turn was
  committed inside the pause, before the user finished.

- ``by_sessions_without_ahead``: server VAD's levels ``--without-ahead`` (4) again, on a
  second gateway with ``[voice] answer_ahead = false``, after the others in the same run: what
  starting the answer at the pause gains; ``answers_ahead``: the first gateway's answers started
  ahead, by outcome (adopted by the turn's response, dropped when the user went on, ...).

Results in bench/out/voice.json, the plot in docs/img/voice.png; the last stdout line is one JSON
object with those keys (p50 and p99 of the latencies at one session), ``by_sessions`` and ``cpu``.
``--format``: the sessions' audio both ways (``audio/pcm`` at 24 kHz, the default; ``audio/pcmu``
or ``audio/pcma``: G.711 at 8 kHz, a phone line's), every figure measured the same way (the cuts'
audio decoded to 24 kHz for the aligners).
``--smoke``: one session, two turns, short answers; two sessions back to back; two listening sessions on the
gateway without answering ahead, a turn each (well under a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import (
    SMOKE_HELP,
    BenchError,
    cpu_facts,
    dump_toml,
    figure_path,
    load_average,
    percentile,
    progress,
    result_path,
    write_json,
)
from bench._gateway_server import GatewayProcess
from bench._voice_client import CHUNK_MS, ONSET_LEVEL, REPLY_GAP_S, Cut, VoiceSession, speech_clips
from gateway.config import DEFAULT_CONFIG
from voice.formats import FORMATS

QUESTIONS = ("What is the capital of France?", "Turn on the kitchen lights.", "How far away is the moon?",
             "Tell me a fun fact about cats.", "What time does the store open?", "Set a timer for ten minutes.")
INTERRUPTION = "Wait, stop. Tell me something else."
LATENCY_GOAL_MS = 1200.0
ARRIVALS_S = 6.0  # about one turn of a listening user (question, answer heard, reply gap)
# Questions said with a pause inside them (the pause cycles through PAUSES_MS): a turn detector
# that answers in the pause cuts the user off (``false_endpoint_rate``).
PAUSED = (("I'd like to book a table for", "four people tonight."), ("Can you remind me to call", "my sister tomorrow?"),
          ("Turn the living room lights", "down to half."), ("What is the weather going to be", "this weekend?"))
PAUSES_MS = (300, 450, 600, 800)


def derive_config(directory: Path, sessions: int, *, answer_ahead: bool = True) -> Path:
    raw = tomllib.loads(Path(DEFAULT_CONFIG).read_text(encoding="utf-8"))
    raw.setdefault("routing", {})["default"] = "edge"  # the edge route: the llama.cpp tier alone
    edge = raw.setdefault("edge", {})
    edge["n_seq_max"] = max(int(edge.get("n_seq_max", 4)), sessions)
    server = raw.setdefault("server", {})
    server["max_sessions_per_key"] = 4 * sessions + 16
    server["requests_per_minute"] = 1_000_000
    server["tokens_per_minute"] = 100_000_000
    # Every level's sessions are admitted: this benchmark measures how many fit (voice.max_sessions' default).
    raw.setdefault("voice", {})["max_sessions"] = 4 * sessions + 16
    if not answer_ahead:
        raw["voice"]["answer_ahead"] = False
    path = directory / ("voice-bench.toml" if answer_ahead else "voice-bench-no-ahead.toml")
    path.write_text(dump_toml(raw), encoding="utf-8")
    return path


@dataclass
class Level:
    sessions: int
    first_audio_ms: list[float] = field(default_factory=list)
    stopped_ms: list[float] = field(default_factory=list)  # end of speech -> speech_stopped
    transcribed_ms: list[float] = field(default_factory=list)  # end of speech -> transcript
    barge_in_ms: list[float] = field(default_factory=list)
    heard: list[tuple[float, str, str | None]] = field(default_factory=list)  # (first audio ms, said, heard)
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        def p(values: list[float], q: float) -> float | None:
            return round(percentile(values, q), 1) if values else None

        return {"sessions": self.sessions, "turns": len(self.first_audio_ms), "failed": self.failed,
                "speech_to_first_audio_ms_p50": p(self.first_audio_ms, 50),
                "speech_to_first_audio_ms_p99": p(self.first_audio_ms, 99),
                "barge_in_cancel_ms_p50": p(self.barge_in_ms, 50), "barge_in_cancel_ms_p99": p(self.barge_in_ms, 99),
                "speech_stopped_ms_p50": p(self.stopped_ms, 50), "transcribed_ms_p50": p(self.transcribed_ms, 50),
                "errors": self.errors[:5],
                # the slowest turns, with what was said and heard (a misheard question waits longer)
                "slowest": [{"first_audio_ms": round(ms, 1), "said": said, "heard": heard}
                            for ms, said, heard in sorted(self.heard, reverse=True)[:3]]}


async def run_level(url: str, model: str, sessions: int, barge_every: int, args: argparse.Namespace,
                    clips: dict[str, bytes], cuts: list[Cut], eagerness: str | None = None,
                    back_to_back: bool = False, alone_turns: int | None = None) -> Level:
    """``sessions`` users, each ``alone_turns`` (default ``args.turns``) turns when alone, else
    ``args.listening_turns``.
    Users listen to each answer before the next question, and the first questions of several fall
    at random moments of the first ``ARRIVALS_S`` (seeded: the same each run), as independent users'
    do. A user alone does not wait out the playback: nothing else runs on the gateway meanwhile, so
    it would change nothing but the run's length. ``back_to_back``: the stress form, the users
    all start at once and each question follows the last answer's ``response.done``."""
    level = Level(sessions)
    listen = sessions > 1 and not back_to_back
    turns = args.listening_turns if listen else alone_turns or args.turns
    rng = random.Random(sessions)
    starts = [rng.uniform(0.0, ARRIVALS_S) if listen else 0.0 for _ in range(sessions)]

    async def one(n: int) -> None:
        async with VoiceSession(url, model, silence_ms=args.silence_ms, max_output_tokens=args.tokens,
                                wire_format=FORMATS[args.format], eagerness=eagerness, listen=listen) as session:
            await asyncio.sleep(starts[n])
            for t in range(turns):
                question = clips[QUESTIONS[(n + t) % len(QUESTIONS)]]
                barge = barge_every > 0 and t % barge_every == barge_every - 1
                try:
                    turn = await session.turn(question, interruption=clips[INTERRUPTION] if barge else None)
                except BenchError as e:
                    level.failed += 1
                    level.errors.append(str(e))
                    continue
                level.first_audio_ms.append(turn.first_audio_ms)
                level.heard.append((turn.first_audio_ms, QUESTIONS[(n + t) % len(QUESTIONS)], turn.heard))
                if turn.stopped_ms is not None and turn.transcribed_ms is not None:
                    level.stopped_ms.append(turn.stopped_ms)
                    level.transcribed_ms.append(turn.transcribed_ms)
                if turn.barge_in_ms is not None:
                    level.barge_in_ms.append(turn.barge_in_ms)
                if turn.cut is not None:
                    cuts.append(turn.cut)

    await asyncio.gather(*(one(n) for n in range(sessions)))
    return level


async def false_endpoints(url: str, model: str, args: argparse.Namespace, clips: dict[str, bytes],
                          count: int) -> tuple[int, int]:
    """(questions cut off inside their pause, questions said) under ``semantic_vad``, one session."""
    cut_off = said = 0
    quiet = 2 * ONSET_LEVEL  # flite ends a clip with silence: the pause is exactly pause_ms of it

    def voiced(pcm: bytes) -> bytes:
        samples = np.frombuffer(pcm, "<i2")
        loud = np.flatnonzero(np.abs(samples.astype(np.int32)) > quiet)
        return samples[:loud[-1] + 1].tobytes() if loud.size else pcm

    async with VoiceSession(url, model, silence_ms=args.silence_ms, max_output_tokens=args.tokens,
                            wire_format=FORMATS[args.format], eagerness="auto") as session:
        for n in range(count):
            before, after = PAUSED[n % len(PAUSED)]
            try:
                cut_off += await session.paused_turn(voiced(clips[before]), PAUSES_MS[n % len(PAUSES_MS)],
                                                     clips[after])
            except BenchError as e:
                progress(f"  a paused question failed: {e}")
                continue
            said += 1
    return cut_off, said


async def levels_without_ahead(directory: Path, args: argparse.Namespace, clips: dict[str, bytes],
                               model: str) -> list[dict[str, Any]]:
    """Server VAD's levels ``args.without_ahead`` again, on a gateway whose turns start their answer
    only when they end (``[voice] answer_ahead = false``): what answering ahead gains, side by side."""
    config = derive_config(directory, max(args.without_ahead), answer_ahead=False)
    gw = GatewayProcess(config, directory / "gateway-no-ahead.log", "127.0.0.1")
    progress("starting a gateway without answering ahead")
    gw.start()
    levels = []
    try:
        await gw.wait_ready()
        for sessions in args.without_ahead:
            summary = (await run_level(gw.url, model, sessions, 0, args, clips, [])).summary()
            levels.append(summary)
            progress(f"  without answering ahead, {sessions} session(s): first audio p50 "
                     f"{summary['speech_to_first_audio_ms_p50']} ms, p99 {summary['speech_to_first_audio_ms_p99']} ms")
    finally:
        gw.stop()
    return levels


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()


class ForcedAligner:
    """Where each word of a known text ends in its audio: pocketsphinx aligning the text's words
    (its dictionary's pronunciations; flite's phones for a word it lacks, such as a number or a
    name) to 16 kHz audio, 10 ms frames."""

    def __init__(self) -> None:
        from pocketsphinx import Decoder

        from voice.tts import FliteSynthesizer

        self._decoder = Decoder(samprate=16000, bestpath=False, loglevel="FATAL")
        self._flite = FliteSynthesizer()

    def _known(self, word: str) -> bool:
        if self._decoder.lookup_word(word) is not None:
            return True
        unstressed = [re.sub(r"\d", "", p) for p in self._flite.phones(word) or [] if p != "pau"]
        phones = [_SPHINX_PHONE.get(p, p.upper()) for p in unstressed]
        if not phones:
            return False
        self._decoder.add_word(word, " ".join(phones), True)
        return True

    def word_ends_ms(self, text: str, pcm24k: bytes) -> list[float] | None:
        """The end of each of ``words(text)`` in the audio (ms), or None when it cannot align."""
        import numpy as np

        from voice.audio import REALTIME_RATE, resample, to_int16

        spoken = words(text)
        if not spoken or not all(self._known(w) for w in spoken):
            return None
        audio = to_int16(resample(np.frombuffer(pcm24k, dtype="<i2"), REALTIME_RATE, 16000))
        self._decoder.set_align_text(" ".join(spoken))
        self._decoder.start_utt()
        self._decoder.process_raw(audio.astype("<i2").tobytes(), full_utt=True)
        self._decoder.end_utt()
        found = self._decoder.seg()  # None when no path through the text fits the audio
        if found is None:
            return None
        segments = [seg for seg in found if seg.word not in ("<s>", "</s>", "<sil>", "(NULL)")]
        if len(segments) != len(spoken):
            return None
        return [(seg.end_frame + 1) * 10.0 for seg in segments]


# flite's phone names where CMU Sphinx's differ (flite's schwa; the r-coloured one)
_SPHINX_PHONE = {"ax": "AH", "axr": "ER"}


def truncate_exactness(cuts: list[Cut]) -> dict[str, Any]:
    """Each cut's stored words against the words whose sound ends within the played audio, by the
    forced aligner, and by Whisper's word timestamps."""
    if not cuts:
        return {"cuts": 0, "exact": None, "exact_whisper": None, "within_one_word": None}
    aligner = ForcedAligner()
    forced = []
    for cut in cuts:
        ends = aligner.word_ends_ms(cut.transcript, cut.audio)
        heard = None if ends is None else sum(end <= cut.played_ms for end in ends)
        forced.append({"played_ms": cut.played_ms, "stored_words": len(words(cut.stored)), "heard_words": heard,
                       "stored": cut.stored, "transcript": cut.transcript,
                       "word_ends_ms": None if ends is None else [round(e) for e in ends]})
    aligned = [r for r in forced if r["heard_words"] is not None]
    import numpy as np
    from faster_whisper import WhisperModel

    from voice.asr import find_whisper_tiny_en
    from voice.audio import REALTIME_RATE, SPEECH_RATE, resample

    model = WhisperModel(str(find_whisper_tiny_en()), device="cpu", compute_type="int8", local_files_only=True)
    rows = []
    for cut in cuts:
        audio = resample(np.frombuffer(cut.audio, dtype="<i2"), REALTIME_RATE, SPEECH_RATE)
        segments, _ = model.transcribe(audio, language="en", beam_size=1, temperature=0.0, vad_filter=False,
                                       word_timestamps=True, condition_on_previous_text=False)
        heard = [w for s in segments for w in (s.words or []) if w.end * 1000 <= cut.played_ms + 20]
        stored = len(words(cut.stored))
        rows.append({"played_ms": cut.played_ms, "stored_words": stored, "heard_words": len(heard),
                     "stored": cut.stored, "heard": "".join(w.word for w in heard).strip()})
    exact = sum(r["stored_words"] == r["heard_words"] for r in rows) / len(rows)
    near = sum(abs(r["stored_words"] - r["heard_words"]) <= 1 for r in rows) / len(rows)
    # a cut the aligner could not align counts against exactness: it is not evidence of it
    forced_exact = sum(r["heard_words"] is not None and r["stored_words"] == r["heard_words"] for r in forced)
    return {"cuts": len(rows), "exact": round(forced_exact / len(forced), 3), "aligned": len(aligned),
            "exact_whisper": round(exact, 3), "within_one_word": round(near, 3), "forced": forced, "rows": rows}


def by_sessions(levels: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {str(lv["sessions"]): {k: lv[k] for k in ("speech_to_first_audio_ms_p50", "speech_to_first_audio_ms_p99",
                                                     "failed")} for lv in levels}


def rtf(gw: GatewayProcess, kind: str) -> float | None:
    audio = gw.metric(f'gateway_voice_audio_seconds_total{{kind="{kind}"}}')
    return round(gw.metric(f'gateway_voice_compute_seconds_total{{kind="{kind}"}}') / audio, 3) if audio else None


def plot(levels: list[dict[str, Any]], cpu: dict[str, Any], path: Path, semantic: list[dict[str, Any]] | None = None,
         without: list[dict[str, Any]] | None = None, stress: list[dict[str, Any]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [lv["sessions"] for lv in levels]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for name, arm, color in (("server_vad", levels, "C0"), ("semantic_vad", semantic or [], "C1"),
                             ("server_vad, no answer ahead", without or [], "C2"),
                             ("server_vad, back to back", stress or [], "C3")):
        for key, style in (("speech_to_first_audio_ms_p50", "o-"), ("speech_to_first_audio_ms_p99", "s--")):
            if arm:
                ax.plot([lv["sessions"] for lv in arm], [lv[key] for lv in arm], style, color=color,
                        label=f"{name} {key.replace('speech_to_first_audio_ms_', '')}")
    ax.axhline(LATENCY_GOAL_MS, color="grey", lw=0.8, ls=":", label="p99 goal 1.2 s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent voice sessions")
    ax.set_ylabel("end of speech to first audio (ms)")
    ax.set_title(f"Voice on the edge route, {cpu['cores']} cores ({cpu['model'][:40]})", fontsize=9)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    cpu = cpu_facts()
    progress(f"CPU: {cpu['model']}, {cpu['cores']} cores; load average {load_average()[0]:.2f}")
    progress("making the spoken questions with flite")
    clips = speech_clips([*QUESTIONS, INTERRUPTION, *(part for pair in PAUSED for part in pair)])
    cuts: list[Cut] = []
    with tempfile.TemporaryDirectory(prefix="voice-bench-") as tmp:
        config = derive_config(Path(tmp), max([*args.sessions, *args.semantic_sessions, *args.back_to_back]))
        gw = GatewayProcess(config, Path(tmp) / "gateway.log", "127.0.0.1")
        progress("starting the gateway (edge model, VAD, Whisper, flite)")
        gw.start()
        try:
            await gw.wait_ready()
            from gateway.config import load_config

            model = load_config(config).routing.edge_model
            levels = []
            for n, sessions in enumerate(args.sessions):
                # One session measures barge-in too; more sessions measure latency under load.
                level = await run_level(gw.url, model, sessions, args.barge_every if n == 0 else 0, args,
                                        clips, cuts if n == 0 else [])
                summary = level.summary()
                levels.append(summary)
                progress(f"  {sessions} session(s): first audio p50 {summary['speech_to_first_audio_ms_p50']} ms, "
                         f"p99 {summary['speech_to_first_audio_ms_p99']} ms, barge-in p99 "
                         f"{summary['barge_in_cancel_ms_p99']} ms (after the end of speech, p50: speech_stopped "
                         f"{summary['speech_stopped_ms_p50']} ms, transcript {summary['transcribed_ms_p50']} ms), "
                         f"failed {level.failed}")
            stress = []
            for sessions in args.back_to_back:  # the stress form: no listening, all at once
                level = await run_level(gw.url, model, sessions, 0, args, clips, [], back_to_back=True)
                stress.append(level.summary())
                progress(f"  back to back, {sessions} session(s): first audio p50 "
                         f"{stress[-1]['speech_to_first_audio_ms_p50']} ms, p99 "
                         f"{stress[-1]['speech_to_first_audio_ms_p99']} ms, failed {level.failed}")
            semantic = []
            for sessions in args.semantic_sessions:  # turns ended by semantic_vad (eagerness auto)
                level = await run_level(gw.url, model, sessions, 0, args, clips, [], eagerness="auto",
                                        alone_turns=args.semantic_turns)
                semantic.append(level.summary())
                progress(f"  semantic_vad, {sessions} session(s): first audio p50 "
                         f"{semantic[-1]['speech_to_first_audio_ms_p50']} ms, p99 "
                         f"{semantic[-1]['speech_to_first_audio_ms_p99']} ms (after the end of speech, p50: "
                         f"speech_stopped {semantic[-1]['speech_stopped_ms_p50']} ms), failed {level.failed}")
            cut_off, paused = await false_endpoints(gw.url, model, args, clips, args.paused)
            progress(f"  semantic_vad: {cut_off} of {paused} questions with a pause inside cut off")
            rtfs = {"asr": rtf(gw, "asr"), "tts": rtf(gw, "tts")}
            ahead = {o: gw.metric(f'gateway_voice_answers_ahead_total{{outcome="{o}"}}', default=0.0)
                     for o in ("adopted", "dropped", "refused", "failed")}
            problems = gw.log_problems()
        finally:
            gw.stop()
        without = await levels_without_ahead(Path(tmp), args, clips, model) if args.without_ahead else []
    if problems:
        progress(f"gateway log: {len(problems)} warning/error lines, e.g. {problems[0][:200]}")
    progress(f"truncate exactness: aligning {len(cuts)} played cuts (forced alignment; Whisper word timestamps)")
    exactness = truncate_exactness(cuts)
    one = levels[0]
    def fits(levels: list[dict[str, Any]]) -> list[int]:
        return [lv["sessions"] for lv in levels if lv["speech_to_first_audio_ms_p99"] is not None
                and lv["speech_to_first_audio_ms_p99"] <= LATENCY_GOAL_MS and lv["failed"] == 0]

    fit, fit_semantic = fits(levels), fits(semantic)
    # the one-session level's users do not wait out the playback either: it counts for both
    fit_stress = fits([lv for lv in levels if lv["sessions"] == 1] + stress)
    summary = {
        "speech_to_first_audio_ms_p50": one["speech_to_first_audio_ms_p50"],
        "speech_to_first_audio_ms_p99": one["speech_to_first_audio_ms_p99"],
        "barge_in_cancel_ms_p50": one["barge_in_cancel_ms_p50"],
        "barge_in_cancel_ms_p99": one["barge_in_cancel_ms_p99"],
        "truncate_exact": exactness["exact"], "truncate_exact_whisper": exactness["exact_whisper"],
        "truncate_within_one_word": exactness["within_one_word"],
        "asr_rtf": rtfs["asr"], "tts_rtf": rtfs["tts"],
        "max_voice_sessions": max(fit) if fit else 0,
        "semantic_first_audio_ms_p50": semantic[0]["speech_to_first_audio_ms_p50"],
        "semantic_first_audio_ms_p99": semantic[0]["speech_to_first_audio_ms_p99"],
        "false_endpoint_rate": round(cut_off / paused, 3) if paused else None,
        "max_voice_sessions_semantic": max(fit_semantic) if fit_semantic else 0,
        "max_voice_sessions_back_to_back": max(fit_stress) if fit_stress else 0,
        "failed": sum(lv["failed"] for lv in (*levels, *stress, *semantic, *without)) + args.paused - paused,
        "by_sessions": by_sessions(levels),
        "by_sessions_semantic": by_sessions(semantic),
        "by_sessions_back_to_back": by_sessions(stress),
        # server VAD on a gateway with [voice] answer_ahead = false, after the others (the same run)
        "by_sessions_without_ahead": by_sessions(without),
        "answers_ahead": ahead,
        "cpu": cpu["model"],
    }
    # A run in another format writes files of its own: the 24 kHz run's plot and figures stay.
    name = "voice" if args.format == "audio/pcm" else f"voice_{args.format.removeprefix('audio/')}"
    img = figure_path(f"{name}.png", args.smoke)
    plot(levels, cpu, img, semantic, without, stress)
    write_json(result_path(f"{name}.json", args.smoke), {
        "summary": summary, "levels": levels, "semantic_levels": semantic, "without_ahead_levels": without,
        "back_to_back_levels": stress, "truncate": exactness, "cpu": cpu, "plot": str(img),
        "settings": {k: getattr(args, k) for k in ("sessions", "semantic_sessions", "back_to_back", "turns", "semantic_turns",
                                                   "listening_turns", "barge_every", "silence_ms", "tokens",
                                                   "format", "smoke")}
        | {"chunk_ms": CHUNK_MS, "arrivals_s": ARRIVALS_S, "reply_gap_s": REPLY_GAP_S}})
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8], help="concurrent sessions per level")
    p.add_argument("--semantic-sessions", type=int, nargs="+", default=[1, 4, 8],
                   help="the levels again, turns ended by semantic_vad (eagerness auto)")
    p.add_argument("--back-to-back", type=int, nargs="*", default=[2, 4],
                   help="server VAD levels in the stress form: all start at once, no listening")
    p.add_argument("--turns", type=int, default=16, help="turns of a session alone (and of the stress form's)")
    p.add_argument("--semantic-turns", type=int, default=32,
                   help="turns of a session alone under semantic_vad (its p50 moves with each answer's first phrase)")
    p.add_argument("--listening-turns", type=int, default=6,
                   help="turns per session at levels of more than one (each one's answer heard out)")
    p.add_argument("--barge-every", type=int, default=2, help="at the first level, every n-th turn is interrupted")
    p.add_argument("--silence-ms", type=int, default=500, help="server VAD silence_duration_ms (the API's default)")
    p.add_argument("--tokens", type=int, default=48, help="max_output_tokens of an answer")
    p.add_argument("--paused", type=int, default=20, help="questions with a pause inside, for false_endpoint_rate")
    p.add_argument("--format", choices=sorted(FORMATS), default="audio/pcm", help="the sessions' audio, both ways")
    p.add_argument("--without-ahead", type=int, nargs="*", default=[4],
                   help="server VAD levels measured again on a gateway without [voice] answer_ahead")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    if args.smoke:
        # one plain turn, one barge-in; two questions with a pause inside
        args.sessions, args.turns, args.barge_every, args.tokens, args.paused = [1], 2, 2, 16, 2
        args.semantic_sessions, args.listening_turns, args.semantic_turns = [1], 1, 2
        # every arm runs, so that a change cannot break one unseen: two listening sessions on the
        # second gateway, two back to back
        args.without_ahead, args.back_to_back = [2], [2]
    started = time.perf_counter()
    summary = asyncio.run(main_async(args))
    progress(f"done in {time.perf_counter() - started:.0f} s")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
