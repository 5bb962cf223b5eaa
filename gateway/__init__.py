"""The server: one aiohttp port on uvloop for the Realtime WebSocket and the HTTP API, its config, auth, limits, metrics and engine set-up."""
