// rtgw: a client for the rt-llm-gateway's Realtime sessions (OpenAI Realtime API, text and audio).
// Dependency-free ES module for browsers, React Native and Node (>= 22, or 20 with
// --experimental-websocket, or any WebSocket constructor passed as `WebSocket`).
//
//   const client = new RealtimeClient({ url: "http://127.0.0.1:8000", apiKey });
//   const turn = await client.send("Hi!", { maxOutputTokens: 100 });
//   for await (const delta of turn) show(delta);
//   const result = await turn.result;   // status, text, metadata.x_tier, usage, ttftMs
//
// The client keeps a local copy of the conversation (`client.conversation`: items with ids,
// roles and text, from the server's events), so that barge-in (`interrupt`) and the restore
// after a reconnect need no round trip to read it. A dropped connection fails the active turn
// (`connection_lost`); the next operation reconnects with jittered exponential backoff and
// re-creates every item, with its id, on the new session. A gateway replica that is going away
// (drained) closes with 1001 and a reconnect hint once no response is in progress: the client
// then reconnects by itself after the time it names and restores the conversation the same way,
// with no error for the application.
//
// Function calling: `tools` (and `toolChoice`, `parallelToolCalls`) on the client, in
// `configure()` or per `send()`; each call of a turn comes as a `functionCall` event (on the turn
// and on the client) with its arguments parsed, and in `result.calls`; `sendToolOutput(callId,
// output)` answers it and starts the next response (`sendToolOutputs` answers several).
//
// Voice, in any runtime: `appendAudio` / `commitAudio` / `clearAudio` / `respond` send PCM16 at
// 24 kHz; a spoken answer's words stream as the turn's text and its audio as `audio` events;
// answers that server VAD starts come as `serverTurn` events; `truncateAudio` cuts an answer to
// the audio played. The browser's side (the microphone, Web Audio playback, `VoiceSession` with
// barge-in) is rtgw-voice.js, which builds on this module.
//
// On the device: given `device` (rtgw-device.js's DeviceFallback, or any object with `bind`,
// `available`, `prepare` and `answer`), a turn the gateway cannot take (unreachable, or its socket
// lost mid-answer) is answered on the device from the same conversation, with the same events
// (`response.created`, the message, its deltas, `response.done` with `metadata.x_tier` "device");
// the next turn tries the gateway first and, once it answers, restores the whole conversation on
// it, the device's answers included. `prefetchOffline()` downloads and loads the model while
// online. This module imports nothing: a client without `device` loads no on-device code.

export const MSGPACK_SUBPROTOCOL = "x-openai-realtime-msgpack";
const KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key.";
const SILENCE_CLOSE_CODE = 4000; // ours: the client gave up on a silent server
const GOING_AWAY = 1001;
const MAX_RECONNECT_AFTER_MS = 60000; // a hint asking for a longer wait is held to this

// --- errors -----------------------------------------------------------------------------------

export class GatewayError extends Error {
  constructor(message, code = "gateway_error") {
    super(message);
    this.name = new.target.name;
    this.code = code;
  }
}

/** The gateway could not be reached (refused connection, DNS, timeout, a 5xx at the handshake). */
export class GatewayUnreachable extends GatewayError {}

/** The gateway answered and said no (a refused key, an unknown model): retrying will not help. */
export class GatewayRefused extends GatewayError {
  constructor(status, code, message) {
    super(`the gateway refused the session (HTTP ${status} ${code}): ${message}`, code);
    this.status = status;
  }
}

/** An `error` event answering one of our requests. */
export class ServerError extends GatewayError {
  constructor(error) {
    super(error.message || error.code || "server error", error.code || "server_error");
    this.param = error.param ?? null;
    this.eventId = error.event_id ?? null;
  }
}

export class TurnInProgress extends GatewayError {
  constructor() {
    super("a turn is still running: cancel it or await its result first", "turn_in_progress");
  }
}

// --- small helpers ----------------------------------------------------------------------------

const now = () => globalThis.performance?.now?.() ?? Date.now();

function randomHex(bytes) {
  const buf = new Uint8Array(bytes);
  if (globalThis.crypto?.getRandomValues) globalThis.crypto.getRandomValues(buf);
  else for (let i = 0; i < bytes; i++) buf[i] = Math.floor(Math.random() * 256);
  return Array.from(buf, (b) => b.toString(16).padStart(2, "0")).join("");
}

export const newId = (prefix) => `${prefix}_${randomHex(8)}`;

/** Length in Unicode code points, the unit of the gateway's `x_text_end`. */
export const codePointLength = (text) => Array.from(text).length;
export const codePointSlice = (text, end) => Array.from(text).slice(0, end).join("");

/** The Realtime WebSocket URL from a base URL (http(s) or ws(s)), with `?model=` when given. */
export function realtimeUrl(url, model) {
  const u = new URL(url);
  u.protocol = { "http:": "ws:", "https:": "wss:" }[u.protocol] ?? u.protocol;
  if (!u.pathname.endsWith("/v1/realtime")) u.pathname = u.pathname.replace(/\/+$/, "") + "/v1/realtime";
  if (model) u.searchParams.set("model", model);
  return u.toString();
}

function httpUrl(wsUrl, path) {
  const u = new URL(wsUrl);
  u.protocol = { "ws:": "http:", "wss:": "https:" }[u.protocol] ?? u.protocol;
  u.pathname = u.pathname.replace(/\/v1\/realtime$/, "") + path;
  u.search = "";
  return u.toString();
}

/** Delays before the 2nd, 3rd, ... attempt: `initialMs` doubling to `maxMs`, each drawn from
 * [(1 - jitter) d, d] so that clients dropped together do not come back together. */
export function* backoffDelays({ initialMs = 250, factor = 2, maxMs = 8000, jitter = 0.5, attempts = 6 } = {},
  random = Math.random) {
  let delay = initialMs;
  for (let i = 1; i < attempts; i++) {
    yield delay * (1 - jitter * random());
    delay = Math.min(maxMs, delay * factor);
  }
}

/** The gateway's drain hint: a close with 1001 whose reason is `{"reconnect":true,"after_ms":N}`
 * asks the client to reconnect after N ms (the load balancer then picks a replica that is not
 * going away). The delay in ms, or null for any other close. */
export function reconnectHint(code, reason) {
  if (code !== GOING_AWAY || !reason) return null;
  let hint;
  try { hint = JSON.parse(reason); } catch { return null; }
  if (hint === null || typeof hint !== "object" || hint.reconnect !== true) return null;
  const after = typeof hint.after_ms === "number" && hint.after_ms >= 0 ? hint.after_ms : 0;
  return Math.floor(Math.min(after, MAX_RECONNECT_AFTER_MS));
}

function textOf(item) {
  return (item?.content ?? []).map((part) => part?.text ?? part?.transcript ?? "").join("");
}

/** A call's arguments parsed: the object, or null when they are not a JSON object (cut short). */
export function parseArguments(text) {
  try {
    const parsed = JSON.parse(text);
    return parsed !== null && typeof parsed === "object" && !Array.isArray(parsed) ? parsed : null;
  } catch {
    return null;
  }
}

