"""A telephony session in the sans-I/O Realtime session: G.711 mu-law at 8 kHz in and out. The
session's clock stays 24 kHz inside, so VAD offsets, the transcribed audio, the deltas' byte
lengths and a truncate's ``audio_end_ms`` all count the same ms as at 24 kHz (the scripted VAD,
splitter and fake transcripts are test_session_voice.py's)."""

from __future__ import annotations

import base64
import struct
import warnings
from typing import Any

import numpy as np
from session_helpers import drain
from test_session_voice import LOUD, QUIET, make, story_started, tone, types

from gateway.ws.audio_events import PCM_BYTES_PER_MS
from gateway.ws.commands import Transcribe
from gateway.ws.session import RealtimeSession, SessionLimits
from voice.formats import PCMU

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

CHUNK = 160  # 20 ms of mu-law: a telephony frame


def ulaw(ms: int, level: int) -> bytes:
    return audioop.lin2ulaw(struct.pack("<h", level) * (ms * 8), 2)


def append(session: RealtimeSession, audio: bytes) -> list[dict[str, Any]]:
    """``audio`` as the telephony frames a SIP bridge sends, one append each."""
    events = []
    for start in range(0, len(audio), CHUNK):
        session.receive({"type": "input_audio_buffer.append",
                         "audio": base64.b64encode(audio[start:start + CHUNK]).decode()})
        events += drain(session)
    return events


def pcmu_session(beta: bool = False) -> RealtimeSession:
    session = make(beta=beta)
    update = ({"modalities": ["text", "audio"], "input_audio_format": "g711_ulaw", "output_audio_format": "g711_ulaw"}
              if beta else {"output_modalities": ["audio"], "audio": {"input": {"format": {"type": "audio/pcmu"}},
                                                                      "output": {"format": {"type": "audio/pcmu"}}}})
    session.receive({"type": "session.update", "session": update})
    (updated,) = drain(session)
    if beta:
        assert (updated["session"]["input_audio_format"], updated["session"]["output_audio_format"]) == (
            "g711_ulaw", "g711_ulaw")
    else:
        audio = updated["session"]["audio"]
        assert audio["input"]["format"] == audio["output"]["format"] == {"type": "audio/pcmu"}
    return session


def test_a_pcmu_turn_is_heard_answered_in_pcmu_and_truncated_at_the_ms_played() -> None:
    session = pcmu_session()
    # The 24 kHz turn of test_session_voice (200 ms quiet, 600 loud, 600 quiet), as 20 ms mu-law frames.
    events = append(session, ulaw(200, QUIET) + ulaw(600, LOUD) + ulaw(600, QUIET))
    assert types(events) == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                             "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
    # At 24 kHz: 0 and 1300. The input filter's 2 ms lag moves the end of speech past the scripted
    # VAD's 10 ms frame edge: one frame later, and nothing else.
    assert (events[0]["audio_start_ms"], events[1]["audio_end_ms"]) == (0, 1310)
    transcribe, _ = session.commands()
    assert isinstance(transcribe, Transcribe)
    assert len(transcribe.audio) == 1310 * PCM_BYTES_PER_MS  # session audio: 24 kHz PCM16
    heard = np.frombuffer(transcribe.audio, "<i2")
    loud = audioop.ulaw2lin(audioop.lin2ulaw(struct.pack("<h", LOUD), 2), 2)
    assert set(heard[300 * 24:700 * 24]) == set(struct.unpack("<h", loud))  # the loud level, mu-law's step of it

    rid = story_started(session, transcribe)
    # The first phrase one session sample past a whole 8 kHz sample: padded to 24003 samples (8001 sent).
    session.speech_ready(rid, 0, tone(1000, 3000) + struct.pack("<h", 3000))
    session.speech_ready(rid, 1, tone(1000, 3000))
    spoken = drain(session)
    deltas = [base64.b64decode(e["delta"]) for e in spoken if e["type"] == "response.output_audio.delta"]
    assert [len(d) for d in deltas] == [4000, 4000, 1, 4000, 4000]  # 500 ms deltas, 1 byte = 1/8 ms
    sent = np.frombuffer(audioop.ulaw2lin(b"".join(deltas), 2), "<i2")
    assert set(sent[100:3900]) == set(np.frombuffer(audioop.ulaw2lin(audioop.lin2ulaw(struct.pack("<h", 3000), 2), 2),
                                                    "<i2"))
    item_id = next(e for e in spoken if e["type"] == "response.output_item.added")["item"]["id"]

    events = append(session, ulaw(300, LOUD))  # the user talks over the answer
    assert "input_audio_buffer.speech_started" in types(events)
    assert events[-1]["type"] == "response.done" and events[-1]["response"]["status"] == "cancelled"
    session.commands()
    # The client played 12,000 bytes: 1500 ms. The item keeps what the 24 kHz session keeps there.
    session.receive({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                     "audio_end_ms": 12_000 // PCMU.bytes_per_ms})
    (truncated,) = drain(session)
    assert truncated["audio_end_ms"] == 1500
    session.receive({"type": "conversation.item.retrieve", "item_id": item_id})
    (retrieved,) = drain(session)
    assert retrieved["item"]["content"][0]["transcript"] == "Once upon a time. There"
    # All that was sent is 16,001 bytes, 2000.125 ms: the item's audio ends there too.
    session.receive({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                     "audio_end_ms": 2001})
    (error,) = drain(session)
    assert (error["error"]["code"], error["error"]["param"]) == ("invalid_value", "audio_end_ms")


def test_a_beta_session_names_g711_and_its_appends_are_bounded_in_session_ms() -> None:
    """The append bound counts the converted audio: an 8 kHz append carries at most the ms a 24 kHz
    one may (1 s here), not 6 times more."""
    session = make(beta=True, limits=SessionLimits(max_audio_append_bytes=1000 * PCM_BYTES_PER_MS))
    session.receive({"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}})
    (updated,) = drain(session)
    assert updated["session"]["input_audio_format"] == "g711_ulaw"
    assert drain(session) == []
    session.receive({"type": "input_audio_buffer.append", "audio": base64.b64encode(ulaw(1000, QUIET)).decode()})
    assert drain(session) == []
    session.receive({"type": "input_audio_buffer.append", "audio": base64.b64encode(ulaw(1001, QUIET)).decode()})
    (refused,) = drain(session)
    assert (refused["error"]["code"], refused["error"]["param"]) == ("audio_too_large", "audio")
    assert "1001 ms of audio/pcmu" in refused["error"]["message"]
    pcmu_session(beta=True)
