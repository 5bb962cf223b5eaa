"""Requests about one item of the conversation, answered by the gateway: ``retrieve`` (its copy)
and ``truncate`` (cut an assistant message to the characters heard: our ``x_text_end``
extension, or, on a server without it, delete and re-create the message)."""

from __future__ import annotations

import asyncio
import logging

from rtgw.connection import Connection
from rtgw.errors import GatewayError, GatewayUnreachable
from rtgw.protocol import ClientProtocol, ConversationItem, Item

log = logging.getLogger(__name__)


async def retrieve(conn: Connection, protocol: ClientProtocol, item_id: str) -> ConversationItem:
    """The server's copy of a conversation item (``conversation.item.retrieve``)."""
    if conn.ws is None:
        raise GatewayUnreachable("not connected to the gateway")
    event = protocol.event("conversation.item.retrieve", item_id=item_id)
    retrieved = conn.expect(("retrieved", item_id))
    refused = conn.expect(("event", event["event_id"]))
    await conn.send(event)
    try:
        finished, _ = await asyncio.wait({retrieved, refused}, timeout=conn.request_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
    finally:
        for key in (("retrieved", item_id), ("event", event["event_id"])):
            conn.forget(key)
    if retrieved in finished:
        return retrieved.result()
    if refused in finished:
        error = refused.result()
        raise GatewayError(f"the gateway could not retrieve {item_id!r}: {error.code}: {error.message}")
    raise GatewayUnreachable("the gateway did not answer the retrieve in time")


async def truncate(conn: Connection, protocol: ClientProtocol, item: Item, heard: int) -> None:
    """Keep the first ``heard`` characters of ``item`` on the server (and in ``protocol``)."""
    event = protocol.truncate(item.id, heard)
    done = conn.expect(("truncated", item.id))
    refused = conn.expect(("event", event["event_id"]))
    await conn.send(event)
    finished, _ = await asyncio.wait({done, refused}, timeout=conn.request_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
    for key, future in ((("truncated", item.id), done), (("event", event["event_id"]), refused)):
        if future not in finished:
            future.cancel()
        conn.forget(key, future)
    if done in finished and done.exception() is None:
        return
    if refused in finished and refused.exception() is None:
        # A server without our x_text_end: replace the message with what was heard.
        log.info("the gateway refused the text truncate (%s); replacing the message instead",
                 refused.result().message)
        for replace in protocol.replace_events(item.id, item.text[:heard]):
            await conn.send(replace)
        return
    raise GatewayUnreachable("the gateway did not confirm the truncate in time")
