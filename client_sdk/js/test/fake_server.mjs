// A scripted in-memory gateway for the client tests (client.test.mjs, device.test.mjs): answers
// the client's events the way the real one does, unless told otherwise.
import * as msgpack from "../msgpack.js";

export /** A fake gateway: answers the client's events the way the real one does, unless told otherwise. */
class FakeServer {
  constructor({ truncate = true, silent = false, refuse = 0, neverOpen = false, binary = false, drainOnCreate = null,
    stall = 0 } = {}) {
    // drainOnCreate: a close reason; the next response.create is not taken, the socket is closed
    // with 1001 and that reason instead (a replica draining just as the request arrives).
    // stall: how many conversation.item.create events go unanswered (a replica that took the
    // session and then hung).
    Object.assign(this, { truncate, silent, refuse, neverOpen, binary, drainOnCreate, stall });
    this.sockets = [];
    this.received = []; // every client event, per socket index: [index, event]
    this.items = [];
    this.responses = 0;
    const server = this;
    this.WebSocket = class {
      constructor(url, protocols) {
        this.url = url;
        this.protocols = protocols;
        this.readyState = 0;
        this.protocol = "";
        server.sockets.push(this);
        queueMicrotask(() => server._accept(this));
      }
      send(data) { server._receive(this, data); }
      close(code = 1000, reason = "") { server.drop(this, code, reason); }
    };
  }

  _accept(ws) {
    if (this.neverOpen) return;
    if (this.refuse > 0) {
      this.refuse -= 1;
      ws.readyState = 3;
      ws.onerror?.({});
      ws.onclose?.({ code: 1006, reason: "" });
      return;
    }
    ws.readyState = 1;
    ws.protocol = ws.protocols[0];
    this.items = [];
    ws.onopen?.({});
    this.emit(ws, { type: "session.created", session: { id: `sess_${this.sockets.length}` } });
  }

  emit(ws, event) {
    const data = this.binary ? msgpack.encode(event).buffer : JSON.stringify(event);
    ws.onmessage?.({ data });
  }

  drop(ws, code = 1001, reason = "server shutting down") {
    if (ws.readyState === 3) return;
    ws.readyState = 3;
    queueMicrotask(() => ws.onclose?.({ code, reason }));
  }

  get last() { return this.sockets.at(-1); }

  sent(type) { return this.received.filter(([, e]) => e.type === type).map(([, e]) => e); }

  _receive(ws, data) {
    const event = this.binary ? msgpack.decode(data) : JSON.parse(data);
    this.received.push([this.sockets.indexOf(ws), event]);
    if (this.silent) return;
    const reply = (e) => queueMicrotask(() => this.emit(ws, e));
    switch (event.type) {
      case "session.update":
        reply({ type: "session.updated", session: event.session });
        break;
      case "conversation.item.create": {
        if (this.stall > 0) {
          this.stall -= 1;
          break;
        }
        const previous = event.previous_item_id === "root" ? null : (event.previous_item_id ?? this.items.at(-1) ?? null);
        this.items.splice(previous === null ? 0 : this.items.indexOf(previous) + 1, 0, event.item.id);
        reply({ type: "conversation.item.added", item: event.item, previous_item_id: previous });
        break;
      }
      case "response.create":
        if (this.drainOnCreate !== null) {
          const reason = this.drainOnCreate;
          this.drainOnCreate = null;
          this.drop(ws, 1001, reason);
          break;
        }
        this.responses += 1;
        reply({ type: "response.created", response: { id: `resp_${this.responses}` } });
        break;
      case "conversation.item.truncate":
        reply(this.truncate
          ? { type: "conversation.item.truncated", item_id: event.item_id, x_text_end: event.x_text_end }
          : { type: "error", error: { code: "unknown_parameter", message: "x_text_end", event_id: event.event_id } });
        break;
      case "conversation.item.delete":
        this.items = this.items.filter((id) => id !== event.item_id);
        reply({ type: "conversation.item.deleted", item_id: event.item_id });
        break;
      case "response.cancel":
        reply(this.done(`resp_${this.responses}`, "cancelled", this.answer ?? ""));
        break;
      default:
        break;
    }
  }

  /** Streams an answer for the current response: the item, the deltas, optionally the end. */
  answer_(texts, { finish = true } = {}) {
    const ws = this.last;
    const response = `resp_${this.responses}`;
    const item = `item_srv${this.responses}`;
    this.answer = texts.join("");
    this.items.push(item);
    this.emit(ws, { type: "conversation.item.added", item: { id: item, role: "assistant", content: [] },
      previous_item_id: this.items.at(-2) ?? null });
    for (const delta of texts) this.emit(ws, { type: "response.output_text.delta", response_id: response, item_id: item, delta });
    if (finish) this.emit(ws, this.done(response, "completed", this.answer, item));
    return item;
  }

  /** Streams a function call for the current response (its arguments in `pieces`), then the end. */
  call_(name, pieces, { finish = true } = {}) {
    const ws = this.last;
    const response = `resp_${this.responses}`;
    const id = `item_call${this.responses}`;
    const callId = `call_${this.responses}`;
    const item = { id, object: "realtime.item", type: "function_call", status: "in_progress", call_id: callId, name,
      arguments: "" };
    this.items.push(id);
    this.emit(ws, { type: "response.output_item.added", response_id: response, output_index: 0, item });
    this.emit(ws, { type: "conversation.item.added", item, previous_item_id: this.items.at(-2) ?? null });
    for (const delta of pieces) {
      this.emit(ws, { type: "response.function_call_arguments.delta", response_id: response, item_id: id, output_index: 0,
        call_id: callId, delta });
    }
    const done = { ...item, status: "completed", arguments: pieces.join("") };
    this.emit(ws, { type: "response.function_call_arguments.done", response_id: response, item_id: id, output_index: 0,
      call_id: callId, name, arguments: done.arguments });
    this.emit(ws, { type: "response.output_item.done", response_id: response, output_index: 0, item: done });
    if (finish) {
      this.emit(ws, { type: "response.done", response: { id: response, status: "completed", status_details: null,
        output: [done], metadata: { x_tier: "edge" }, usage: { input_tokens: 9, output_tokens: 12 } } });
    }
    return done;
  }

  done(response, status, text, item = `item_srv${this.responses}`) {
    return { type: "response.done", response: { id: response, status,
      status_details: status === "cancelled" ? { type: "cancelled", reason: "client_cancelled" } : null,
      output: [{ id: item, role: "assistant", content: [{ type: "output_text", text }] }],
      metadata: { x_tier: "edge" }, usage: { input_tokens: 9, output_tokens: 2, input_token_details: { cached_tokens: 4 } } } };
  }
}