/** A server item as the local conversation keeps it, or null for a kind it does not keep. */
function localItem(raw) {
  if (typeof raw?.id !== "string") return null;
  if (raw.type === "function_call") {
    return { id: raw.id, type: "function_call", callId: raw.call_id ?? "", name: raw.name ?? "",
      arguments: raw.arguments ?? "", status: raw.status ?? "completed" };
  }
  if (raw.type === "function_call_output") {
    return { id: raw.id, type: "function_call_output", callId: raw.call_id ?? "", output: raw.output ?? "" };
  }
  if ((raw.type ?? "message") !== "message" || !["system", "user", "assistant"].includes(raw.role)) return null;
  return { id: raw.id, type: "message", role: raw.role, text: textOf(raw) };
}

function wireItem(item) {
  if (item.type === "function_call") {
    // an in-progress call is restored as cut short: the response that was writing it is gone
    return { type: "function_call", id: item.id, call_id: item.callId, name: item.name, arguments: item.arguments,
      status: item.status === "in_progress" ? "incomplete" : item.status ?? "completed" };
  }
  if (item.type === "function_call_output") {
    return { type: "function_call_output", id: item.id, call_id: item.callId, output: item.output };
  }
  const type = item.role === "assistant" ? "output_text" : "input_text";
  return { type: "message", id: item.id, role: item.role, content: [{ type, text: item.text }] };
}

/** A function call as the application reads it. */
function callOf(item, responseId) {
  const parsed = parseArguments(item.arguments);
  return { callId: item.callId, name: item.name, arguments: item.arguments, parsed, itemId: item.id, responseId,
    status: item.status, complete: item.status === "completed" && parsed !== null };
}

/** Function tools in the Realtime shape; the chat completions shape ({type, function: {...}}) is unwrapped. */
export function normalizeTools(tools) {
  return tools.map((tool) => {
    if (tool?.function && tool.name === undefined) {
      const { strict: _strict, ...fn } = tool.function;
      return { type: "function", ...fn };
    }
    return { ...tool };
  });
}

/** The event base of the client, its turns and the voice classes (rtgw-voice.js). */
export class Emitter {
  constructor() { this._listeners = new Map(); }

  /** Calls `fn(payload)` on each `type` event; returns a function that unsubscribes. */
  on(type, fn) {
    if (!this._listeners.has(type)) this._listeners.set(type, new Set());
    this._listeners.get(type).add(fn);
    return () => this._listeners.get(type)?.delete(fn);
  }

  once(type) {
    return new Promise((resolve) => { const off = this.on(type, (x) => { off(); resolve(x); }); });
  }

  emit(type, payload) {
    for (const fn of [...(this._listeners.get(type) ?? [])]) {
      try { fn(payload); } catch (e) { (globalThis.reportError ?? console.error)(e); }
    }
  }
}

// --- audio on the wire: PCM16 at 24 kHz, base64 in JSON, raw bytes in msgpack -----------------

export const SAMPLE_RATE = 24000; // the Realtime API's audio/pcm: 16-bit little-endian mono at 24 kHz
const MAX_APPEND_BYTES = 128 * 1024; // per append: under the gateway's bound (256 KiB) and its frame limit

