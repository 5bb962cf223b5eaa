"""Voice end to end: a served gateway with the real voice pipeline (Silero VAD, Whisper tiny.en,
flite), speech made by flite and streamed as a client would, through the official openai SDK's
Realtime client and through websockets with msgpack. The language model is the fake engine
(a fixed answer): what is under test is the speech around it."""

from __future__ import annotations

import asyncio
import base64
import difflib
import json
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack
import numpy as np
import pytest
import websockets
from fake_engine import FakeEngine
from gateway_harness import MODEL, recv_json, send
from voice_serving import CHUNK_MS, QUESTION, chunks, serve, spoken, voice_pipeline, words
from voice_serving import question_pcm as make_question_pcm

from gateway.ws.voice_service import GatewayVoice
from llm_shared.contract import SamplingParams
from voice.audio import encode_pcm16
from voice.config import VoiceConfig
from voice.formats import PCMU

pytestmark = pytest.mark.timeout(300)

TELEPHONY_QUESTION = "What is the capital of France?"
ANSWER = ["The ", "kitchen ", "lights ", "are ", "on ", "now. ", "Is ", "there ", "anything ", "else ", "you ",
          "would ", "like? "]


@pytest.fixture(scope="module")
def voice() -> Iterator[GatewayVoice]:
    yield from voice_pipeline()


@pytest.fixture(scope="module")
def question_pcm() -> bytes:
    """The question as a client's microphone would send it: 24 kHz PCM16, with silence around."""
    return make_question_pcm()


def answer(prompt_ids: Sequence[int], params: SamplingParams) -> list[str]:
    return list(ANSWER)


async def test_a_spoken_question_is_answered_in_speech_through_the_official_sdk(voice: GatewayVoice,
                                                                                 question_pcm: bytes) -> None:
    from openai import AsyncOpenAI

    engine = FakeEngine(reply=answer)
    async for served in serve(voice, engine):
        client = AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        async with client, client.realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                               "audio": {"output": {"voice": "marin"}}})
            for chunk in chunks(question_pcm):
                await conn.input_audio_buffer.append(audio=base64.b64encode(chunk).decode())
            seen: list[str] = []
            transcript, spoken, audio = "", "", bytearray()
            async for event in conn:
                seen.append(event.type)
                if event.type == "conversation.item.input_audio_transcription.completed":
                    transcript = event.transcript
                elif event.type == "response.output_audio_transcript.delta":
                    spoken += event.delta
                elif event.type == "response.output_audio.delta":
                    audio += base64.b64decode(event.delta)
                elif event.type == "error":
                    raise AssertionError(event.error)
                elif event.type == "response.done":
                    done = event.response
                    break
    assert seen.index("input_audio_buffer.speech_started") < seen.index("input_audio_buffer.speech_stopped") \
        < seen.index("input_audio_buffer.committed") < seen.index("response.created")
    assert words(transcript) == words(QUESTION)
    assert done.status == "completed" and spoken == "".join(ANSWER).rstrip()  # (trailing space: nothing to say)
    assert done.output[0].content[0].transcript == spoken
    # one audio token per 50 ms of speech (each phrase's ms rounded down, then the sum up)
    assert abs(done.usage.output_token_details.audio_tokens - len(audio) / 48 / 50) < 2
    heard = (await voice.transcribe(bytes(audio))).text  # the answer's audio says the answer
    assert words(heard) == words(spoken)


