"""The [voice] table: defaults, key and type errors naming the key, values checked."""

from __future__ import annotations

import pytest

from llm_shared.configtools import build
from llm_shared.errors import ConfigError
from voice.config import VoiceConfig
from voice.phrases import PhraseBounds


def test_defaults_are_valid_and_derived_bounds_follow() -> None:
    config = build(VoiceConfig, {}, "voice")
    assert config == VoiceConfig()
    assert config.enabled and config.asr_model == "auto" and config.voice == "alloy"
    assert config.max_input_buffer_bytes == 120 * 48_000
    assert config.max_append_base64_chars == 15 * 2**20  # 11,796,480 bytes as base64: the API's 15 MiB


def test_voice_seats_default_to_three_a_core_and_a_configured_count_wins() -> None:
    """What bench/voice_sessions.py measured (docs/voice.md, "Sizing"): 6 seats on a 2-core host."""
    assert VoiceConfig().voice_sessions(2) == 6
    assert VoiceConfig().voice_sessions(16) == 48
    assert VoiceConfig(max_sessions=5).voice_sessions(2) == 5


def test_a_table_loads() -> None:
    config = build(VoiceConfig, {"pool_threads": 4, "voice": "ash", "max_queued_audio_s": 300,
                                 "asr_compute_type": "float32"}, "voice")
    assert (config.pool_threads, config.voice, config.max_queued_audio_s) == (4, "ash", 300)


@pytest.mark.parametrize(("table", "message"), [
    ({"pool_thread": 2}, "unknown key"),
    ({"pool_threads": "2"}, "voice.pool_threads has the wrong type"),
    ({"enabled": 1}, "voice.enabled has the wrong type"),
    ({"pool_threads": 0}, "voice.pool_threads"),
    ({"voice": "robot"}, "voice.voice must be one of"),
    ({"asr_compute_type": "int4"}, "voice.asr_compute_type"),
    ({"tts_backend": "espeak"}, "voice.tts_backend"),
    ({"max_input_buffer_s": 700}, "max_queued_audio_s (600) must be >= voice.max_input_buffer_s (700)"),
    ({"max_session_jobs": 65}, "voice.max_session_jobs must be in 1..voice.max_queued_jobs"),
    ({"max_audio_bytes_per_s": 24_000}, "real time at 24 kHz"),
    ({"audio_burst_bytes": 1000}, "voice.audio_burst_bytes must be >= 48000 (one second of audio at once)"),
    ({"first_phrase_max_chars": 200}, "first_phrase_max_chars"),
    ({"first_phrase_max_chars": 15}, "first_phrase_max_chars"),
    ({"first_phrase_max_chars": 20, "phrase_max_chars": 30}, "phrase_max_chars >= 40"),
    ({"asr_model": ""}, "must not be empty"),
    ({"tts_model": ""}, "must not be empty"),
    ({"job_timeout_s": 0}, "voice.job_timeout_s"),
])
def test_bad_tables_name_the_key(table: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build(VoiceConfig, table, "voice")


@pytest.mark.parametrize(("first", "later"), [(16, 40), (60, 160), (1000, 1000)])
def test_any_valid_phrase_bounds_make_a_splitter(first: int, later: int) -> None:
    config = build(VoiceConfig, {"first_phrase_max_chars": first, "phrase_max_chars": later}, "voice")
    bounds = PhraseBounds(first_max_chars=config.first_phrase_max_chars, max_chars=config.phrase_max_chars)
    assert bounds.first_max_chars == first


def test_frozen() -> None:
    with pytest.raises(AttributeError):
        VoiceConfig().pool_threads = 3  # type: ignore[misc]