/** Bytes as base64 (btoa, in pieces: a spread of a large array overflows the stack). */
export function base64FromBytes(bytes) {
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

export function bytesFromBase64(text) {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

/** PCM16 as its little-endian bytes; an odd byte count is refused (not whole samples). */
function pcmBytes(pcm) {
  const bytes = pcm instanceof Uint8Array ? pcm : pcm instanceof ArrayBuffer ? new Uint8Array(pcm)
    : new Uint8Array(pcm.buffer, pcm.byteOffset, pcm.byteLength);
  if (bytes.length % 2) throw new TypeError(`PCM16 audio must be whole 2-byte samples, got ${bytes.length} bytes`);
  return bytes;
}

/** An audio delta's samples: base64 (JSON) or raw bytes (msgpack), copied so that they are aligned. */
function pcmFromWire(delta) {
  const bytes = typeof delta === "string" ? bytesFromBase64(delta) : pcmBytes(delta ?? new Uint8Array(0));
  const pcm = new Int16Array(bytes.length >> 1);
  new Uint8Array(pcm.buffer).set(bytes.subarray(0, pcm.length * 2));
  return pcm;
}

// --- one turn -----------------------------------------------------------------------------------

/** One answer as it streams: `for await (const delta of turn)`, `turn.on("delta", fn)`,
 * `turn.on("functionCall", fn)`, and `await turn.result` ({status, text, calls, metadata, usage,
 * tier, cachedTokens, ttftMs, ...}); the result never rejects: transport failures end the turn
 * `failed` with an `error`. */
export class Turn extends Emitter {
  constructor(userItemId) {
    super();
    this.userItemId = userItemId; // null for a turn that answers function calls
    this.responseId = null;
    this.itemId = null; // the assistant message, once the server created it
    this.text = "";
    this.calls = []; // the function calls so far, complete or cut short
    this.done = false;
    this.createEventId = newId("evt");
    this._startedAt = now();
    this._firstDeltaAt = null;
    this._pending = [];
    this._wake = null;
    this._request = null; // response.create's fields, once send() has a session: before, its connect decides
    this.audioMs = 0; // of a spoken answer, received so far
    this.userTranscript = null; // the user's speech it answers, once transcribed
    this.result = new Promise((resolve) => { this._resolve = resolve; });
  }

  _audio(pcm) {
    if (this.done) return;
    this.audioMs += pcm.length / 24;
    this.emit("audio", pcm);
  }

  _delta(text) {
    if (!text || this.done) return;
    if (this._firstDeltaAt === null) this._firstDeltaAt = now();
    this.text += text;
    this._pending.push(text);
    this._wake?.();
    this.emit("delta", text);
  }

  _call(call) {
    if (this.done) return;
    this.calls.push(call);
    this.emit("functionCall", call);
  }

  _finish(fields) {
    if (this.done) return;
    this.done = true;
    const metadata = fields.metadata ?? {};
    const usage = fields.usage ?? {};
    const result = {
      status: fields.status, text: fields.text ?? this.text, calls: fields.calls ?? this.calls,
      responseId: this.responseId, itemId: this.itemId,
      userItemId: this.userItemId, metadata, usage, reason: fields.reason ?? null, error: fields.error ?? null,
      tier: metadata.x_tier ?? null, cachedTokens: usage.input_token_details?.cached_tokens ?? 0,
      ttftMs: this._firstDeltaAt === null ? null : this._firstDeltaAt - this._startedAt,
      elapsedMs: now() - this._startedAt,
    };
    this._wake?.();
    this._resolve(result);
    this.emit("done", result);
  }

  async* [Symbol.asyncIterator]() {
    for (;;) {
      if (this._pending.length) {
        const text = this._pending.join("");
        this._pending = [];
        yield text;
      } else if (this.done) {
        return;
      } else {
        await new Promise((resolve) => { this._wake = resolve; });
        this._wake = null;
      }
    }
  }
}

// --- an answer made on the device, told as the gateway's events ----------------------------------

/** One response of the on-device model as the server events the gateway sends for the same output,
 * in the gateway's order (`llm_shared/realtime_order.py`, which the Python SDK's device answer uses;
 * `tests/test_response_order.py` compares all three): `response.created`, the assistant message
 * (`response.output_item.added` and `conversation.item.added` with its content empty, then
 * `response.content_part.added`), its text deltas, then `response.output_text.done`,
 * `response.content_part.done`, `response.output_item.done`, `conversation.item.done` and
 * `response.done`. `after`: the conversation's last item when the response starts. `resume`
 * continues a response the gateway began: only its further deltas and its end follow. */
export class DeviceResponse {
  constructor(responseId = newId("resp"), { after = null } = {}) {
    this.id = responseId;
    this._after = after;
    this._message = null;
    this._output = [];
    this.done = false;
  }

  static resume(responseId, itemId, text, { after = null } = {}) {
    const response = new DeviceResponse(responseId, { after });
    if (itemId) {
      response._message = { id: itemId, object: "realtime.item", type: "message", status: "in_progress",
        role: "assistant", content: [{ type: "output_text", text }] };
      response._output.push(response._message);
    }
    return response;
  }

  created() {
    return [{ type: "response.created", response: { id: this.id, object: "realtime.response", status: "in_progress",
      output: [] } }];
  }

  text(text) {
    if (!text || this.done) return [];
    const events = this._message ? [] : this._open();
    this._message.content[0].text += text;
    return [...events, { type: "response.output_text.delta", response_id: this.id, item_id: this._message.id,
      output_index: this._output.indexOf(this._message), content_index: 0, delta: text }];
  }

  /** status: completed, incomplete, cancelled or failed; `reason` for incomplete/cancelled, `error` for failed. */
  finish(status, { reason = null, error = null, usage = {}, metadata = {} } = {}) {
    if (this.done) return [];
    const events = !this._message && ["completed", "incomplete"].includes(status) ? this._open() : [];
    if (this._message) {
      const message = this._message;
      message.status = status === "completed" ? "completed" : "incomplete";
      const ids = { response_id: this.id, item_id: message.id, output_index: this._output.indexOf(message),
        content_index: 0 };
      const text = message.content[0].text;
      events.push({ type: "response.output_text.done", ...ids, text },
        { type: "response.content_part.done", ...ids, part: { type: "text", text } },
        { type: "response.output_item.done", response_id: this.id, output_index: ids.output_index,
          item: structuredClone(message) },
        { type: "conversation.item.done", previous_item_id: this._previous(message), item: structuredClone(message) });
    }
    this.done = true;
    const details = error ? { type: status, error } : reason ? { type: status, reason } : null;
    events.push({ type: "response.done", response: { id: this.id, object: "realtime.response", status,
      status_details: details, output: structuredClone(this._output), metadata, usage } });
    return events;
  }

  _previous(item) {
    const index = this._output.indexOf(item);
    return index > 0 ? this._output[index - 1].id : this._after;
  }

  _open() {
    const message = { id: newId("item"), object: "realtime.item", type: "message", status: "in_progress",
      role: "assistant", content: [] };
    this._message = message;
    this._output.push(message);
    const outputIndex = this._output.length - 1;
    const events = [{ type: "response.output_item.added", response_id: this.id, output_index: outputIndex,
      item: structuredClone(message) },
    { type: "conversation.item.added", previous_item_id: this._previous(message), item: structuredClone(message) },
    { type: "response.content_part.added", response_id: this.id, item_id: message.id, output_index: outputIndex,
      content_index: 0, part: { type: "text", text: "" } }];
    message.content.push({ type: "output_text", text: "" });
    return events;
  }
}

// --- the client -------------------------------------------------------------------------------

const SESSION_FIELDS = { instructions: "instructions", temperature: "temperature", maxOutputTokens: "max_output_tokens",
  tools: "tools", toolChoice: "tool_choice", parallelToolCalls: "parallel_tool_calls" };
const RESPONSE_FIELDS = { ...SESSION_FIELDS, metadata: "metadata" };

function wireFields(options, names) {
  const out = {};
  for (const [name, wire] of Object.entries(names)) if (options[name] !== undefined) out[wire] = options[name];
  if (out.tools) out.tools = normalizeTools(out.tools);
  return out;
}

// Voice settings, which live in the GA session's `audio` object: [side, key].
const AUDIO_FIELDS = { voice: ["output", "voice"], speed: ["output", "speed"],
  turnDetection: ["input", "turn_detection"], transcription: ["input", "transcription"],
  noiseReduction: ["input", "noise_reduction"] };

/** Session settings as the GA session object: outputModalities ("audio" or ["audio"]), and voice,
 * turnDetection ("server_vad", "semantic_vad", an object, or null for push to talk) and transcription in `audio`. */
export function sessionFields(options) {
  const out = wireFields(options, SESSION_FIELDS);
  if (options.outputModalities !== undefined) {
    out.output_modalities = typeof options.outputModalities === "string" ? [options.outputModalities]
      : options.outputModalities;
  }
  for (const [name, [side, key]] of Object.entries(AUDIO_FIELDS)) {
    if (options[name] === undefined) continue;
    const value = name === "turnDetection" && typeof options[name] === "string" ? { type: options[name] }
      : options[name];
    out.audio ??= {};
    out.audio[side] = { ...out.audio[side], [key]: value };
  }
  return out;
}

function mergeSession(kept, update) {
  const out = { ...kept, ...update };
  if (kept.audio && update.audio) {
    out.audio = { ...kept.audio };
    for (const [side, values] of Object.entries(update.audio)) out.audio[side] = { ...kept.audio[side], ...values };
  }
  return out;
}

export class RealtimeClient extends Emitter {
  /**
   * @param {object} options  url (http(s) or ws(s) base, default http://127.0.0.1:8000), apiKey,
   *   model, framing ("json" | "msgpack"), msgpack (the codec, for msgpack framing), instructions,
   *   temperature, maxOutputTokens, tools, toolChoice, parallelToolCalls, connectTimeoutMs,
   *   silenceTimeoutMs, requestTimeoutMs,
   *   backoff ({initialMs, factor, maxMs, jitter, attempts}), WebSocket, fetch, random,
   *   device (the on-device fallback: rtgw-device.js's DeviceFallback).
   */
  constructor(options = {}) {
    super();
    this.wsUrl = realtimeUrl(options.url ?? "http://127.0.0.1:8000", options.model);
    this.apiKey = options.apiKey || null;
    this.model = options.model || null;
    this.framing = options.framing ?? "json";
    if (this.framing !== "json" && this.framing !== "msgpack") throw new TypeError("framing must be json or msgpack");
    this.msgpack = options.msgpack ?? null;
    if (this.framing === "msgpack" && !this.msgpack) throw new TypeError("msgpack framing needs the codec: { msgpack }");
    this.connectTimeoutMs = options.connectTimeoutMs ?? 15000;
    this.silenceTimeoutMs = options.silenceTimeoutMs ?? 60000;
    this.requestTimeoutMs = options.requestTimeoutMs ?? 15000;
    this.backoff = options.backoff ?? {};
    this._WebSocket = options.WebSocket ?? globalThis.WebSocket;
    if (!this._WebSocket) throw new TypeError("no WebSocket: pass one as { WebSocket } (Node 20: --experimental-websocket)");
    this._fetch = options.fetch ?? globalThis.fetch?.bind(globalThis);
    this._random = options.random ?? Math.random;
    this.sessionSettings = sessionFields(options);
    // oldest first: messages {id, type: "message", role, text}, function calls {id, type: "function_call",
    // callId, name, arguments, status} and their outputs {id, type: "function_call_output", callId, output}
    this.conversation = [];
    this.session = null; // the server's session object
    this.sessions = 0; // sessions opened (more than one: reconnected)
    this._ws = null;
    this._connecting = null;
    this._turn = null;
    this._waiters = new Set();
    this._iterators = new Set();
    this._silenceTimer = null;
    this._closed = false;
    this._ignoredErrors = new Set(); // event ids of cancels that may race with the end of a turn
    // A drained session (1001 with a reconnect hint): when to come back, the timer that does, and
    // a turn whose request the old session never took (no response.created), started on the new one.
    this._reconnectAt = null;
    this._reconnectTimer = null;
    this._resume = null;
    this._wakeups = new Set(); // the waits of a connect in progress, which close() cuts short
    this.device = options.device ?? null;
    this.device?.bind({ baseUrl: httpUrl(this.wsUrl, ""), apiKey: this.apiKey, model: this.model, fetch: this._fetch });
    this.mode = "online"; // where the latest turn was served: "online" or "device"
  }

  get connected() { return this._ws !== null && this.session !== null; }

  _setMode(mode) {
    if (this.mode === mode) return;
    this.mode = mode;
    this.emit("mode", { mode });
  }

  /** While online: download the device's model (when the gateway offers a newer one than is
   * stored), check and store it, and load it, so that a drop does not start a download at the
   * worst moment. Progress: the device's `progress` events. Resolves with the model's card. */
  prefetchOffline() {
    if (!this.device) return Promise.reject(new GatewayError("no on-device fallback was configured (device)", "no_device"));
    return this.device.prepare({ download: true });
  }
  get activeTurn() { return this._turn; }

  // --- lifecycle ---

  /** Opens a session (retrying with backoff) unless one is open; restores the conversation on it. */
  connect(policy = {}) {
    if (this._closed) return Promise.reject(new GatewayError("the client is closed", "client_closed"));
    if (this.connected) return Promise.resolve();
    this._connecting ??= this._connectWithRetry(policy)
      .catch((error) => { this._failResume(error); throw error; })
      .finally(() => { this._connecting = null; });
    return this._connecting;
  }

  /** Ends the session and any reconnect under way (a connect in progress rejects with
   * `client_closed`); the client cannot be opened again. */
  close() {
    this._closed = true;
    clearTimeout(this._reconnectTimer);
    this._reconnectTimer = null;
    this._resume = null; // it fails with the rest, just below
    const ws = this._ws;
    if (ws) ws.close(1000, "client closed");
    this._lost(ws, 1000, "client closed");
    for (const wake of [...this._wakeups]) wake();
    for (const it of this._iterators) it.end();
  }

  /** Resolves after `ms`, or at once on close(): a closed client must not open a session later. */
  _pause(ms) {
    return new Promise((resolve) => {
      const wake = () => { clearTimeout(timer); this._wakeups.delete(wake); resolve(); };
      const timer = setTimeout(wake, ms);
      this._wakeups.add(wake);
    });
  }

  /** policy: {attempts, timeoutMs} instead of the client's backoff and connect timeout (a turn
   * with a device fallback tries the gateway once, briefly, before it answers on the device). */
  async _connectWithRetry({ attempts, timeoutMs } = {}) {
    const closed = () => new GatewayError("the client is closed", "client_closed");
    const hinted = () => { // a drained gateway said when to come back
      const waitMs = this._reconnectAt === null ? 0 : this._reconnectAt - now();
      this._reconnectAt = null;
      return Math.max(0, waitMs);
    };
    const waitMs = hinted();
    if (waitMs > 0) await this._pause(waitMs);
    const delays = backoffDelays(attempts ? { ...this.backoff, attempts } : this.backoff, this._random);
    let restored = 0;
    for (let attempt = 1; ; attempt++) {
      if (this._closed) throw closed();
      try {
        restored = await this._open(timeoutMs ?? this.connectTimeoutMs);
        break;
      } catch (error) {
        if (this._closed) throw closed();
        const next = delays.next();
        // Refused (a key, a model, a restored item): the same request would be refused again.
        if (error instanceof GatewayRefused || error instanceof ServerError || next.done) throw error;
        const delayMs = Math.max(next.value, hinted()); // a session drained as it opened names its own
        this.emit("reconnecting", { attempt, delayMs, error });
        await this._pause(delayMs);
      }
    }
    const resume = this._resume;
    this._resume = null;
    if (resume && this._turn === resume) {
      this._armSilenceTimer();
      this._sendEvent({ type: "response.create", event_id: resume.createEventId, ...resume._request });
    }
    this._setMode("online");
    this.emit("connected", { session: this.session, restored });
    this._push({ type: "client.connected", session: this.session, restored });
  }

  /** One attempt: a session with our settings and, after the first, the conversation restored
   * on it; resolves with the number of items restored. A session that fails half-way is closed,
   * so that the client is never left on one that lacks the conversation. */
  _open(timeoutMs) {
    return new Promise((resolve, reject) => {
      const protocols = [...(this.framing === "msgpack" ? [MSGPACK_SUBPROTOCOL] : []), "realtime",
        ...(this.apiKey ? [KEY_SUBPROTOCOL_PREFIX + this.apiKey] : [])];
      let ws;
      try {
        ws = new this._WebSocket(this.wsUrl, protocols);
      } catch (e) {
        reject(new GatewayError(`cannot open ${this.wsUrl}: ${e.message}`, "invalid_url"));
        return;
      }
      ws.binaryType = "arraybuffer";
      let settled = false;
      const fail = (error) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        this._ws = null;
        try { ws.close(); } catch { /* already closing */ }
        reject(error);
      };
      const timer = setTimeout(() => fail(new GatewayUnreachable(
        `no session from ${this.wsUrl} within ${timeoutMs} ms`, "connect_timeout")), timeoutMs);
      this._ws = ws;
      this.session = null;
      ws.onopen = () => {
        if (this.framing === "msgpack" && ws.protocol !== MSGPACK_SUBPROTOCOL) {
          fail(new GatewayError("the server did not accept msgpack framing", "msgpack_refused"));
        }
      };
      ws.onmessage = (message) => {
        const event = this._decode(message.data);
        if (event === null) return;
        this._handle(event);
        if (!settled && event.type === "session.created") {
          if (this._closed) {
            fail(new GatewayError("the client is closed", "client_closed"));
            return;
          }
          settled = true;
          clearTimeout(timer);
          this.sessions += 1;
          this._afterOpen().then(resolve, (e) => { this._drop(ws); reject(e); });
        }
      };
      const refused = (event) => {
        settled = true;
        clearTimeout(timer);
        this._ws = null;
        if (this._closed) reject(new GatewayError("the client is closed", "client_closed"));
        else this._diagnose(event).then(reject, reject);
      };
      // Browsers follow an error with a close; Node 20's WebSocket, after a non-101 answer, does not.
      ws.onerror = (event) => { if (!settled) refused(event); };
      ws.onclose = (event) => {
        if (!settled) refused(event);
        else this._lost(ws, event.code, event.reason);
      };
    });
  }

  async _afterOpen() {
    if (Object.keys(this.sessionSettings).length) await this._updateSession(this.sessionSettings);
    // after a reconnect, or a first session after turns answered on the device
    return this.conversation.length ? this._restore() : 0;
  }

  /** Closes a session that opened but cannot be used (its settings or items did not get onto
   * it). It never carried a turn nor said `connected`, so the turn is left to the next attempt. */
  _drop(ws) {
    if (ws === this._ws) {
      this._ws = null;
      this.session = null;
    }
    for (const waiter of [...this._waiters]) waiter.reject(new GatewayError("the session was dropped", "connection_lost"));
    try { ws.close(1000, "session not usable"); } catch { /* closing anyway */ }
  }

  /** Why a handshake failed: WebSockets do not expose the HTTP status, so ask the HTTP API. */
  async _diagnose(closeEvent) {
    const detail = `the WebSocket to ${this.wsUrl} failed before a session${closeEvent?.code ? ` (code ${closeEvent.code})` : ""}`;
    if (!this._fetch) return new GatewayUnreachable(detail, "unreachable");
    const path = this.model ? `/v1/models/${encodeURIComponent(this.model)}` : "/v1/models";
    let response;
    try {
      response = await this._fetch(httpUrl(this.wsUrl, path),
        { headers: this.apiKey ? { Authorization: `Bearer ${this.apiKey}` } : {} });
    } catch (e) {
      return new GatewayUnreachable(`cannot reach the gateway at ${httpUrl(this.wsUrl, "/")}: ${e.message}`, "unreachable");
    }
    if (response.ok) return new GatewayUnreachable(detail, "handshake_failed");
    let error = {};
    try { error = (await response.json()).error ?? {}; } catch { /* not our JSON */ }
    const code = error.code ?? `http_${response.status}`;
    if ([401, 403, 404].includes(response.status)) return new GatewayRefused(response.status, code, error.message ?? detail);
    return new GatewayUnreachable(`${detail}; the gateway says HTTP ${response.status} ${code}`, code);
  }

  async _restore() {
    const items = this.conversation.filter((item) => item.type !== "message" || item.text);
    await Promise.all(items.map((item) => this._request(
      { type: "conversation.item.create", item: wireItem(item) },
      (e) => (e.type === "conversation.item.added" || e.type === "conversation.item.created") && e.item?.id === item.id)));
    return items.length;
  }

  _lost(ws, code, reason) {
    if (ws !== this._ws && ws !== null) return;
    const wasOpen = this._ws !== null;
    this._ws = null;
    this.session = null;
    this._stopSilenceTimer();
    // A drained gateway closes only once no response is in progress: a turn still here then has
    // not started (its request came too late), so it starts on the next session instead.
    const reconnectInMs = this._closed ? null : reconnectHint(code, reason);
    const turn = this._turn;
    if (!turn || turn._request === null) {
      // none, or send() is still connecting: its connect tries again or fails the turn
    } else if (reconnectInMs !== null && !turn.responseId) {
      this._resume = turn;
    } else if (this.device?.available && !this._closed && !turn.device) {
      this._continueOnDevice(turn); // the answer goes on where it stopped, on the device
    } else {
      this._turn = null;
      this._keepPartial(turn);
      for (const item of this.conversation) {
        if (item.type === "function_call" && item.status === "in_progress") item.status = "incomplete";
      }
      const silent = code === SILENCE_CLOSE_CODE;
      turn._finish({ status: "failed", error: silent ? turn._silenceError : {
        type: "connection_error", code: "connection_lost",
        message: `the connection to the gateway was lost (${code}${reason ? " " + reason : ""})` } });
    }
    for (const waiter of [...this._waiters]) waiter.reject(new GatewayError("the connection was lost", "connection_lost"));
    if (wasOpen) {
      this.emit("disconnected", { code, reason, reconnectInMs });
      this._push({ type: "client.disconnected", code, reason, reconnectInMs });
    }
    if (reconnectInMs !== null) this._scheduleReconnect(reconnectInMs);
  }

  /** Reconnect by itself after `ms` (a drain hint): to the same URL, where the load balancer now
   * routes to a replica that stays; the conversation is restored as after any reconnect. */
  _scheduleReconnect(ms) {
    this._reconnectAt = now() + ms;
    clearTimeout(this._reconnectTimer);
    this._reconnectTimer = setTimeout(() => {
      this._reconnectTimer = null;
      this.connect().catch((error) => { if (!this._closed) this.emit("reconnect_failed", { error }); });
    }, ms);
  }

  _failResume(error) {
    const turn = this._resume;
    if (!turn) return;
    this._resume = null;
    if (this._turn === turn) this._turn = null;
    this._stopSilenceTimer();
    turn._finish({ status: "failed", error: { type: "connection_error", code: error.code ?? "connection_lost",
      message: error.message } });
    this.emit("turn", turn);
  }

  // --- frames ---

  _sendEvent(event) {
    event.event_id ??= newId("evt");
    if (!this._ws || this._ws.readyState !== 1) throw new GatewayError("not connected", "not_connected");
    this._ws.send(this.framing === "msgpack" ? this.msgpack.encode(event) : JSON.stringify(event));
    return event.event_id;
  }

  _decode(data) {
    try {
      if (typeof data === "string") {
        if (this.framing === "msgpack") throw new Error("a text frame on a msgpack connection");
        return JSON.parse(data);
      }
      if (this.framing !== "msgpack") throw new Error("a binary frame on a JSON connection");
      return this.msgpack.decode(data);
    } catch (e) {
      this.emit("error", { code: "invalid_frame", message: `cannot read a server frame: ${e.message}` });
      return null;
    }
  }

  /** Sends `event`; resolves with the first server event for which `match` is true, rejects with
   * ServerError when an `error` answers it, or on timeout or a lost connection. */
  _request(event, match, timeoutMs = this.requestTimeoutMs) {
    return new Promise((resolve, reject) => {
      const waiter = {
        eventId: null,
        match,
        resolve: (e) => { done(); resolve(e); },
        reject: (e) => { done(); reject(e); },
      };
      const timer = setTimeout(() => waiter.reject(new GatewayError(
        `no answer to ${event.type} within ${timeoutMs} ms`, "request_timeout")), timeoutMs);
      const done = () => { clearTimeout(timer); this._waiters.delete(waiter); };
      this._waiters.add(waiter);
      try {
        waiter.eventId = this._sendEvent(event);
      } catch (e) {
        waiter.reject(e);
      }
    });
  }

  // --- what arrives ---

  _handle(event) {
    if (this._turn && !this._turn.device) this._armSilenceTimer();
    switch (event.type) {
      case "session.created":
      case "session.updated":
        this.session = event.session ?? null;
        break;
      case "response.created":
        if (this._turn && !this._turn.responseId) this._turn.responseId = event.response?.id ?? null;
        else if (!this._turn) this._serverTurn(event.response?.id ?? null);
        break;
      case "conversation.item.added":
      case "conversation.item.created":
        this._itemAdded(event.item ?? {}, event.previous_item_id);
        break;
      case "response.output_text.delta":
      case "response.text.delta":
      case "response.output_audio_transcript.delta":
      case "response.audio_transcript.delta":
        if (this._turn && event.response_id === this._turn.responseId) {
          this._turn.itemId ??= event.item_id ?? null;
          const item = this._item(this._turn.itemId);
          if (item) item.text += event.delta ?? "";
          this._turn._delta(event.delta ?? "");
          this.emit("delta", { turn: this._turn, text: event.delta ?? "" });
        }
        break;
      case "response.function_call_arguments.delta": {
        const item = this._item(event.item_id);
        if (item?.type === "function_call") item.arguments += event.delta ?? "";
        break;
      }
      case "response.output_item.done":
        if (event.item?.type === "function_call") this._callDone(event.item, event.response_id);
        break;
      case "response.done":
        this._responseDone(event.response ?? {});
        break;
      case "conversation.item.truncated": {
        const item = this._item(event.item_id);
        if (item) item.text = codePointSlice(item.text, event.x_text_end ?? codePointLength(item.text));
        break;
      }
      case "conversation.item.deleted":
        this.conversation = this.conversation.filter((item) => item.id !== event.item_id);
        break;
      case "response.output_audio.delta":
      case "response.audio.delta":
      case "input_audio_buffer.speech_started":
      case "input_audio_buffer.speech_stopped":
      case "input_audio_buffer.committed":
      case "conversation.item.input_audio_transcription.completed":
        this._voiceEvent(event);
        break;
      case "error":
        this._serverError(event.error ?? {});
        break;
      default:
        break;
    }
    for (const waiter of [...this._waiters]) if (waiter.match(event)) waiter.resolve(event);
    this.emit("event", event);
    this._push(event);
  }

  _item(id) {
    return id ? this.conversation.find((item) => item.id === id) ?? null : null;
  }

  _itemAdded(raw, previousId) {
    if (typeof raw.id !== "string" || this._item(raw.id)) return; // ours, already known
    const item = localItem(raw);
    if (!item) return;
    const after = this.conversation.findIndex((i) => i.id === previousId);
    if (previousId === null || previousId === undefined) {
      this.conversation.push(item);
    } else {
      this.conversation.splice(after + 1, 0, item); // -1 ("root" or unknown): first
    }
    if (item.role === "assistant" && this._turn && !this._turn.itemId) this._turn.itemId = raw.id;
  }

  /** A call's arguments are complete (or cut short): the local item takes the server's copy. */
  _callDone(raw, responseId) {
    const done = localItem(raw);
    const item = this._item(raw.id);
    if (item?.type === "function_call") Object.assign(item, { arguments: done.arguments, status: done.status });
    const call = callOf(item?.type === "function_call" ? item : done, responseId ?? null);
    const turn = this._turn;
    if (turn && (!turn.responseId || turn.responseId === responseId)) {
      turn._call(call);
      this.emit("functionCall", { turn, call });
    }
  }

  _keepPartial(turn) {
    const item = this._item(turn.itemId);
    if (item) item.text = turn.text;
  }

  _responseDone(response) {
    const turn = this._turn;
    if (!turn || (turn.responseId && response.id !== turn.responseId)) return;
    this._turn = null;
    this._stopSilenceTimer();
    const output = response.output ?? [];
    const messages = output.filter((o) => (o?.type ?? "message") === "message");
    if (messages.length && !turn.itemId) turn.itemId = messages[0].id ?? null;
    const text = messages.length ? messages.map(textOf).join("") || turn.text : turn.text;
    turn.text = text;
    this._keepPartial(turn);
    const calls = [];
    for (const raw of output) {
      if (raw?.type !== "function_call") continue;
      const item = this._item(raw.id);
      if (item?.type === "function_call") Object.assign(item, { arguments: raw.arguments ?? "", status: raw.status });
      calls.push(callOf(localItem(raw), response.id ?? null));
    }
    const details = response.status_details ?? {};
    turn._finish({ status: response.status, text, calls, metadata: response.metadata, usage: response.usage,
      reason: details.reason, error: details.error });
    this.emit("turn", turn);
    // the device reads the conversation while the app waits for the user: a later drop costs less
    if (!turn.device) this._warmDevice();
  }

  _serverError(error) {
    const eventId = error.event_id;
    if (eventId && this._ignoredErrors.delete(eventId)) return;
    const waiter = [...this._waiters].find((w) => w.eventId && w.eventId === eventId);
    if (waiter) {
      waiter.reject(new ServerError(error));
      return;
    }
    const turn = this._turn;
    if (turn && !turn.responseId && eventId === turn.createEventId) {
      // the response was refused (rate limit, one already active): no response.done will come
      this._turn = null;
      this._stopSilenceTimer();
      turn._finish({ status: "failed", error });
      this.emit("turn", turn);
      return;
    }
    this.emit("error", error);
  }

  // --- silence ---

  _armSilenceTimer() {
    this._stopSilenceTimer();
    const turn = this._turn;
    const ws = this._ws;
    this._silenceTimer = setTimeout(() => {
      if (this._turn !== turn) return;
      turn._silenceError = { type: "timeout", code: "silence_timeout",
        message: `no event from the gateway for ${this.silenceTimeoutMs / 1000} s while a turn was active` };
      try { ws?.close(SILENCE_CLOSE_CODE, "silence timeout"); } catch { /* closing anyway */ }
      this._lost(ws, SILENCE_CLOSE_CODE, "silence timeout"); // do not wait for a close that may never come
    }, this.silenceTimeoutMs);
  }

  _stopSilenceTimer() {
    clearTimeout(this._silenceTimer);
    this._silenceTimer = null;
  }

  // --- operations ---

  /** Session settings ({instructions, temperature, maxOutputTokens, tools, ..., outputModalities,
   * voice, turnDetection, transcription}); kept for later sessions. */
  async configure(settings) {
    this.sessionSettings = mergeSession(this.sessionSettings, sessionFields(settings));
    if (this.connected) await this._updateSession(this.sessionSettings);
  }

  _updateSession(fields) {
    return this._request({ type: "session.update", session: { type: "realtime", ...fields } },
      (e) => e.type === "session.updated");
  }

  /** A user message and the request to answer it; resolves with the Turn once both are sent.
   * options: maxOutputTokens, temperature, instructions, metadata, tools, toolChoice,
   * parallelToolCalls (for this response only). */
  async send(text, options = {}) {
    const item = { id: newId("item"), type: "message", role: "user", text };
    return this._startTurn([item], item.id, options);
  }

  /** Answers function calls and continues: a `function_call_output` item for each entry of
   * `outputs` ({callId: output}; a string as it is, anything else as JSON), then the next
   * response; resolves with its Turn. Throws for a call id that no call of the conversation has. */
  async sendToolOutputs(outputs, options = {}) {
    if (this._turn) throw new TurnInProgress();
    const entries = Object.entries(outputs ?? {});
    if (!entries.length) throw new TypeError("no outputs: give at least one {callId: output}");
    const known = new Set(this.conversation.filter((i) => i.type === "function_call").map((i) => i.callId));
    const unknown = entries.find(([callId]) => !known.has(callId));
    if (unknown) throw new GatewayError(`no function call in the conversation has the call id ${JSON.stringify(unknown[0])}`,
      "unknown_call_id");
    const items = entries.map(([callId, output]) => ({ id: newId("item"), type: "function_call_output", callId,
      output: typeof output === "string" ? output : JSON.stringify(output) }));
    return this._startTurn(items, null, options);
  }

  /** `sendToolOutputs({[callId]: output}, options)`: answers one call and continues. */
  async sendToolOutput(callId, output, options = {}) {
    return this.sendToolOutputs({ [callId]: output }, options);
  }

  /** Sends `items` (they join the conversation once a session is open) and the response.create. */
  async _startTurn(items, userItemId, options) {
    if (this._turn) throw new TurnInProgress();
    const turn = new Turn(userItemId);
    this._turn = turn;
    try {
      // with a device fallback the gateway gets one quick try, and the device answers if it fails
      await this.connect(this.device ? { attempts: 1, timeoutMs: Math.min(this.connectTimeoutMs,
        this.device.probeTimeoutMs ?? this.connectTimeoutMs) } : {});
      // a session lost between the connect and here: nothing was sent, say so now
      if (!this.connected) throw new GatewayError("the connection was lost", "connection_lost");
    } catch (e) {
      if (this.device && this._turn === turn && !this._closed && !(e instanceof GatewayRefused)
        && !(e instanceof ServerError) && await this._deviceReady()) {
        this.conversation.push(...items);
        this._deviceTurn(turn, options);
        return turn;
      }
      if (this._turn === turn) this._turn = null;
      this._stopSilenceTimer();
      turn._finish({ status: "failed", error: { type: "connection_error", code: e.code, message: e.message } });
      throw e;
    }
    turn._startedAt = now(); // time to first token counts from the request, not the reconnect
    this.conversation.push(...items);
    const response = wireFields(options, RESPONSE_FIELDS);
    turn._request = Object.keys(response).length ? { response } : {};
    this._armSilenceTimer();
    for (const item of items) {
      this._request({ type: "conversation.item.create", item: wireItem(item) },
        (e) => (e.type === "conversation.item.added" || e.type === "conversation.item.created") && e.item?.id === item.id)
        .catch((error) => {
          if (!(error instanceof ServerError)) return; // lost: the turn fails through _lost
          this.conversation = this.conversation.filter((i) => i.id !== item.id);
        });
    }
    try {
      this._sendEvent({ type: "response.create", event_id: turn.createEventId, ...turn._request });
    } catch {
      // The socket is closing: its close decides (a drain starts the turn on the next session;
      // any other close fails it with connection_lost).
    }
    // While the gateway answers, the device reads the conversation up to this answer: if the
    // socket drops mid-answer, it has only the text shown so far left to read.
    this._warmDevice(response.instructions);
    return turn;
  }

  /** Sends a message and resolves with the whole answer's result. */
  async ask(text, options = {}) {
    return (await this.send(text, options)).result;
  }

  /** Stops the active turn; resolves with its result (status `cancelled` unless it had ended). */
  async cancel() {
    const turn = this._turn;
    if (!turn) return null;
    if (turn.device) { // on the device: its generation stops at once
      turn._abort.abort();
      return turn.result;
    }
    if (turn === this._resume) { // waiting for the next session: it never started
      this._resume = null;
      this._turn = null;
      this._stopSilenceTimer();
      turn._finish({ status: "cancelled", reason: "client_cancelled" });
      this.emit("turn", turn);
      return turn.result;
    }
    if (this.connected) {
      const eventId = newId("evt");
      this._ignoredErrors.add(eventId);
      this._sendEvent({ type: "response.cancel", event_id: eventId });
    }
    return turn.result;
  }

  /** Barge-in: stop the answer and keep only its first `heardChars` characters (code points) in
   * the conversation, here and on the server. Without an active turn it cuts the last assistant
   * message. Resolves with {itemId, text, method: "truncate" | "replace" | "local"} or null. */
  async interrupt(heardChars, { itemId } = {}) {
    const turn = this._turn;
    if (turn) await this.cancel();
    const target = itemId ?? (turn ? turn.itemId
      : [...this.conversation].reverse().find((i) => i.type === "message" && i.role === "assistant")?.id);
    const item = this._item(target);
    if (!item || item.role !== "assistant") return null; // cancelled before its first token: nothing to cut
    const end = Math.max(0, Math.min(Math.floor(heardChars), codePointLength(item.text)));
    const heard = codePointSlice(item.text, end);
    if (!this.connected) {
      item.text = heard; // the next session is restored from the local copy
      return { itemId: item.id, text: heard, method: "local" };
    }
    try {
      await this._request({ type: "conversation.item.truncate", item_id: item.id, content_index: 0,
        audio_end_ms: 0, x_text_end: end }, (e) => e.type === "conversation.item.truncated" && e.item_id === item.id);
      return { itemId: item.id, text: this._item(item.id)?.text ?? heard, method: "truncate" };
    } catch (error) {
      if (!(error instanceof ServerError)) throw error;
    }
    // a server without x_text_end: delete the item and create it again with the heard text
    const index = this.conversation.indexOf(item);
    const previous = index > 0 ? this.conversation[index - 1].id : "root";
    await this._request({ type: "conversation.item.delete", item_id: item.id },
      (e) => e.type === "conversation.item.deleted" && e.item_id === item.id);
    const replacement = { id: item.id, type: "message", role: "assistant", text: heard };
    await this._request({ type: "conversation.item.create", previous_item_id: previous, item: wireItem(replacement) },
      (e) => (e.type === "conversation.item.added" || e.type === "conversation.item.created") && e.item?.id === item.id);
    return { itemId: item.id, text: heard, method: "replace" };
  }

  // --- on the device ---

  /** A ready device reads the conversation so far (its KV then holds it); see DeviceFallback.warm. */
  _warmDevice(instructions) {
    if (!this.device?.available) return;
    this.device.warm?.({ conversation: [...this.conversation],
      instructions: instructions ?? this.sessionSettings.instructions ?? "" });
  }

  /** Whether the device can answer now: its model stored and loaded (loading it if need be). */
  async _deviceReady() {
    if (this.device.available) return true;
    try {
      await this.device.prepare({ download: false });
      return true;
    } catch {
      return false; // no model on the device: the turn fails as without a fallback
    }
  }

  /** Answers `turn` on the device from the conversation (its items already in it). */
  _deviceTurn(turn, options) {
    turn._startedAt = now();
    const request = { instructions: options.instructions ?? this.sessionSettings.instructions ?? "",
      maxOutputTokens: options.maxOutputTokens ?? this.sessionSettings.max_output_tokens,
      temperature: options.temperature ?? this.sessionSettings.temperature };
    const tools = options.tools ?? this.sessionSettings.tools;
    const choice = options.toolChoice ?? this.sessionSettings.tool_choice ?? "auto";
    const response = new DeviceResponse(undefined, { after: this.conversation.at(-1)?.id ?? null });
    this._runOnDevice(turn, response, { ...request, conversation: [...this.conversation] },
      tools?.length && choice !== "none" && choice !== "auto" ? {
        type: "invalid_request_error", code: "unsupported_on_device",
        message: "the on-device model cannot call tools; this turn requires a call (tool_choice)" } : null);
  }

  /** The gateway went away in the middle of `turn`'s answer: the device writes the rest. */
  _continueOnDevice(turn) {
    this._keepPartial(turn);
    const item = this._item(turn.itemId);
    const conversation = this.conversation.filter((i) => i !== item);
    const response = DeviceResponse.resume(turn.responseId, item ? turn.itemId : null, turn.text,
      { after: conversation.at(-1)?.id ?? null });
    const request = turn._request?.response ?? {};
    this._runOnDevice(turn, response, { conversation, continueText: item ? turn.text : "",
      instructions: request.instructions ?? this.sessionSettings.instructions ?? "",
      maxOutputTokens: request.max_output_tokens ?? this.sessionSettings.max_output_tokens,
      temperature: request.temperature ?? this.sessionSettings.temperature }, null, true);
  }

  async _runOnDevice(turn, response, request, refusal, resumed = false) {
    turn.device = true;
    turn._abort = new AbortController();
    this._setMode("device");
    const feed = (events) => { for (const event of events) this._handle(event); };
    if (!resumed) feed(response.created());
    let status = "completed";
    let reason = null;
    let error = refusal;
    let usage = {};
    if (refusal) status = "failed";
    else {
      try {
        let produced = 0;
        for await (const part of this.device.answer({ ...request, signal: turn._abort.signal })) {
          if (part.done) {
            usage = part.usage ?? {};
            if (part.finishReason === "length") [status, reason] = ["incomplete", "max_output_tokens"];
          } else {
            produced += 1;
            feed(response.text(part.text));
          }
          if (turn._abort.signal.aborted) break;
        }
        if (turn._abort.signal.aborted) [status, reason] = ["cancelled", "client_cancelled"];
        else if (!produced && resumed) [status, reason] = ["incomplete", "device_continued"];
      } catch (e) {
        if (turn._abort.signal.aborted || e?.cancelled) [status, reason] = ["cancelled", "client_cancelled"];
        else {
          status = "failed";
          error = { type: "device_error", code: e?.code ?? "device_failed", message: e?.message ?? String(e) };
        }
      }
    }
    feed(response.finish(status, { reason, error, usage, metadata: { x_tier: "device" } }));
    if (this._turn === turn) { // a response.done for another id (a resumed one with no message)
      this._turn = null;
      turn._finish({ status, reason, error, usage, metadata: { x_tier: "device" } });
      this.emit("turn", turn);
    }
  }

  // --- voice ---

  /** A response nobody here asked for (server VAD committed the user's speech): a turn of its own. */
  _serverTurn(responseId) {
    const turn = new Turn(null);
    turn.responseId = responseId;
    turn._request = {};
    this._turn = turn;
    this._armSilenceTimer();
    this.emit("serverTurn", turn);
  }

  _voiceEvent(event) {
    const turn = this._turn;
    switch (event.type) {
      case "response.output_audio.delta":
      case "response.audio.delta": {
        if (!turn || event.response_id !== turn.responseId) return; // a cancelled response's last words
        const pcm = pcmFromWire(event.delta);
        turn.itemId ??= event.item_id ?? null;
        turn._audio(pcm);
        this.emit("audio", { turn, itemId: event.item_id ?? null, responseId: event.response_id, pcm });
        return;
      }
      case "input_audio_buffer.speech_started":
        this.emit("speechStarted", { audioStartMs: event.audio_start_ms ?? 0, itemId: event.item_id ?? null });
        return;
      case "input_audio_buffer.speech_stopped":
        this.emit("speechStopped", { audioEndMs: event.audio_end_ms ?? 0, itemId: event.item_id ?? null });
        return;
      case "input_audio_buffer.committed":
        this.emit("committed", { itemId: event.item_id, previousItemId: event.previous_item_id ?? null });
        return;
      default: { // the user's words, transcribed
        const item = this._item(event.item_id);
        if (item?.type === "message") item.text = event.transcript ?? "";
        if (turn) {
          turn.userTranscript = event.transcript ?? "";
          turn.emit("transcript", turn.userTranscript);
        }
        this.emit("transcript", { itemId: event.item_id, transcript: event.transcript ?? "" });
      }
    }
  }

  /** Sends PCM16 mono at 24 kHz (an Int16Array, or its bytes) to the input buffer, cut into
   * appends the gateway accepts: base64 on JSON, raw bytes on msgpack. Throws when not connected. */
  appendAudio(pcm) {
    const bytes = pcmBytes(pcm);
    for (let start = 0; start < bytes.length; start += MAX_APPEND_BYTES) {
      const piece = bytes.subarray(start, start + MAX_APPEND_BYTES);
      this._sendEvent({ type: "input_audio_buffer.append",
        audio: this.framing === "msgpack" ? piece : base64FromBytes(piece) });
    }
  }

  /** Push to talk: the input buffer becomes a user item (transcribed by the server); resolves
   * with its id. Rejects (ServerError) for less than 100 ms of audio. */
  async commitAudio() {
    const event = await this._request({ type: "input_audio_buffer.commit" },
      (e) => e.type === "input_audio_buffer.committed");
    return event.item_id;
  }

  async clearAudio() {
    await this._request({ type: "input_audio_buffer.clear" }, (e) => e.type === "input_audio_buffer.cleared");
  }

  /** Push to talk: commit the input buffer, then start the answer; resolves with its Turn. */
  async respond(options = {}) {
    if (this._turn) throw new TurnInProgress();
    await this.commitAudio();
    return this._startTurn([], null, options);
  }

  /** Voice barge-in: keep of the spoken item `itemId` what `audioEndMs` of its audio said, here and
   * on the server (`conversation.item.truncate` with `audio_end_ms`, then the item read back for
   * its words). Resolves with {itemId, audioEndMs, text}. */
  async truncateAudio(itemId, audioEndMs) {
    const end = Math.max(0, Math.floor(audioEndMs));
    await this._request({ type: "conversation.item.truncate", item_id: itemId, content_index: 0, audio_end_ms: end },
      (e) => e.type === "conversation.item.truncated" && e.item_id === itemId);
    const turn = this._turn;
    if (turn && turn.itemId === itemId) await turn.result; // cancelled by the server: its end sets the item first
    const retrieved = await this._request({ type: "conversation.item.retrieve", item_id: itemId },
      (e) => e.type === "conversation.item.retrieved" && e.item?.id === itemId);
    const text = textOf(retrieved.item);
    const item = this._item(itemId);
    if (item) item.text = text;
    return { itemId, audioEndMs: end, text };
  }

  /** Every server event (and `client.connected` / `client.disconnected`) as an async iterator,
   * from now until `close()` or the loop is left. */
  events() {
    const queue = [];
    let wake = null;
    let ended = false;
    const sink = {
      push: (e) => { queue.push(e); wake?.(); },
      end: () => { ended = true; wake?.(); },
    };
    this._iterators.add(sink);
    const iterators = this._iterators;
    return {
      async next() {
        while (!queue.length && !ended) await new Promise((resolve) => { wake = resolve; });
        wake = null;
        return queue.length ? { value: queue.shift(), done: false } : { value: undefined, done: true };
      },
      async return() {
        iterators.delete(sink);
        ended = true;
        return { value: undefined, done: true };
      },
      [Symbol.asyncIterator]() { return this; },
    };
  }

  _push(event) {
    for (const sink of this._iterators) sink.push(event);
  }
}
