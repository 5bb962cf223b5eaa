"""The gateway server: one aiohttp app on one port serving ``/v1/realtime`` and the HTTP API.

``create_app`` builds an app around a config (and, in tests, ready-made engines);
``start_server`` binds it; ``serve`` runs it until SIGINT/SIGTERM, loading the engines after
the port is open so that ``/readyz`` can say 503 meanwhile; ``run`` does that on uvloop.

On SIGINT/SIGTERM the replica first drains (gateway/process/drain.py: no new work, each session closed
with 1001 and a reconnect hint once its response is done, whatever runs past
``drain_timeout_s`` cancelled; a second signal cuts the wait short). Then shutdown: the
listening socket closes, any session left ends its active response with ``server_shutdown``
and is closed with 1001, in-flight chat completions are aborted with a reason, and only then
are the engines closed.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.auth import AuthError, host_allowed, origin_allowed, parse_subprotocols
from gateway.config import Config
from gateway.http.api import add_routes
from gateway.http.state import STATE, GatewayState
from gateway.limits import LimitsUnavailableError
from gateway.metrics import GcPauses
from gateway.process.drain import RETRY_AFTER_S, drain_gate, drain_replica, jittered_hint
from gateway.tiers.build import close_engines, load_engines
from gateway.ws.codec import MSGPACK_SUBPROTOCOL, FrameCodec
from gateway.ws.connection import WS_CLOSE_GOING_AWAY, RealtimeConnection
from gateway.ws.frame_gate import FrameGate, GatedWebSocketResponse
from gateway.ws.session import RealtimeSession, SessionLimits
from llm_shared.contract import Engine
from llm_shared.errors import ConfigError

if TYPE_CHECKING:
    from gateway.ws.voice_service import GatewayVoice

log = logging.getLogger(__name__)

REALTIME_PATH = "/v1/realtime"
BROWSER_SUBPROTOCOL = "realtime"
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"  # how browsers ask for the beta flavour
EngineLoader = Callable[[Config], Awaitable[dict[str, Engine]]]


def check_bind_safety(config: Config) -> None:
    """Refuse to listen beyond loopback unless clients must present an API key."""
    server = config.server
    if not server.is_loopback and not server.all_api_keys():
        raise ConfigError(
            f"refusing to listen on {server.host}: that address is reachable from other machines and no API keys "
            f"are configured. Set server.api_keys in the config or ${server.api_keys_env} (comma-separated), "
            "or bind 127.0.0.1"
        )


def create_app(config: Config, engines: dict[str, Engine] | None = None,
               voice: GatewayVoice | None = None) -> web.Application:
    """An app for ``config``. With ``engines`` it is ready at once (tests); without, ``serve``
    loads them (and ``[voice]``'s pipeline) after the port is open and the app owns (and closes)
    them. ``voice``: a pipeline shared by tests (the caller closes it)."""
    # Chat bodies carry whole conversations; UTF-8 and JSON escapes can take ~6 bytes a character.
    body_limit = max(1 << 20, 6 * config.server.max_conversation_chars + 65536)
    app = web.Application(client_max_size=body_limit, middlewares=[_check_host, drain_gate])
    state = GatewayState.from_config(config)
    app[STATE] = state
    if engines is not None:
        state.set_engines(engines, owned=False)
    state.voice = voice
    add_routes(app, isolate_page=config.server.cross_origin_isolation)
    app.router.add_get(REALTIME_PATH, realtime)
    app.on_startup.append(_on_startup)
    app.on_shutdown.append(_on_shutdown)
    app.on_cleanup.append(_on_cleanup)
    return app


@web.middleware
async def _check_host(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every endpoint answers only to the Host names it serves (DNS rebinding defence)."""
    state = request.app[STATE]
    server = state.config.server
    if not host_allowed(request.headers.get("Host"), server.allowed_hosts, server.host):
        state.metrics.errors.labels("http", "host_not_allowed").inc()
        error = {"type": "invalid_request_error", "code": "host_not_allowed", "param": None,
                 "message": "this server does not answer to that Host name; add it to server.allowed_hosts"}
        return web.json_response({"error": error}, status=421)
    return await handler(request)


def _choose_subprotocol(offered: list[str]) -> str | None:
    """The one subprotocol to echo back: msgpack if asked for, else browsers' ``realtime``.
    Never the key-carrying one."""
    for candidate in (MSGPACK_SUBPROTOCOL, BROWSER_SUBPROTOCOL):
        if candidate in offered:
            return candidate
    return None


def _handshake_error(state: GatewayState, e: AuthError) -> web.Response:
    state.metrics.handshakes_rejected.labels(e.code).inc()
    body = {"error": e.to_dict()}
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
    return web.json_response(body, status=e.status, headers=headers)


async def realtime(request: web.Request) -> web.StreamResponse:
    """``GET /v1/realtime``: every check happens before the upgrade, so a refused client gets
    an HTTP status and no session is ever created for it."""
    state = request.app[STATE]
    server = state.config.server
    offered = parse_subprotocols(request.headers.get("Sec-WebSocket-Protocol"))
    try:
        if not origin_allowed(request.headers.get("Origin"), request.host, server.allowed_origins):
            raise AuthError(403, "origin_not_allowed", "this Origin is not allowed; add it to server.allowed_origins")
        key_id = state.auth.authenticate(request.headers.get("Authorization"), offered)
        if state.draining:
            raise AuthError(503, "server_draining", "this gateway replica is shutting down and takes no new "
                            "sessions; retry: another replica will serve you", "server_error")
        if state.shutting_down:
            raise AuthError(503, "server_shutting_down", "the server is shutting down", "server_error")
        if not state.ready or state.router is None:
            raise AuthError(503, "engine_unavailable", state.unavailable_message(), "server_error")
        model = request.query.get("model") or state.default_model
        if model not in state.models:
            raise AuthError(404, "model_not_found", f"The model '{model}' does not exist; available: "
                            f"{sorted(state.models)}")
        lease = await state.limits.acquire_lease("session", key_id, holder=f"ws-{secrets.token_hex(8)}")
    except AuthError as e:
        return _handshake_error(state, e)
    except LimitsUnavailableError as e:
        return _handshake_error(state, AuthError(503, e.code, e.message, "server_error"))
    try:
        return await _run_session(request, state, key_id, model, offered)
    finally:
        await state.limits.release(lease)


async def _run_session(request: web.Request, state: GatewayState, key_id: str, model: str,
                       offered: list[str]) -> web.StreamResponse:
    server = state.config.server
    subprotocol = _choose_subprotocol(offered)
    ws = GatedWebSocketResponse(
        # Frames over max_frame_bytes pass the gate only within the server's budget for large frames.
        gate=lambda parser: FrameGate(parser, state.large_frames, small=server.max_frame_bytes,
                                      cap=server.max_large_frame_bytes),
        protocols=(subprotocol,) if subprotocol else (),
        max_msg_size=server.max_large_frame_bytes + 1,  # aiohttp's own bound (1009): fragments past the cap
        heartbeat=server.ping_interval_s,
        compress=False,  # no permessage-deflate: it costs memory per connection and invites zip bombs
    )
    # aiohttp waits heartbeat/2 for the pong and has no public setting for it.
    ws._pong_heartbeat = server.ping_timeout_s
    await ws.prepare(request)
    beta = "realtime=v1" in request.headers.get("OpenAI-Beta", "") or BETA_SUBPROTOCOL in offered
    session_id = f"sess_{secrets.token_urlsafe(12)}"
    voice = state.config.voice
    limits = SessionLimits(
        max_conversation_items=server.max_conversation_items,
        max_conversation_chars=server.max_conversation_chars,
        default_max_output_tokens=server.default_max_output_tokens,
        max_output_tokens=server.max_output_tokens,
        max_audio_append_bytes=voice.max_append_bytes,
        max_audio_buffer_ms=int(voice.max_input_buffer_s * 1000),
        max_audio_bytes_per_s=voice.max_audio_bytes_per_s,
        audio_burst_bytes=voice.audio_burst_bytes,
    )
    session = RealtimeSession(session_id=session_id, model=model, limits=limits, beta=beta,
                              models=frozenset(state.models), family=state.grammars.family,
                              voice=state.voice.hooks if state.voice is not None else None)
    assert state.router is not None  # checked by the handshake
    connection = RealtimeConnection(
        ws, session, session_id=session_id,
        codec=FrameCodec("msgpack" if subprotocol == MSGPACK_SUBPROTOCOL else "json", server.max_large_frame_bytes),
        router=state.router, limits=state.limits, key_id=key_id, metrics=state.metrics, config=server,
        transport=request.transport if server.direct_writes else None, grammars=state.grammars,
        voice=state.voice, gate=ws.gate,
    )
    state.connections.add(connection)
    if state.draining:  # accepted while the drain began: it closes right after session.created
        connection.drain(jittered_hint(server.drain_reconnect_spread_ms))
    state.metrics.sessions_total.inc()
    state.metrics.sessions_active.inc()
    log.debug("session %s opened (key %s, beta=%s)", session_id, key_id, beta)
    try:
        await connection.run()
    finally:
        state.connections.discard(connection)
        state.work_ended.set()
        state.metrics.sessions_active.dec()
        log.debug("session %s closed", session_id)
    return ws


async def _on_startup(app: web.Application) -> None:
    app[STATE].start_router()  # engines passed to create_app (tests): their health probes start here


async def _on_shutdown(app: web.Application) -> None:
    """Runs after the listening socket is closed, before the engines are."""
    state = app[STATE]
    state.shutting_down = True
    closes = [c.close(WS_CLOSE_GOING_AWAY, "server shutting down", cancel_reason="server_shutdown")
              for c in list(state.connections)]
    timeout = state.config.server.engine_abort_timeout_s
    aborts = [asyncio.wait_for(engine.abort(rid), timeout) for rid, engine in list(state.http_requests.items())]
    await asyncio.gather(*closes, *aborts, return_exceptions=True)


async def _on_cleanup(app: web.Application) -> None:
    state = app[STATE]
    await state.close_router()
    await state.close_limits()
    if state.owns_engines:
        await close_engines(state.engines)
        if state.voice is not None:
            state.voice.close()


@dataclass
class RunningServer:
    runner: web.AppRunner
    host: str
    port: int

    @property
    def app(self) -> web.Application:
        return self.runner.app

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def drain(self, hurry: asyncio.Event | None = None) -> None:
        """Drain (gateway/process/drain.py): returns once every session and chat completion has ended, or
        those left after ``drain_timeout_s`` (or once ``hurry`` is set) have been cancelled."""
        await drain_replica(self.app[STATE], hurry=hurry)

    async def stop(self) -> None:
        """Graceful shutdown (idempotent): stop accepting, end sessions with 1001, close engines."""
        if self.runner.server is not None:
            await self.runner.cleanup()


async def start_server(app: web.Application, **runner_kwargs: Any) -> RunningServer:
    """Bind ``app`` to the host and port of its config (port 0: any free port)."""
    config = app[STATE].config
    check_bind_safety(config)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,  # a client that goes away cancels its handler: the engine request is aborted
        shutdown_timeout=config.server.shutdown_grace_s,
        **runner_kwargs,
    )
    await runner.setup()
    # Several workers (gateway/process/workers.py) each bind the port; the kernel spreads connections over them.
    site = web.TCPSite(runner, config.server.host, config.server.port, reuse_port=config.server.workers > 1)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    port = runner.addresses[0][1]
    return RunningServer(runner, config.server.host, port)