async def test_a_telephony_session_is_heard_and_answered_in_mu_law(voice: GatewayVoice) -> None:
    """G.711 mu-law at 8 kHz both ways (a phone line's audio): Whisper hears the question through
    the 8 -> 24 kHz conversion, and the answer's deltas are mu-law whose bytes are its ms x 8. (The
    question ends on a vowel: a phone line's band stops at 4 kHz, where a final "s" is faint
    enough for VAD to end the turn before it.)"""
    engine = FakeEngine(reply=answer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop  # the reference coder (this Python still has it)
    question = audioop.lin2ulaw(encode_pcm16(spoken(TELEPHONY_QUESTION, rate=8000)), 2)
    async for served in serve(voice, engine):
        async with websockets.connect(f"{served.url.replace('http', 'ws')}/v1/realtime") as ws:
            await next_event(ws, {"session.created"})
            await send(ws, {"type": "session.update", "session": {"output_modalities": ["audio"], "audio": {
                "input": {"format": {"type": "audio/pcmu"}}, "output": {"format": {"type": "audio/pcmu"}}}}})
            updated = await next_event(ws, {"session.updated"})
            assert updated["session"]["audio"]["output"]["format"] == {"type": "audio/pcmu"}
            for start in range(0, len(question), 8 * CHUNK_MS):
                await send(ws, {"type": "input_audio_buffer.append",
                                "audio": base64.b64encode(question[start:start + 8 * CHUNK_MS]).decode()})
            completed = await next_event(ws, {"conversation.item.input_audio_transcription.completed"})
            assert words(completed["transcript"]) == words(TELEPHONY_QUESTION)
            audio = bytearray()
            event = await next_event(ws, {"response.output_audio.delta"})
            while event["type"] != "response.done":
                if event["type"] == "response.output_audio.delta":
                    audio += base64.b64decode(event["delta"])
                event = await next_event(ws, {"response.output_audio.delta", "response.done"})
    done = event["response"]
    assert done["status"] == "completed"
    assert abs(done["usage"]["output_token_details"]["audio_tokens"] - len(audio) / 8 / 50) < 2  # 8 bytes a ms
    # mu-law that says the answer: Whisper tiny on G.711's quantization noise may add or change a
    # word (soxr's converter instead of ours does the same), so one word of slack
    heard = (await voice.transcribe(PCMU.to_session(bytes(audio)))).text
    assert difflib.SequenceMatcher(None, words(heard), words("".join(ANSWER))).ratio() > 0.9, heard


def decode(data: str | bytes) -> dict[str, Any]:
    event = msgpack.unpackb(data) if isinstance(data, bytes) else json.loads(data)
    if event["type"] == "error":
        raise AssertionError(event["error"])
    return event


async def next_event(ws: websockets.ClientConnection, kinds: set[str], timeout: float = 60.0) -> dict[str, Any]:
    while True:
        event = decode(await asyncio.wait_for(ws.recv(), timeout))
        if event["type"] in kinds:
            return event


async def test_talking_over_the_answer_cancels_it_and_truncate_keeps_what_was_heard(
        voice: GatewayVoice, question_pcm: bytes) -> None:
    engine = FakeEngine(reply=lambda p, s: ANSWER * 6, tokens_per_second=8)  # still answering when interrupted
    async for served in serve(voice, engine):
        async with websockets.connect(f"{served.url.replace('http', 'ws')}/v1/realtime",
                                      subprotocols=["x-openai-realtime-msgpack"]) as ws:  # audio as raw bytes
            await next_event(ws, {"session.created"})
            await ws.send(msgpack.packb({"type": "session.update", "session": {"output_modalities": ["audio"]}}))
            for chunk in chunks(question_pcm):
                await ws.send(msgpack.packb({"type": "input_audio_buffer.append", "audio": chunk}))
            phrases: list[list[Any]] = []  # [text, ms of its audio], as the answer arrives
            event = await next_event(ws, {"response.output_audio_transcript.delta"})
            rid, item_id = event["response_id"], event["item_id"]
            talking = False
            while event["type"] != "response.done":
                if event["type"] == "response.output_audio_transcript.delta":
                    phrases.append([event["delta"], 0])
                elif event["type"] == "response.output_audio.delta":
                    assert isinstance(event["delta"], bytes)  # msgpack: raw PCM, not base64
                    phrases[-1][1] += len(event["delta"]) // 48
                    if not talking:  # the user speaks again while the answer plays
                        talking = True
                        for chunk in chunks(question_pcm):
                            await ws.send(msgpack.packb({"type": "input_audio_buffer.append", "audio": chunk}))
                event = decode(await asyncio.wait_for(ws.recv(), 60))
            assert event["response"]["id"] == rid and event["response"]["status"] == "cancelled"
            assert event["response"]["status_details"]["reason"] == "turn_detected"
            said = event["response"]["output"][0]["content"][0]["transcript"]
            assert said == "".join(text for text, _ in phrases) and said in "".join(ANSWER * 6)
            assert rid in engine.aborts  # the engine was told at once

            # The client played the first phrase, and 400 ms into the next (if there is one).
            first_text, first_ms = phrases[0]
            await ws.send(msgpack.packb({"type": "conversation.item.truncate", "item_id": item_id,
                                         "content_index": 0, "audio_end_ms": first_ms}))
            assert (await next_event(ws, {"conversation.item.truncated"}))["audio_end_ms"] == first_ms
            await ws.send(msgpack.packb({"type": "conversation.item.retrieve", "item_id": item_id}))
            item = (await next_event(ws, {"conversation.item.retrieved"}))["item"]
            assert item["content"][0]["transcript"] == first_text
            await ws.send(msgpack.packb({"type": "conversation.item.truncate", "item_id": item_id,
                                         "content_index": 0, "audio_end_ms": first_ms // 2}))
            await next_event(ws, {"conversation.item.truncated"})
            await ws.send(msgpack.packb({"type": "conversation.item.retrieve", "item_id": item_id}))
            half = (await next_event(ws, {"conversation.item.retrieved"}))["item"]["content"][0]["transcript"]
            assert first_text.startswith(half) and len(half) < len(first_text)
            assert half == "" or first_text[len(half)] == " "  # whole words only


async def test_push_to_talk_and_hostile_audio(voice: GatewayVoice, question_pcm: bytes) -> None:
    engine = FakeEngine(reply=answer)
    async for served in serve(voice, engine):
        async with websockets.connect(f"{served.url.replace('http', 'ws')}/v1/realtime") as ws:
            await recv_json(ws)
            await send(ws, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
            await next_event(ws, {"session.updated"})
            await send(ws, {"type": "input_audio_buffer.append", "audio": "AA=="})  # one byte: not PCM16
            with pytest.raises(AssertionError, match="invalid_audio"):
                await next_event(ws, {"never"})
            await send(ws, {"type": "input_audio_buffer.append", "audio": "not base64!"})
            with pytest.raises(AssertionError, match="invalid_audio"):
                await next_event(ws, {"never"})
            for chunk in chunks(question_pcm, 500):
                await send(ws, {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()})
            await send(ws, {"type": "input_audio_buffer.commit"})
            await send(ws, {"type": "response.create"})
            completed = await next_event(ws, {"conversation.item.input_audio_transcription.completed"})
            assert words(completed["transcript"]) == words(QUESTION)
            done = await next_event(ws, {"response.done"})
            assert done["response"]["status"] == "completed"  # text: the session's default modality
            assert done["response"]["output"][0]["content"][0]["text"] == "".join(ANSWER)


async def test_the_sessions_transcription_prompt_is_read_before_its_speech(voice: GatewayVoice) -> None:
    """``audio.input.transcription.prompt`` steers the recognizer as it does OpenAI's: here the
    style of numbers. Without one the server's is read (``[voice] asr_prompt``, none by default), and
    Whisper writes "10"; with a prompt that spells numbers out, "ten"; "" again, "10"."""
    engine = FakeEngine(reply=answer)
    timer = encode_pcm16(spoken("Set a timer for ten minutes."))
    async for served in serve(voice, engine):
        async with websockets.connect(f"{served.url.replace('http', 'ws')}/v1/realtime") as ws:
            await recv_json(ws)
            heard = []
            for transcription in (None, {"model": "whisper-1", "prompt": "Numbers are written out in words: one, "
                                         "two, ten, twenty."}, {"model": "whisper-1", "prompt": ""}):
                await send(ws, {"type": "session.update", "session": {"audio": {"input": {
                    "turn_detection": None, "transcription": transcription}}}})
                updated = await next_event(ws, {"session.updated"})
                echoed = updated["session"]["audio"]["input"]["transcription"]
                assert (echoed and echoed["prompt"]) == (transcription and transcription["prompt"])
                for chunk in chunks(timer, 500):
                    await send(ws, {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()})
                await send(ws, {"type": "input_audio_buffer.commit"})
                heard.append(words((await next_event(ws, {"conversation.item.input_audio_transcription.completed"}))[
                    "transcript"]))
            assert heard == [["set", "a", "timer", "for", "10", "minutes"], ["set", "a", "timer", "for", "ten", "minutes"],
                             ["set", "a", "timer", "for", "10", "minutes"]]


async def test_a_session_committing_clips_faster_than_its_budget_is_refused_and_others_are_heard(
        question_pcm: bytes) -> None:
    """Issue 39, item 2: a push-to-talk client committing clip after clip gets the recognitions its
    budget allows (here two, the budget refilling once in ~10 minutes), then
    ``transcription.failed`` with ``recognition_rate_limited``; another session's speech is heard
    as ever, and the flooding session goes on."""
    voice = GatewayVoice(VoiceConfig(pool_threads=2, recognition_rate_s=0.02, recognition_burst_s=24.0))
    tone = encode_pcm16((np.sin(np.arange(4800) * 0.1) * 8000).astype(np.int16))  # 200 ms
    try:
        async for served in serve(voice, FakeEngine(reply=answer)):
            url = f"{served.url.replace('http', 'ws')}/v1/realtime"
            async with websockets.connect(url) as flood, websockets.connect(url) as other:
                for ws in (flood, other):
                    await next_event(ws, {"session.created"})
                    await send(ws, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
                    await next_event(ws, {"session.updated"})
                outcomes = []
                for _ in range(3):  # each committed once the previous one is answered: the job bound is not hit
                    await send(flood, {"type": "input_audio_buffer.append",
                                       "audio": base64.b64encode(tone).decode()})
                    await send(flood, {"type": "input_audio_buffer.commit"})
                    outcomes.append(await next_event(flood, {"conversation.item.input_audio_transcription.completed",
                                                             "conversation.item.input_audio_transcription.failed"}))
                assert [o["type"].rsplit(".", 1)[1] for o in outcomes] == ["completed", "completed", "failed"]
                refusal = outcomes[2]["error"]
                assert refusal["code"] == "recognition_rate_limited" and "retry in" in refusal["message"]
                for chunk in chunks(question_pcm, 500):
                    await send(other, {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()})
                await send(other, {"type": "input_audio_buffer.commit"})
                heard = await next_event(other, {"conversation.item.input_audio_transcription.completed"})
                assert words(heard["transcript"]) == words(QUESTION)
                await send(flood, {"type": "conversation.item.create", "item": {
                    "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello?"}]}})
                await send(flood, {"type": "response.create"})
                assert (await next_event(flood, {"response.done"}))["response"]["status"] == "completed"
    finally:
        voice.close()


async def test_speech_is_charged_to_the_keys_audio_seconds(voice: GatewayVoice, question_pcm: bytes) -> None:
    """Issue 39: recognition is charged to the key (``audio_seconds_per_minute``, here 2): the
    first question is heard and leaves the bucket in debt, the second is not transcribed
    (``rate_limit_exceeded``, with when to retry); text goes on."""
    async for served in serve(voice, FakeEngine(reply=answer), audio_seconds_per_minute=2):
        async with websockets.connect(f"{served.url.replace('http', 'ws')}/v1/realtime") as ws:
            await next_event(ws, {"session.created"})
            await send(ws, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
            await next_event(ws, {"session.updated"})
            outcomes = []
            for _ in range(2):
                for chunk in chunks(question_pcm, 500):
                    await send(ws, {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()})
                await send(ws, {"type": "input_audio_buffer.commit"})
                outcomes.append(await next_event(ws, {"conversation.item.input_audio_transcription.completed",
                                                      "conversation.item.input_audio_transcription.failed"}))
            assert words(outcomes[0]["transcript"]) == words(QUESTION)
            refusal = outcomes[1]["error"]
            assert refusal["code"] == "rate_limit_exceeded" and "seconds of audio" in refusal["message"]
            assert "retry in" in refusal["message"]
            await send(ws, {"type": "response.create"})
            done = await next_event(ws, {"response.done"})
            assert done["response"]["status"] == "completed"
            # speaking is charged too: the bucket is in debt, so a spoken answer fails with the limit
            await send(ws, {"type": "response.create", "response": {"output_modalities": ["audio"]}})
            spoken_done = await next_event(ws, {"response.done"})
            assert spoken_done["response"]["status"] == "failed"
            assert spoken_done["response"]["status_details"]["error"]["code"] == "rate_limit_exceeded"


async def test_turns_that_server_vad_ends_are_charged_to_the_key(voice: GatewayVoice, question_pcm: bytes) -> None:
    """Server VAD's turns pass the key's request limit like a client's response.create (issue 39,
    item 1): with one request a minute, the second spoken turn is refused with the limit's error
    and starts no response; the session goes on."""
    engine = FakeEngine(reply=answer)
    async for served in serve(voice, engine, requests_per_minute=1):
        async with websockets.connect(f"{served.url.replace('http', 'ws')}/v1/realtime") as ws:
            await next_event(ws, {"session.created"})
            for chunk in chunks(question_pcm):
                await send(ws, {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()})
            assert (await next_event(ws, {"response.done"}))["response"]["status"] == "completed"
            for chunk in chunks(question_pcm):
                await send(ws, {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()})
            with pytest.raises(AssertionError, match="rate_limit_exceeded"):
                await next_event(ws, {"response.created"})
            await send(ws, {"type": "conversation.item.retrieve", "item_id": "missing"})
            with pytest.raises(AssertionError, match=r"item_not_found|invalid_value"):
                await next_event(ws, {"never"})  # the session still answers
    assert len(engine.started) == 1


def test_a_missing_synthesizer_turns_voice_off_and_leaves_text_served(caplog: pytest.LogCaptureFixture) -> None:
    from dataclasses import replace

    from gateway_harness import make_config

    from gateway.http.state import GatewayState
    from voice.config import VoiceConfig

    config = make_config()
    state = GatewayState.from_config(replace(config, voice=VoiceConfig(tts_library="/nonexistent/libflite.so.1")))
    assert state.load_voice() is None
    assert "voice is off" in caplog.text and "/nonexistent/libflite.so.1" in caplog.text


def test_an_install_without_the_voice_packages_serves_text(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    import builtins

    from gateway_harness import make_config

    from gateway.http.state import GatewayState
    from voice.config import VoiceConfig

    real_import = builtins.__import__

    def without_onnxruntime(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "gateway.ws.voice_service":
            raise ModuleNotFoundError("No module named 'onnxruntime'", name="onnxruntime")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_onnxruntime)
    from dataclasses import replace

    state = GatewayState.from_config(replace(make_config(), voice=VoiceConfig()))
    assert state.load_voice() is None
    assert "voice is off: onnxruntime is not installed" in caplog.text
