"""Every exception this SDK raises, in one module that imports nothing of the SDK, so that any
part (the socket, the turns, the on-device fallback) can raise them without importing another."""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    """Base of this SDK's errors."""


class GatewayUnreachable(GatewayError, ConnectionError):
    """The gateway could not be reached (refused, DNS, timeout, TLS, a 5xx at the handshake)."""


class GatewayRefused(GatewayError):
    """The gateway answered and said no: a refused key (401/403), an unknown model (404). Not
    a network failure: no fallback hides it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"the gateway refused the session (HTTP {status}): {message}")
        self.status = status


class TurnInProgress(GatewayError):
    """A turn is still running: cancel it or wait for its result first."""


class ClientClosed(GatewayError):
    """``close()`` was called while this call was opening a session (the JS SDK's ``client_closed``):
    what it had opened is closed again. A later ``connect()`` or ``send()`` opens the client anew."""

    def __init__(self) -> None:
        super().__init__("the client was closed while it connected to the gateway")


class FrameError(ValueError):
    """A frame from the server that is not an event."""


class OfflineModelError(RuntimeError):
    """The on-device model cannot answer; the message says why and what to do."""


class OfflineVoiceError(OfflineModelError):
    """The device cannot do voice: the ``voice`` package, its models or flite are missing, the
    session asks for what the device does not do, or speech failed (``rtgw/device_voice.py``)."""


class OfflineRequestError(Exception):
    """The turn asks for what the gateway would refuse too (its tools): ``error`` is the error
    object the gateway would send (type, code, message, param). The turn ends ``failed`` with it."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(str(error.get("message", "")))
        self.error = error
