"""Voice in the sans-I/O Realtime session: input audio with server VAD or push to talk, transcripts
held for the prompt, speech out phrase by phrase in order, barge-in and truncation by audio_end_ms.
Literal events in, events (checked against the official SDK's types) and commands out. The VAD
here is a loudness threshold and the splitter cuts at sentence ends: the real ones (Silero,
``voice.phrases``) are tested in tests/voice/ and end to end in test_server_voice.py."""

from __future__ import annotations

import base64
import itertools
import struct
from dataclasses import replace
from typing import Any

from session_helpers import drain

from gateway.ws.audio_events import PCM_BYTES_PER_MS, ServerVad
from gateway.ws.audio_input import (
    SpeechEndProposed,
    SpeechEvent,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
    SpeechStopped,
)
from gateway.ws.commands import (
    AbortGeneration,
    AdmitResponse,
    CancelSpeech,
    CancelTranscription,
    DropForesight,
    Foresee,
    StartGeneration,
    Synthesize,
    Transcribe,
)
from gateway.ws.session import RealtimeSession, SessionLimits
from gateway.ws.voice_input import VoiceHooks
from llm_shared.contract import FinishEvent, TokenEvent
from llm_shared.structured import get_family

LOUD, QUIET = 8000, 0


class LoudnessVad:
    """Speech is 10 ms frames whose first sample is loud; it stops after ``silence_duration_ms``,
    and with ``pause_ms`` a pause is reported first."""

    def __init__(self, vad: ServerVad, pause_ms: int = 0) -> None:
        self.vad = vad
        self.pause_ms = pause_ms
        self.ms = 0
        self.speaking = False
        self.quiet_ms = 0

    def feed(self, pcm: bytes) -> list[SpeechEvent]:
        events: list[SpeechEvent] = []
        frame = 10 * PCM_BYTES_PER_MS
        for start in range(0, len(pcm) - frame + 1, frame):
            (sample,) = struct.unpack_from("<h", pcm, start)
            loud = abs(sample) >= 1000
            if loud and not self.speaking:
                self.speaking, self.quiet_ms = True, 0
                events.append(SpeechStarted(max(self.ms - self.vad.prefix_padding_ms, 0)))
            elif self.speaking:
                if loud and self.pause_ms and self.quiet_ms >= self.pause_ms:
                    events.append(SpeechResumed(self.ms - self.quiet_ms))
                self.quiet_ms = 0 if loud else self.quiet_ms + 10
                if self.pause_ms and self.quiet_ms == self.pause_ms:
                    events.append(SpeechPaused(self.ms + 10 - self.pause_ms))
                if self.quiet_ms >= self.vad.silence_duration_ms:
                    self.speaking = False
                    events.append(SpeechStopped(self.ms + 10, self.ms + 10 - self.vad.silence_duration_ms))
            self.ms += 10
        return events


class ProposingVad(LoudnessVad):
    """semantic_vad's segmenter with a turn model that always judges the turn over at the pause:
    it proposes the end there (``SpeechEndProposed``) and ends it on ``confirm_end``."""

    def __init__(self, vad: ServerVad) -> None:
        super().__init__(vad, pause_ms=160)
        self.proposed: SpeechEndProposed | None = None

    def feed(self, pcm: bytes) -> list[SpeechEvent]:
        events: list[SpeechEvent] = []
        for event in super().feed(pcm):
            events.append(event)
            if isinstance(event, SpeechPaused):
                self.proposed = SpeechEndProposed(event.speech_end_ms, event.speech_end_ms + self.pause_ms)
                events.append(self.proposed)
        return events

    def confirm_end(self, speech_end_ms: int) -> SpeechStopped | None:
        proposed, self.proposed = self.proposed, None
        if proposed is None or proposed.speech_end_ms != speech_end_ms or not self.speaking or self.ms - self.quiet_ms != speech_end_ms:
            return None
        self.speaking = False
        return SpeechStopped(proposed.audio_end_ms, speech_end_ms)


class SentenceSplitter:
    def __init__(self) -> None:
        self.held = ""

    def feed(self, text: str) -> list[str]:
        self.held += text
        out = []
        while ". " in self.held:
            phrase, self.held = self.held.split(". ", 1)
            out.append(phrase + ". ")
        return out

    def flush(self) -> list[str]:
        rest, self.held = self.held, ""
        return [rest] if rest else []


