"""Whole recordings in one ``input_audio_buffer.append`` (issue 41): a push-to-talk app or a file
upload sends 5 s, 60 s, up to 15 MiB of base64 at once, through the official openai SDK, to a
gateway with the real voice pipeline. Recordings that fit the input buffer are answered as
speech; one that does not is refused with an error event, and the session goes on."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fake_engine import FakeEngine
from gateway_harness import MODEL
from voice_serving import QUESTION, serve, spoken, voice_pipeline, words

from gateway.ws.voice_service import GatewayVoice
from voice.audio import REALTIME_RATE, encode_pcm16

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def voice() -> Iterator[GatewayVoice]:
    yield from voice_pipeline()


def recording(seconds: float) -> bytes:
    """The question said again and again, with pauses, as PCM16 at 24 kHz: ``seconds`` long."""
    once = spoken(before_ms=300, after_ms=700)
    reps = int(np.ceil(seconds * REALTIME_RATE / len(once)))
    return encode_pcm16(np.tile(once, reps)[:int(seconds * REALTIME_RATE)])


async def turn(conn: Any) -> tuple[str, str]:
    """Commit, respond, and read until the response is done: (the transcript, the answer). The
    transcript's deltas come before it, as Whisper decodes its segments, and join to it."""
    await conn.input_audio_buffer.commit()
    await conn.response.create()
    transcript, answer, deltas = "", "", []
    async for event in conn:
        if event.type == "conversation.item.input_audio_transcription.delta":
            assert not transcript
            deltas.append(event.delta)
        elif event.type == "conversation.item.input_audio_transcription.completed":
            transcript = event.transcript
            assert "".join(deltas) == transcript and (len(deltas) > 1 or len(transcript) < 200), deltas
        elif event.type == "error":
            raise AssertionError(event.error)
        elif event.type == "response.done":
            assert event.response.status == "completed", event.response
            answer = event.response.output[0].content[0].text
            return transcript, answer
    raise AssertionError("the connection ended")


async def test_recordings_in_one_append_each_through_the_official_sdk(voice: GatewayVoice) -> None:
    from openai import AsyncOpenAI

    engine = FakeEngine(reply=lambda prompt, params: ["Done."])
    async for served in serve(voice, engine):
        client = AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        async with client, client.realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            for seconds in (5, 60):
                audio = recording(seconds)
                encoded = base64.b64encode(audio).decode()
                assert len(encoded) > 256 * 1024  # more than any other event may carry
                await conn.input_audio_buffer.append(audio=encoded)
                transcript, answer = await turn(conn)
                said = words(transcript)
                expected = seconds * REALTIME_RATE * 2 // len(encode_pcm16(spoken(before_ms=300, after_ms=700)))
                assert said.count("kitchen") >= max(1, expected - 1), (seconds, transcript)
                assert answer == "Done."

            # 15 MiB of base64: 245 s of audio, past the input buffer's 120 s. Refused; the session goes on.
            await conn.input_audio_buffer.append(audio="A" * (15 * 2**20))
            async for event in conn:
                if event.type == "error":
                    assert event.error.code == "input_audio_buffer_full", event.error
                    break
                assert event.type == "rate_limits.updated", event.type  # (the last turn's)
            await conn.input_audio_buffer.append(audio=base64.b64encode(recording(5)).decode())
            transcript, answer = await turn(conn)
            assert words(QUESTION)[:3] == words(transcript)[:3] and answer == "Done."


async def test_a_recording_in_one_msgpack_append_is_heard(voice: GatewayVoice) -> None:
    """On the msgpack subprotocol an append carries raw bytes: 6 s of PCM16 (288 kB, over the
    256 KiB every other event is held to) in one binary frame, committed and answered."""
    import msgpack
    import websockets

    engine = FakeEngine(reply=lambda prompt, params: ["Done."])
    async for served in serve(voice, engine):
        url = f"{served.url.replace('http', 'ws')}/v1/realtime?model={MODEL}"
        async with websockets.connect(url, subprotocols=["x-openai-realtime-msgpack"]) as ws:

            async def until(kind: str) -> dict[str, Any]:
                while True:
                    event = msgpack.unpackb(await ws.recv())
                    assert event["type"] != "error", event
                    if event["type"] == kind:
                        return event

            await until("session.created")
            await ws.send(msgpack.packb({"type": "session.update",
                                         "session": {"audio": {"input": {"turn_detection": None}}}}))
            await until("session.updated")
            audio = recording(6)
            assert len(audio) > 256 * 1024
            await ws.send(msgpack.packb({"type": "input_audio_buffer.append", "audio": audio}))
            await ws.send(msgpack.packb({"type": "input_audio_buffer.commit"}))
            await ws.send(msgpack.packb({"type": "response.create"}))
            completed = await until("conversation.item.input_audio_transcription.completed")
            assert words(completed["transcript"]).count("kitchen") >= 1
            done = await until("response.done")
            assert done["response"]["status"] == "completed"
