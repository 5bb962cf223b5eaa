"""Client SDK for the rt-llm-gateway: a Realtime session with streaming, cancel and barge-in,
reconnect with conversation restore, JSON or msgpack frames, and an on-device fallback."""

from rtgw.client import (
    Backoff,
    ClientClosed,
    GatewayError,
    GatewayRefused,
    GatewayUnreachable,
    RealtimeClient,
    Turn,
    TurnInProgress,
    realtime_url,
)
from rtgw.offline import OfflineConfig, OfflineModelError
from rtgw.protocol import ClientProtocol, Item, TextDelta, TurnResult

__all__ = [
    "Backoff", "ClientClosed", "ClientProtocol", "GatewayError", "GatewayRefused", "GatewayUnreachable", "Item",
    "OfflineConfig", "OfflineModelError", "RealtimeClient", "TextDelta", "Turn", "TurnInProgress", "TurnResult", "realtime_url",
]