HOOKS = VoiceHooks(segmenters=LoudnessVad, phrases=SentenceSplitter)
EAGER = VoiceHooks(segmenters=lambda vad: LoudnessVad(vad, pause_ms=160), phrases=SentenceSplitter)
SEMANTIC = VoiceHooks(segmenters=ProposingVad, phrases=SentenceSplitter)


def make(*, voice: bool = True, limits: SessionLimits | None = None, beta: bool = False,
         hooks: VoiceHooks = HOOKS) -> RealtimeSession:
    counter = itertools.count(1)
    # A stopped clock: the audio rate bound refills with time, and a test must not depend on how fast it runs.
    session = RealtimeSession(session_id="sess_1", model="smollm2-135m", limits=limits or SessionLimits(), beta=beta,
                              id_factory=lambda prefix: f"{prefix}_{next(counter)}", family=get_family("smollm2"),
                              voice=hooks if voice else None, clock=lambda: 0.0)
    session.start()
    drain(session)
    return session


def tone(ms: int, level: int) -> bytes:
    return struct.pack("<h", level) * (ms * PCM_BYTES_PER_MS // 2)


def append(session: RealtimeSession, pcm: bytes) -> list[dict[str, Any]]:
    session.receive({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
    return drain(session)


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def speak_turn(session: RealtimeSession) -> tuple[list[dict[str, Any]], list[object]]:
    """Silence, 600 ms of speech, then silence enough to end it (the default 500 ms)."""
    events = append(session, tone(200, QUIET))
    events += append(session, tone(600, LOUD))
    events += append(session, tone(600, QUIET))
    return events, session.commands()


def story_started(session: RealtimeSession, transcribe: Transcribe) -> str:
    """The spoken turn is admitted and heard as a request for a story; the engine starts telling
    it (two sentences, so two phrases). The response id."""
    session.response_admitted(True)
    session.transcribed(transcribe.item_id, "Tell me a story.", 1.3)
    drain(session)
    (start,) = session.commands()
    session.engine_event(start.response_id, TokenEvent(token_id=1, text="Once upon a time. There was a fox. ",
                                                       logprob=0.0))
    session.commands()
    return start.response_id


def audio_session(**session_fields: Any) -> RealtimeSession:
    session = make()
    session.receive({"type": "session.update", "session": {"output_modalities": ["audio"], **session_fields}})
    assert types(drain(session)) == ["session.updated"]
    return session


def test_session_reports_its_audio_settings_and_takes_updates() -> None:
    session = make()
    session.receive({"type": "session.update", "session": {
        "output_modalities": ["audio"], "audio": {"output": {"voice": "cedar"}, "input": {
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 300, "create_response": False}}}}})
    (updated,) = drain(session)
    audio = updated["session"]["audio"]
    assert updated["session"]["output_modalities"] == ["audio"]
    assert audio["output"]["voice"] == "cedar" and audio["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert audio["input"]["turn_detection"]["silence_duration_ms"] == 300
    assert audio["input"]["turn_detection"]["create_response"] is False


def test_server_vad_commits_the_speech_and_answers_once_it_is_transcribed() -> None:
    session = make()
    events, commands = speak_turn(session)
    assert types(events) == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                             "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
    started, stopped = events[0], events[1]
    assert started["audio_start_ms"] == 0  # speech from 200 ms, with 300 ms of padding before it
    assert stopped["audio_end_ms"] == 1300 and stopped["item_id"] == started["item_id"]
    item = events[3]["item"]
    assert item["content"] == [{"type": "input_audio", "transcript": None}]
    transcribe, admit = commands
    # the response waits for the key's admission, as a client's response.create does
    assert admit == AdmitResponse(item["id"])
    session.response_admitted(True)
    assert types(drain(session)) == ["response.created"]
    assert isinstance(transcribe, Transcribe) and transcribe.item_id == item["id"]
    assert len(transcribe.audio) == 1300 * PCM_BYTES_PER_MS  # from the padded start to the end of speech

    session.transcription_piece(item["id"], transcribe.tag, "What time")
    session.transcription_piece(item["id"], transcribe.tag, " is it?")
    session.transcribed(item["id"], "What time is it?", 1.3)
    heard = drain(session)  # one delta per piece the recognizer decoded, then the whole
    assert types(heard) == ["conversation.item.input_audio_transcription.delta"] * 2 + [
        "conversation.item.input_audio_transcription.completed"]
    assert [e["delta"] for e in heard[:2]] == ["What time", " is it?"]
    assert {e["item_id"] for e in heard} == {item["id"]} and heard[0]["content_index"] == 0
    assert heard[-1]["transcript"] == "What time is it?"
    (start,) = session.commands()
    assert isinstance(start, StartGeneration)
    assert start.messages[-1] == {"role": "user", "content": "What time is it?"}


def test_an_audio_response_speaks_its_phrases_in_order() -> None:
    session = audio_session()
    session.receive({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}})
    drain(session)
    session.receive({"type": "response.create"})
    (start,) = session.commands()
    rid = start.response_id
    assert types(drain(session)) == ["response.created"]
    for text in ("Hello there. ", "How are", " you? "):
        session.engine_event(rid, TokenEvent(token_id=1, text=text, logprob=0.0))
    asked = session.commands()
    assert asked == [Synthesize(rid, 0, "Hello there. ", "alloy")]
    assert drain(session) == []  # nothing is said before its audio is there
    session.engine_event(rid, FinishEvent(reason="stop", prompt_tokens=9, completion_tokens=4))
    (second,) = session.commands()
    assert second == Synthesize(rid, 1, "How are you? ", "alloy")
    session.speech_ready(rid, 1, tone(700, 5))  # the second phrase first: it waits for the first
    assert drain(session) == []
    session.speech_ready(rid, 0, tone(1200, 5))
    events = drain(session)
    assert types(events) == [
        "response.output_item.added", "conversation.item.added", "response.content_part.added",
        "response.output_audio_transcript.delta", "response.output_audio.delta", "response.output_audio.delta",
        "response.output_audio.delta", "response.output_audio_transcript.delta", "response.output_audio.delta",
        "response.output_audio.delta", "response.output_audio.done", "response.output_audio_transcript.done",
        "response.content_part.done", "response.output_item.done", "conversation.item.done", "response.done"]
    audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    assert audio == tone(1200, 5) + tone(700, 5)
    done = events[-1]["response"]
    assert done["output_modalities"] == ["audio"] and done["status"] == "completed"
    assert done["output"][0]["content"] == [{"type": "output_audio", "transcript": "Hello there. How are you? "}]
    assert done["usage"]["output_token_details"] == {"text_tokens": 4, "audio_tokens": 1900 // 50}
    assert CancelSpeech(rid) in session.commands()


def test_speech_during_an_answer_cancels_it_and_truncate_keeps_what_was_heard() -> None:
    session = audio_session()
    _, commands = speak_turn(session)
    transcribe, _ = commands
    rid = story_started(session, transcribe)
    session.speech_ready(rid, 0, tone(1000, 5))
    session.speech_ready(rid, 1, tone(1000, 5))
    item_id = next(e for e in drain(session) if e["type"] == "response.output_item.added")["item"]["id"]

    events = append(session, tone(300, LOUD))  # the user talks over the answer
    assert types(events)[:2] == ["input_audio_buffer.speech_started", "response.output_audio.done"]
    done = events[-1]
    assert done["type"] == "response.done" and done["response"]["status_details"]["reason"] == "turn_detected"
    assert done["response"]["output"][0]["content"][0]["transcript"] == "Once upon a time. There was a fox. "
    commands = session.commands()
    assert AbortGeneration(rid) in commands and CancelSpeech(rid) in commands

    # The client played 1.5 s: the first phrase and half the second.
    session.receive({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                     "audio_end_ms": 1500})
    (truncated,) = drain(session)
    assert truncated == {"type": "conversation.item.truncated", "event_id": truncated["event_id"],
                         "item_id": item_id, "content_index": 0, "audio_end_ms": 1500}
    session.receive({"type": "conversation.item.retrieve", "item_id": item_id})
    (retrieved,) = drain(session)
    # whole words, the phrase's speech taken as even over its characters: 8 of 17 heard, "There" whole
    assert retrieved["item"]["content"][0]["transcript"] == "Once upon a time. There"
    session.receive({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                     "audio_end_ms": 1600})
    (error,) = drain(session)
    assert error["error"]["code"] == "invalid_value" and error["error"]["param"] == "audio_end_ms"


def test_push_to_talk_commits_on_the_clients_word() -> None:
    session = make()
    session.receive({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    drain(session)
    assert append(session, tone(600, LOUD)) == []  # no detection: no events
    session.receive({"type": "input_audio_buffer.commit", "event_id": "c1"})
    events = drain(session)
    assert types(events) == ["input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
    (transcribe,) = session.commands()
    assert isinstance(transcribe, Transcribe) and len(transcribe.audio) == 600 * PCM_BYTES_PER_MS
    session.receive({"type": "response.create"})  # before the transcript: created now, started with it
    assert types(drain(session)) == ["response.created"] and session.commands() == []
    session.transcribed(transcribe.item_id, "Hi.", 0.6)
    drain(session)
    (start,) = session.commands()
    assert isinstance(start, StartGeneration) and start.messages[-1]["content"] == "Hi."

    append(session, tone(50, LOUD))
    session.receive({"type": "input_audio_buffer.commit", "event_id": "c2"})
    (error,) = drain(session)
    assert error["error"]["code"] == "input_audio_buffer_commit_empty"
    session.receive({"type": "input_audio_buffer.clear"})
    assert types(drain(session)) == ["input_audio_buffer.cleared"]


def test_a_held_response_cancelled_before_its_transcript_starts_nothing() -> None:
    session = make()
    session.receive({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    drain(session)
    append(session, tone(300, LOUD))
    session.receive({"type": "input_audio_buffer.commit"})
    session.receive({"type": "response.create"})
    drain(session)
    (transcribe,) = session.commands()
    session.receive({"type": "response.cancel"})
    assert types(drain(session))[-1] == "response.done"
    assert session.commands() == []  # never started: nothing to abort
    session.transcription_failed(transcribe.item_id, "the recognizer failed")
    (failed,) = drain(session)
    assert failed["type"] == "conversation.item.input_audio_transcription.failed"
    assert session.commands() == []


def test_hostile_audio_is_refused_and_the_session_lives() -> None:
    limits = SessionLimits(max_audio_buffer_ms=1000, max_audio_bytes_per_s=96_000, audio_burst_bytes=1500 * PCM_BYTES_PER_MS)
    session = make(limits=limits)
    session.receive({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    drain(session)
    append(session, tone(900, QUIET))
    (full,) = append(session, tone(200, QUIET))
    assert full["error"]["code"] == "input_audio_buffer_full"
    session.receive({"type": "input_audio_buffer.clear"})
    drain(session)
    (fast,) = append(session, tone(700, QUIET))  # 900 + 700 ms at once: past the 1.5 s burst
    assert fast["error"]["code"] == "audio_rate_exceeded"
    session.receive({"type": "input_audio_buffer.append", "audio": "AA=="})
    (odd,) = drain(session)
    assert (odd["error"]["code"], odd["error"]["param"]) == ("invalid_audio", "audio")  # not audio/pcm: odd bytes

    text_only = make(voice=False)
    (refused,) = append(text_only, tone(100, LOUD))
    assert refused["error"]["code"] == "unsupported_feature"
    text_only.receive({"type": "session.update", "session": {"output_modalities": ["audio"]}})
    (refused,) = drain(text_only)
    assert refused["error"]["param"] == "session.output_modalities"


def test_a_call_after_spoken_text_waits_for_the_speech() -> None:
    tool = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
    session = audio_session(tools=[tool])
    session.receive({"type": "response.create"})
    (start,) = session.commands()
    rid = start.response_id
    drain(session)
    session.engine_event(rid, TokenEvent(token_id=1, text="Let me check. ", logprob=0.0))
    session.engine_event(rid, TokenEvent(token_id=2, text='<tool_call>[{"name": "get_time", "arguments": {}}]'
                                         '</tool_call>', logprob=0.0))
    session.engine_event(rid, FinishEvent(reason="stop", prompt_tokens=9, completion_tokens=20))
    assert drain(session) == []  # the call waits for the speech before it
    (synth,) = [c for c in session.commands() if isinstance(c, Synthesize)]
    session.speech_ready(rid, synth.index, tone(500, 5))
    events = types(drain(session))
    assert events.index("response.output_audio.done") < events.index("response.function_call_arguments.done")
    assert events[-1] == "response.done"


def test_transcription_starts_at_a_pause_and_its_transcript_serves_the_turn() -> None:
    session = make(hooks=EAGER)
    assert types(append(session, tone(200, QUIET) + tone(600, LOUD))) == ["input_audio_buffer.speech_started"]
    assert append(session, tone(300, QUIET)) == []  # 160 ms into the silence: a pause, not yet the end
    (eager,) = session.commands()
    assert isinstance(eager, Transcribe) and eager.tag == 800 and not eager.judge_end  # server VAD: no words judged
    assert len(eager.audio) == 800 * PCM_BYTES_PER_MS  # the speech so far, without the silence
    session.transcribed(eager.item_id, "Lights on.", 0.8, eager.tag)  # ready before the turn ends
    assert drain(session) == []
    (ahead,) = session.commands()  # the answer the turn gets if it ends here, started now
    assert isinstance(ahead, Foresee) and ahead.request.messages[-1]["content"] == "Lights on."
    assert ahead.voice is None  # a written answer: nothing to speak ahead
    events = append(session, tone(300, QUIET))
    assert types(events) == ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
                             "conversation.item.added", "conversation.item.done",
                             "conversation.item.input_audio_transcription.delta",  # only now: the cut is known
                             "conversation.item.input_audio_transcription.completed"]
    (admit,) = session.commands()  # no second transcription
    assert isinstance(admit, AdmitResponse)
    session.response_admitted(True)
    assert types(drain(session)) == ["response.created"]
    (start,) = session.commands()  # the transcript is in: the response starts at once, on the answer started ahead
    assert isinstance(start, StartGeneration) and start.messages[-1]["content"] == "Lights on."
    assert start.foreseen and start.messages == ahead.request.messages and start.params == ahead.request.params
    assert start.response_id == ahead.request.response_id  # the response has the id the answer was started under


def test_an_answer_started_at_a_pause_is_dropped_when_the_user_goes_on() -> None:
    session = make(hooks=EAGER)
    append(session, tone(200, QUIET) + tone(600, LOUD) + tone(300, QUIET))
    (eager,) = session.commands()
    session.transcribed(eager.item_id, "Turn on the", 0.8, eager.tag)
    (ahead,) = session.commands()
    assert isinstance(ahead, Foresee)
    append(session, tone(400, LOUD))  # the user goes on: the turn did not end at that pause
    assert [type(c) for c in session.commands()] == [DropForesight]
    append(session, tone(200, QUIET))
    (second,) = session.commands()
    session.transcribed(second.item_id, "Turn on the lights.", 1.4, second.tag)
    (again,) = session.commands()
    assert isinstance(again, Foresee) and again.request.response_id != ahead.request.response_id
    assert again.request.messages[-1]["content"] == "Turn on the lights."
    append(session, tone(400, QUIET))
    session.commands()
    session.response_admitted(True)
    (start,) = session.commands()
    assert start.foreseen and start.response_id == again.request.response_id
    assert start.messages[-1]["content"] == "Turn on the lights."


def test_an_answer_started_ahead_is_not_taken_over_by_another_conversation() -> None:
    session = make(hooks=EAGER)
    append(session, tone(200, QUIET) + tone(600, LOUD) + tone(300, QUIET))
    (eager,) = session.commands()
    session.transcribed(eager.item_id, "Lights on.", 0.8, eager.tag)
    (ahead,) = session.commands()
    session.receive({"type": "session.update", "session": {"instructions": "Answer in French."}})
    append(session, tone(300, QUIET))
    session.commands()
    session.response_admitted(True)
    (start,) = session.commands()  # the prompt changed since the pause: the answer ahead is not this one
    assert isinstance(start, StartGeneration) and not start.foreseen and start.response_id != ahead.request.response_id
    assert start.messages[0]["content"] != ahead.request.messages[0]["content"]


def test_an_answer_started_ahead_is_dropped_with_the_buffer_or_a_refused_turn() -> None:
    session = make(hooks=EAGER)

    def pause() -> Foresee:
        append(session, tone(600, LOUD) + tone(300, QUIET))
        (eager,) = session.commands()
        session.transcribed(eager.item_id, "Lights on.", 0.8, eager.tag)
        (ahead,) = session.commands()
        assert isinstance(ahead, Foresee)
        return ahead

    pause()
    append(session, tone(300, QUIET))
    (admit,) = session.commands()
    assert isinstance(admit, AdmitResponse)
    session.response_admitted(False)  # the key's limits refused the turn: nothing will take it over
    assert [type(c) for c in session.commands()] == [DropForesight]
    pause()
    session.receive({"type": "input_audio_buffer.clear"})
    assert [type(c) for c in session.commands()] == [DropForesight]
    # Words that are only silence start nothing ahead; nor does a server configured not to.
    for hooks, words in ((EAGER, "  "), (replace(EAGER, answer_ahead=False), "Lights on.")):
        session = make(hooks=hooks)
        append(session, tone(600, LOUD) + tone(300, QUIET))
        (eager,) = session.commands()
        session.transcribed(eager.item_id, words, 0.8, eager.tag)
        assert session.commands() == []


def test_speech_that_resumes_after_a_pause_is_transcribed_again() -> None:
    session = make(hooks=EAGER)
    append(session, tone(200, QUIET) + tone(400, LOUD) + tone(200, QUIET))
    (first,) = session.commands()
    append(session, tone(400, LOUD))  # the user goes on
    append(session, tone(200, QUIET))
    (second,) = session.commands()
    assert second.item_id == first.item_id and second.tag > first.tag
    session.transcribed(first.item_id, "Turn on", 0.4, first.tag)  # late, for the shorter cut: dropped
    assert drain(session) == []  # and no delta of it ever reaches the client
    events = append(session, tone(400, QUIET))
    assert types(events)[-1] == "conversation.item.done"
    assert [type(c) for c in session.commands()] == [AdmitResponse]
    session.response_admitted(True)
    assert types(drain(session)) == ["response.created"] and session.commands() == []  # waits for the second
    session.transcribed(second.item_id, "Turn on the lights.", 1.0, second.tag)
    delta, completed = drain(session)
    assert delta["delta"] == completed["transcript"] == "Turn on the lights."
    (start,) = session.commands()
    assert isinstance(start, StartGeneration) and start.messages[-1]["content"] == "Turn on the lights."


def semantic_session() -> RealtimeSession:
    session = make(hooks=SEMANTIC)
    session.receive({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "semantic_vad"}}}}})
    assert types(drain(session)) == ["session.updated"]
    return session


def test_semantic_vad_ends_a_proposed_turn_where_proposed_once_its_words_are_finished() -> None:
    session = semantic_session()
    append(session, tone(200, QUIET) + tone(600, LOUD))
    assert append(session, tone(400, QUIET)) == []  # proposed 160 ms into the silence: the words decide
    (eager,) = session.commands()
    assert isinstance(eager, Transcribe) and eager.tag == 800 and eager.judge_end
    session.transcribed(eager.item_id, "Lights on.", 0.8, eager.tag, True)
    events = drain(session)
    assert types(events)[:2] == ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed"]
    assert events[0]["audio_end_ms"] == 960  # where the turn model judged it over, not where the words came
    assert "conversation.item.input_audio_transcription.completed" in types(events)
    (admit,) = session.commands()  # the transcript at the pause is the turn's: no second job
    assert isinstance(admit, AdmitResponse)


def test_semantic_vad_holds_a_proposed_end_while_the_words_are_unfinished() -> None:
    session = semantic_session()
    append(session, tone(200, QUIET) + tone(600, LOUD) + tone(300, QUIET))
    (first,) = session.commands()
    session.transcribed(first.item_id, "I'd like to book a table for", 0.8, first.tag, False)
    assert drain(session) == [] and session.commands() == []  # held: the user may go on
    append(session, tone(500, LOUD))  # and does, 300 ms later
    assert append(session, tone(300, QUIET)) == []
    (second,) = session.commands()
    assert second.item_id == first.item_id and second.tag == 1600
    session.transcribed(second.item_id, "I'd like to book a table for four.", 1.6, second.tag, True)
    events = drain(session)
    assert types(events).count("input_audio_buffer.speech_stopped") == 1
    (completed,) = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert completed["transcript"] == "I'd like to book a table for four."


def test_semantic_vad_unfinished_words_end_at_the_eagerness_bound() -> None:
    session = semantic_session()
    append(session, tone(200, QUIET) + tone(600, LOUD) + tone(300, QUIET))
    (first,) = session.commands()
    session.transcribed(first.item_id, "Set an alarm for", 0.8, first.tag, False)
    events = append(session, tone(400, QUIET))  # silence reaches "auto"'s 600 ms: the turn ends anyway
    assert types(events)[0] == "input_audio_buffer.speech_stopped" and events[0]["audio_end_ms"] == 1400
    assert "conversation.item.input_audio_transcription.completed" in types(events)


def test_semantic_vad_ends_on_the_audio_when_the_words_cannot_be_had() -> None:
    session = semantic_session()
    append(session, tone(200, QUIET) + tone(600, LOUD) + tone(300, QUIET))
    (first,) = session.commands()
    session.transcription_failed(first.item_id, "busy", first.tag, "voice_busy")
    events = drain(session)
    assert types(events)[:2] == ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed"]
    transcribe, admit = session.commands()  # the turn's own job, the pause's having failed
    assert isinstance(transcribe, Transcribe) and not transcribe.at_pause and isinstance(admit, AdmitResponse)


def test_a_turn_server_vad_ends_is_answered_only_once_the_key_is_charged() -> None:
    """Every generation passes the key's admission (issue 39, item 1): server VAD asks for one
    with ``AdmitResponse``; refused, the turn's item stays and no response starts; one request
    at a time, however many turns end while it waits."""
    session = make()
    events, commands = speak_turn(session)
    assert "response.created" not in types(events)
    assert isinstance(commands[-1], AdmitResponse)
    events, more = speak_turn(session)  # a second turn ends while the first waits for admission
    assert "response.created" not in types(events) and not any(isinstance(c, AdmitResponse) for c in more)
    session.response_admitted(False)  # refused: the adapter told the client why
    assert drain(session) == [] and session.active_response_id is None and session.commands() == []
    events, commands = speak_turn(session)
    assert [c for c in commands if isinstance(c, AdmitResponse)]
    session.response_admitted(True)
    assert types(drain(session)) == ["response.created"]


def test_speech_that_finds_the_conversation_full_is_refused_and_the_next_speech_still_counts() -> None:
    """A commit refused for room (an error event) leaves the rest of that audio chunk's speech
    events intact (issue 39, item 9)."""
    session = make(limits=SessionLimits(max_conversation_items=1))
    session.receive({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}})
    drain(session)
    events = append(session, tone(200, QUIET) + tone(600, LOUD) + tone(600, QUIET) + tone(300, LOUD))
    kinds = types(events)
    assert kinds == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "error",
                     "input_audio_buffer.speech_started"], kinds
    assert events[2]["error"]["code"] == "conversation_limit_exceeded"
    assert session.commands() == []  # nothing transcribed, nothing answered


def test_a_failed_transcription_report_never_raises_at_the_adapter() -> None:
    session = make()
    _, commands = speak_turn(session)
    transcribe, _ = commands
    session._voice_in._transcribing[transcribe.item_id] = ("not an item", 0)  # type: ignore[assignment]  # a bug
    session.transcription_failed(transcribe.item_id, "boom")  # must not raise
    assert types(drain(session)) == ["error"]


def test_deleting_an_item_cancels_its_transcription() -> None:
    """A deleted item's recognition job is dropped (queued, it never runs) (issue 39, item 2)."""
    session = make()
    session.receive({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    drain(session)
    append(session, tone(600, LOUD))
    session.receive({"type": "input_audio_buffer.commit"})
    item_id = next(e for e in drain(session) if e["type"] == "input_audio_buffer.committed")["item_id"]
    (transcribe,) = session.commands()
    assert isinstance(transcribe, Transcribe)
    session.receive({"type": "conversation.item.delete", "item_id": item_id})
    assert types(drain(session)) == ["conversation.item.deleted"]
    assert session.commands() == [CancelTranscription(item_id)]
    session.transcribed(item_id, "too late", 0.6)  # the job had already run: its transcript is dropped
    assert drain(session) == []


def test_idle_timeout_commits_the_silence_and_answers_it() -> None:
    """Counted in audio: from the buffer's start, then from where the last answer stopped playing."""
    session = make(limits=SessionLimits(audio_burst_bytes=10**8))
    session.receive({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "idle_timeout_ms": 5000}}}}})
    (updated,) = drain(session)
    assert updated["session"]["audio"]["input"]["turn_detection"]["idle_timeout_ms"] == 5000
    assert append(session, tone(4990, QUIET)) == []
    events = append(session, tone(10, QUIET))
    assert types(events) == ["input_audio_buffer.timeout_triggered", "input_audio_buffer.committed",
                             "conversation.item.added", "conversation.item.done"]
    assert (events[0]["audio_start_ms"], events[0]["audio_end_ms"]) == (0, 5000)
    item_id = events[0]["item_id"]
    assert events[1]["item_id"] == item_id
    transcribe, admit = session.commands()
    assert isinstance(transcribe, Transcribe) and admit == AdmitResponse(item_id)
    assert len(transcribe.audio) == 310 * PCM_BYTES_PER_MS  # what the buffer kept: the padding and the chunk
    session.response_admitted(True)
    session.transcribed(item_id, "", 0.3)
    drain(session)
    (start,) = session.commands()
    assert append(session, tone(3000, QUIET)) + append(session, tone(3000, QUIET)) == []  # still answering: no count
    session.engine_event(start.response_id, TokenEvent(token_id=1, text="Still there?", logprob=0.0))
    session.engine_event(start.response_id, FinishEvent(reason="stop", prompt_tokens=9, completion_tokens=3))
    assert types(drain(session))[-1] == "response.done"
    spoken = append(session, tone(3000, LOUD) + tone(600, QUIET))  # the user speaks: their turn, no timeout
    assert "input_audio_buffer.timeout_triggered" not in types(spoken)
    session.commands()
    session.response_admitted(False)  # (the key refused the answer: nothing is answering)
    assert append(session, tone(4000, QUIET)) == []
    assert types(append(session, tone(1000, QUIET)))[0] == "input_audio_buffer.timeout_triggered"


def test_transcription_deltas_stream_as_the_recognizer_decodes_them() -> None:
    """Each piece the recognizer decodes is a delta at once (the first without its leading blank),
    before ``.completed``; the deltas join to the transcript exactly."""
    session = make()
    session.receive({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    drain(session)
    append(session, tone(800, LOUD))
    session.receive({"type": "input_audio_buffer.commit"})
    drain(session)
    (transcribe,) = session.commands()
    session.transcription_piece(transcribe.item_id, transcribe.tag, " Turn on")
    (first,) = drain(session)
    assert first["type"] == "conversation.item.input_audio_transcription.delta" and first["delta"] == "Turn on"
    session.transcription_piece(transcribe.item_id, transcribe.tag, " the lights.")
    assert [e["delta"] for e in drain(session)] == [" the lights."]
    session.transcribed(transcribe.item_id, "Turn on the lights.", 0.8, transcribe.tag)
    (completed,) = drain(session)  # nothing left to say as a delta
    assert completed["type"] == "conversation.item.input_audio_transcription.completed"
    assert completed["transcript"] == first["delta"] + " the lights."
    session.transcription_piece(transcribe.item_id, transcribe.tag, " late")  # after completed: dropped
    assert drain(session) == []


def test_pieces_of_a_job_started_at_a_pause_wait_for_the_turn_to_end_there() -> None:
    session = make(hooks=EAGER)
    append(session, tone(200, QUIET) + tone(600, LOUD) + tone(300, QUIET))  # a pause: transcription starts
    (eager,) = session.commands()
    session.transcription_piece(eager.item_id, eager.tag, " Lights")
    assert drain(session) == []  # the user may go on: not the item's yet
    events = append(session, tone(300, QUIET))  # the turn ends at that pause
    deltas = [e["delta"] for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"]
    assert deltas == ["Lights"]
    session.transcription_piece(eager.item_id, eager.tag, " on.")
    assert [e["delta"] for e in drain(session)] == [" on."]
    session.transcribed(eager.item_id, "Lights on.", 0.8, eager.tag)
    assert types(drain(session)) == ["conversation.item.input_audio_transcription.completed"]

    resumed = make(hooks=EAGER)
    append(resumed, tone(200, QUIET) + tone(400, LOUD) + tone(200, QUIET))
    (first,) = resumed.commands()
    resumed.transcription_piece(first.item_id, first.tag, " Turn on")
    append(resumed, tone(400, LOUD) + tone(200, QUIET))  # the user went on: a new job for a later cut
    (second,) = resumed.commands()
    events = append(resumed, tone(400, QUIET))
    assert "conversation.item.input_audio_transcription.delta" not in types(events)  # the first job's piece: never
    resumed.transcription_piece(second.item_id, second.tag, " Turn on the lights.")
    assert [e["delta"] for e in drain(resumed)] == ["Turn on the lights."]
