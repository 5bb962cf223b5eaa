"""Client SDK for the rt-llm-gateway: a Realtime session with streaming, cancel and barge-in,
function calling, reconnect with conversation restore, JSON or msgpack frames, and an on-device
fallback."""

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
from rtgw.protocol import (
    ClientProtocol,
    ConversationItem,
    FunctionCall,
    FunctionCallItem,
    FunctionCallOutputItem,
    Item,
    TextDelta,
    TurnResult,
)

__all__ = [
    "Backoff", "ClientClosed", "ClientProtocol", "ConversationItem", "FunctionCall", "FunctionCallItem",
    "FunctionCallOutputItem", "GatewayError", "GatewayRefused", "GatewayUnreachable", "Item", "OfflineConfig",
    "OfflineModelError", "RealtimeClient", "TextDelta", "Turn", "TurnInProgress", "TurnResult", "realtime_url",
]