async def serve(config: Config, *, stop: asyncio.Event | None = None, app: web.Application | None = None,
                load: EngineLoader | None = None) -> None:
    """Serve until ``stop`` is set (by default on SIGINT or SIGTERM). A worker process passes its
    own ``app`` (``create_app``'s, with its additions) and ``load`` (engines shared with its siblings)."""
    check_bind_safety(config)
    app = app if app is not None else create_app(config)
    server = await start_server(app)
    log.info("listening on %s (WebSocket %s%s); loading engines", server.url,
             server.url.replace("http", "ws", 1), REALTIME_PATH)
    loop = asyncio.get_running_loop()
    hurry = asyncio.Event()  # a second signal: stop draining, cancel what runs
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, _on_signal, stop, hurry)
    try:
        with GcPauses(app[STATE].metrics):
            await _serve_until(app, config, server, stop, hurry, load)
    finally:
        await server.stop()


async def _serve_until(app: web.Application, config: Config, server: RunningServer, stop: asyncio.Event,
                       hurry: asyncio.Event, load: EngineLoader | None) -> None:
    state = app[STATE]
    # The voice models load beside the engines (off the loop), so /readyz waits for neither alone.
    voice = asyncio.to_thread(state.load_voice) if state.voice is None else asyncio.sleep(0, state.voice)
    engines, state.voice = await asyncio.gather((load or load_engines)(config), voice)
    state.set_engines(engines, owned=True)
    # What start-up built (modules, tokenizers, engines) lives as long as the process: frozen
    # out of the cyclic collector, a full collection scans only what serving made since
    # (docs/reliability.md: 70-110 ms pauses under load before, in every stream's ITL). Full
    # collections come rarer too (``server.gc_full_after``): a streamed response leaves no
    # cycles behind, so a full pass mostly finds nothing; what does (a closed session's aiohttp
    # objects) is collected at least every ``server.gc_full_every_s``.
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, config.server.gc_full_after)
    every = config.server.gc_full_every_s
    collector = asyncio.create_task(full_collections(every), name="gc-full") if every > 0 else None
    log.info("ready: tiers %s serving models %s", sorted(engines), sorted(app[STATE].models))
    try:
        await stop.wait()
        await server.drain(hurry)
    finally:
        if collector is not None:
            collector.cancel()
    log.info("shutting down")


async def full_collections(every_s: float) -> None:
    """A full cyclic collection every ``every_s`` on the event loop (timed by ``GcPauses``)."""
    while True:
        await asyncio.sleep(every_s)
        gc.collect()


def _on_signal(stop: asyncio.Event, hurry: asyncio.Event) -> None:
    if stop.is_set():
        hurry.set()
    else:
        stop.set()


def run(config: Config) -> None:
    """Serve on a uvloop event loop (blocking); with ``server.workers`` > 1, start that many
    worker processes on the port and supervise them (gateway/process/workers.py)."""
    import uvloop

    check_bind_safety(config)
    if config.server.workers > 1:
        from gateway.process.workers import run_workers

        run_workers(config)
        return
    uvloop.run(serve(config))
