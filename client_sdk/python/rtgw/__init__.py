"""Client SDK for the rt-llm-gateway: a Realtime session with streaming, cancel and barge-in,
function calling, voice (audio in and out, server VAD, barge-in that truncates to what was
played), reconnect with conversation restore, JSON or msgpack frames, and an on-device fallback."""

from rtgw.audio import Player, RealTimePlayer, read_wav, write_wav
from rtgw.client import RealtimeClient
from rtgw.connection import Backoff, realtime_url
from rtgw.errors import (
    ClientClosed,
    GatewayError,
    GatewayRefused,
    GatewayUnreachable,
    OfflineModelError,
    OfflineVoiceError,
    TurnInProgress,
)
from rtgw.offline import OfflineConfig
from rtgw.protocol import (
    ClientProtocol,
    ConversationItem,
    FunctionCall,
    FunctionCallItem,
    FunctionCallOutputItem,
    Item,
    TextDelta,
    TranscriptDelta,
    TurnResult,
)
from rtgw.turn import Turn, TurnStarted
from rtgw.voice import VoiceEvent
from rtgw.voice_events import (
    AudioCleared,
    AudioCommitted,
    AudioDelta,
    AudioRefused,
    InputTranscript,
    Interrupted,
    SpeechStarted,
    SpeechStopped,
    TranscriptionFailed,
)

__all__ = [
    "AudioCleared", "AudioCommitted", "AudioDelta", "AudioRefused", "Backoff", "ClientClosed", "ClientProtocol",
    "ConversationItem", "FunctionCall", "FunctionCallItem", "FunctionCallOutputItem", "GatewayError",
    "GatewayRefused", "GatewayUnreachable", "InputTranscript", "Interrupted", "Item", "OfflineConfig",
    "OfflineModelError", "OfflineVoiceError", "Player", "RealTimePlayer", "RealtimeClient", "SpeechStarted", "SpeechStopped",
    "TextDelta", "TranscriptDelta", "TranscriptionFailed", "Turn", "TurnInProgress", "TurnResult", "TurnStarted",
    "VoiceEvent", "read_wav", "realtime_url", "write_wav",
]
