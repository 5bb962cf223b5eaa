// Types of rtgw.js: a client for the rt-llm-gateway's Realtime sessions. The browser's voice
// classes (Microphone, AudioPlayer, VoiceSession) are in rtgw-voice.d.ts.

export const MSGPACK_SUBPROTOCOL: "x-openai-realtime-msgpack";

export class GatewayError extends Error {
  code: string;
}
/** The gateway could not be reached (refused connection, DNS, timeout, a 5xx at the handshake). */
export class GatewayUnreachable extends GatewayError {}
/** The gateway answered and said no (401/403 key, 404 model): retrying will not help. */
export class GatewayRefused extends GatewayError {
  status: number;
}
/** An `error` event answering one of the client's requests. */
export class ServerError extends GatewayError {
  param: string | null;
  eventId: string | null;
}
export class TurnInProgress extends GatewayError {}

export interface MsgpackCodec {
  encode(value: unknown): Uint8Array;
  decode(data: ArrayBuffer | Uint8Array): unknown;
}

export interface Backoff {
  initialMs?: number; // 250
  factor?: number; // 2
  maxMs?: number; // 8000
  jitter?: number; // 0.5: each delay drawn from [(1 - jitter) d, d]
  attempts?: number; // 6 connection attempts per operation, the first immediate
}

/** A function the model may call (the Realtime shape; the chat completions shape
 * `{type: "function", function: {...}}` is accepted and unwrapped). */
export interface FunctionTool {
  type: "function";
  name: string;
  description?: string;
  /** The arguments' JSON schema (an object schema). */
  parameters?: Record<string, unknown>;
}

export type ToolChoice = "auto" | "none" | "required" | { type: "function"; name: string };

export interface SessionSettings {
  instructions?: string;
  temperature?: number;
  maxOutputTokens?: number | "inf";
  tools?: FunctionTool[] | { type: "function"; function: Record<string, unknown> }[];
  /** "auto" (text or calls), "none", "required" (the answer is a call), or one named function. */
  toolChoice?: ToolChoice;
  /** false: at most one call per response. */
  parallelToolCalls?: boolean;
}

export interface ServerVad {
  type: "server_vad";
  threshold?: number; // 0..1, 0.5
  prefix_padding_ms?: number; // 300
  silence_duration_ms?: number; // 500
  create_response?: boolean; // true: the server answers each utterance
  interrupt_response?: boolean; // true: speech over an answer cancels it
  idle_timeout_ms?: number | null; // 5000..30000: answer a silent user after this much audio
}

/** The gateway runs it as server VAD whose silence follows the eagerness (low 1000 ms, medium and
 * auto 600, high 300): there is no turn model yet. */
export interface SemanticVad {
  type: "semantic_vad";
  eagerness?: "low" | "medium" | "high" | "auto"; // "auto"
  create_response?: boolean;
  interrupt_response?: boolean;
}

export type TurnDetection = ServerVad | SemanticVad;

/** Voice settings (sent in the GA session's `audio` object). */
export interface VoiceSettings {
  /** ["audio"]: answers are spoken (their words stream as the turn's text); ["text"]: written. */
  outputModalities?: ("audio" | "text")[] | "audio" | "text";
  voice?: "alloy" | "ash" | "ballad" | "coral" | "echo" | "sage" | "shimmer" | "verse" | "marin" | "cedar";
  /** Server or semantic VAD ("server_vad", "semantic_vad" or their settings), or null for push to
   * talk (`commitAudio`, `respond`). */
  turnDetection?: TurnDetection | "server_vad" | "semantic_vad" | null;
  transcription?: { model?: string; language?: string; prompt?: string } | null;
}

export interface ResponseOptions extends SessionSettings {
  metadata?: Record<string, string>;
}

export interface ClientOptions extends SessionSettings, VoiceSettings {
  /** The gateway's base URL, http(s) or ws(s); default http://127.0.0.1:8000. */
  url?: string;
  apiKey?: string | null;
  /** Sent as `?model=`; the server's default when left out. */
  model?: string | null;
  framing?: "json" | "msgpack";
  /** The codec for msgpack framing: `import * as msgpack from "rtgw-client/msgpack"`. */
  msgpack?: MsgpackCodec;
  connectTimeoutMs?: number; // 15000: until the session's first event
  silenceTimeoutMs?: number; // 60000: the longest wait for a server event while a turn runs
  requestTimeoutMs?: number; // 15000: acknowledgements (session.update, truncate, restore)
  backoff?: Backoff;
  /** A WebSocket constructor; default `globalThis.WebSocket`. */
  WebSocket?: unknown;
  /** Used to tell a refused key from an unreachable server after a failed handshake. */
  fetch?: typeof fetch;
  random?: () => number;
  /** The on-device fallback (rtgw-device.js's DeviceFallback): turns the gateway cannot take are
   * answered on the device from the same conversation. */
  device?: DeviceLike | null;
}

/** What the client asks of an on-device fallback (rtgw-device.js's DeviceFallback implements it). */
export interface DeviceLike {
  bind(info: { baseUrl: string; apiKey: string | null; model: string | null; fetch?: typeof fetch }): void;
  readonly available: boolean;
  readonly probeTimeoutMs?: number;
  prepare(options?: { download?: boolean }): Promise<unknown>;
  answer(request: { conversation: ConversationItem[]; instructions?: string; maxOutputTokens?: number;
    temperature?: number; continueText?: string; signal: AbortSignal }): AsyncIterable<
    { text: string; done?: undefined } | { done: true; finishReason: string; usage: Usage }>;
  warm?(request: { conversation: ConversationItem[]; instructions?: string }): Promise<void> | null;
}

/** An on-device answer told as the gateway's server events. */
export class DeviceResponse {
  /** `after`: the conversation's last item when the response starts (its message's previous_item_id). */
  constructor(responseId?: string, options?: { after?: string | null });
  static resume(responseId: string, itemId: string | null, text: string,
    options?: { after?: string | null }): DeviceResponse;
  readonly id: string;
  created(): RealtimeEvent[];
  text(text: string): RealtimeEvent[];
  finish(status: TurnResult["status"], fields?: { reason?: string | null; error?: ServerErrorBody | null;
    usage?: Usage; metadata?: Record<string, string> }): RealtimeEvent[];
}

export interface MessageItem {
  id: string;
  type: "message";
  role: "system" | "user" | "assistant";
  text: string;
}

export interface FunctionCallItem {
  id: string;
  type: "function_call";
  callId: string;
  name: string;
  /** The arguments object as JSON text, as generated; it grows while the call streams. */
  arguments: string;
  status: "in_progress" | "completed" | "incomplete";
}

export interface FunctionCallOutputItem {
  id: string;
  type: "function_call_output";
  callId: string;
  output: string;
}

export type ConversationItem = MessageItem | FunctionCallItem | FunctionCallOutputItem;

/** A function call of a response, once its arguments are complete (or cut short). */
export interface FunctionCall {
  callId: string;
  name: string;
  /** The arguments object as JSON text, as generated. */
  arguments: string;
  /** The arguments parsed; null when they are not a JSON object (a call cut short). */
  parsed: Record<string, unknown> | null;
  itemId: string;
  responseId: string | null;
  /** incomplete: the output ended inside the call (a length limit, a cancel). */
  status: "completed" | "incomplete";
  /** status "completed" and the arguments parsed. */
  complete: boolean;
}

export interface ServerErrorBody {
  type?: string;
  code: string;
  message: string;
  param?: string | null;
  event_id?: string | null;
}

export interface Usage {
  total_tokens?: number;
  input_tokens?: number;
  output_tokens?: number;
  input_token_details?: { cached_tokens?: number; text_tokens?: number };
  output_token_details?: { text_tokens?: number };
}

export interface TurnResult {
  status: "completed" | "incomplete" | "cancelled" | "failed";
  text: string;
  /** The functions the response called, in order: answer them with `sendToolOutput(s)`. */
  calls: FunctionCall[];
  responseId: string | null;
  /** The assistant message; null when the response wrote none (only calls, or cancelled first). */
  itemId: string | null;
  /** The user message it answers; null for a turn that answers function calls. */
  userItemId: string | null;
  /** The client's metadata plus the gateway's: x_tier, x_route, x_confidence, ... */
  metadata: Record<string, string>;
  usage: Usage;
  /** Why it was cancelled or incomplete (client_cancelled, max_output_tokens, ...). */
  reason: string | null;
  /** Why it failed: the server's error, or connection_lost / silence_timeout. */
  error: ServerErrorBody | null;
  tier: string | null;
  cachedTokens: number;
  /** Time to the first text (or transcript) delta, measured here; null when none came. */
  ttftMs: number | null;
  elapsedMs: number;
}

export type Unsubscribe = () => void;

/** The event base of the client, its turns and the voice classes of rtgw-voice.js. */
export class Emitter {
  /** Calls `fn(payload)` on each `type` event; returns a function that unsubscribes. */
  on(type: string, fn: (payload: any) => void): Unsubscribe;
  /** Resolves with the next `type` event's payload. */
  once(type: string): Promise<any>;
  /** Calls the listeners of `type`; one that throws is reported and the others still run. */
  emit(type: string, payload?: unknown): void;
}

export class Turn extends Emitter implements AsyncIterable<string> {
  readonly userItemId: string | null;
  readonly responseId: string | null;
  readonly itemId: string | null;
  /** The text streamed so far. */
  readonly text: string;
  /** The function calls so far. */
  readonly calls: FunctionCall[];
  readonly done: boolean;
  /** A spoken answer: ms of its audio received so far. */
  readonly audioMs: number;
  /** The user's speech this answer is for, once transcribed. */
  readonly userTranscript: string | null;
  /** Resolves when the turn ends; never rejects. */
  readonly result: Promise<TurnResult>;
  /** Text deltas; for a spoken answer, its transcript deltas (the words before their audio). */
  on(type: "delta", fn: (text: string) => void): Unsubscribe;
  /** A spoken answer's audio: PCM16 at 24 kHz. */
  on(type: "audio", fn: (pcm: Int16Array) => void): Unsubscribe;
  on(type: "transcript", fn: (userTranscript: string) => void): Unsubscribe;
  on(type: "functionCall", fn: (call: FunctionCall) => void): Unsubscribe;
  on(type: "done", fn: (result: TurnResult) => void): Unsubscribe;
  [Symbol.asyncIterator](): AsyncIterator<string>;
}

export interface InterruptResult {
  itemId: string;
  /** What the conversation keeps of the assistant's message. */
  text: string;
  /** truncate: x_text_end; replace: delete and re-create (a server without it); local: offline. */
  method: "truncate" | "replace" | "local";
}

/** A server event, or `client.connected` / `client.disconnected`. */
export type RealtimeEvent = { type: string; [field: string]: unknown };

export class RealtimeClient extends Emitter {
  constructor(options?: ClientOptions);
  readonly wsUrl: string;
  /** The local copy of the conversation, oldest first. */
  readonly conversation: ConversationItem[];
  readonly session: Record<string, unknown> | null;
  /** Sessions opened so far (more than one: the client reconnected). */
  readonly sessions: number;
  readonly connected: boolean;
  readonly activeTurn: Turn | null;
  /** Where the latest turn was served ("mode" events on change). */
  readonly mode: "online" | "device";
  readonly device: DeviceLike | null;

  /** `policy`: one attempt and a shorter timeout instead of the backoff (what a turn does when a
   * device can answer instead). */
  connect(policy?: { attempts?: number; timeoutMs?: number }): Promise<void>;
  /** While online: download (once), check, store and load the device's model. */
  prefetchOffline(): Promise<unknown>;
  /** Ends the session and any reconnect under way (a connect in progress rejects with
   * `client_closed`, and no session opens after it); the client cannot be opened again. */
  close(): void;
  configure(settings: SessionSettings & VoiceSettings): Promise<void>;
  send(text: string, options?: ResponseOptions): Promise<Turn>;
  ask(text: string, options?: ResponseOptions): Promise<TurnResult>;
  /** Answers function calls (`{[callId]: output}`; a string as it is, anything else as JSON) and
   * starts the next response. Rejects with code `unknown_call_id` for a call the conversation lacks. */
  sendToolOutputs(outputs: Record<string, unknown>, options?: ResponseOptions): Promise<Turn>;
  sendToolOutput(callId: string, output: unknown, options?: ResponseOptions): Promise<Turn>;
  cancel(): Promise<TurnResult | null>;
  interrupt(heardChars: number, options?: { itemId?: string }): Promise<InterruptResult | null>;
  events(): AsyncIterableIterator<RealtimeEvent>;

  /** PCM16 mono at 24 kHz to the input buffer (base64 on JSON, raw bytes on msgpack), in pieces
   * of at most 128 KiB; throws when not connected or for an odd byte count. */
  appendAudio(pcm: Int16Array | Uint8Array | ArrayBuffer): void;
  /** Push to talk: the buffer becomes a user item; resolves with its id. */
  commitAudio(): Promise<string>;
  clearAudio(): Promise<void>;
  /** Push to talk: commit, then start the answer. */
  respond(options?: ResponseOptions): Promise<Turn>;
  /** Keep of spoken item `itemId` the words its first `audioEndMs` said, here and on the server. */
  truncateAudio(itemId: string, audioEndMs: number): Promise<AudioCut>;

  on(type: "event", fn: (event: RealtimeEvent) => void): Unsubscribe;
  on(type: "delta", fn: (delta: { turn: Turn; text: string }) => void): Unsubscribe;
  on(type: "turn", fn: (turn: Turn) => void): Unsubscribe;
  on(type: "functionCall", fn: (info: { turn: Turn; call: FunctionCall }) => void): Unsubscribe;
  on(type: "error", fn: (error: ServerErrorBody) => void): Unsubscribe;
  /** An answer the server started by itself (server VAD committed the user's speech). */
  on(type: "serverTurn", fn: (turn: Turn) => void): Unsubscribe;
  on(type: "audio", fn: (info: { turn: Turn; itemId: string | null; responseId: string; pcm: Int16Array }) => void): Unsubscribe;
  /** Server VAD heard speech start; it cancels an answer in progress (reason turn_detected). */
  on(type: "speechStarted", fn: (info: { audioStartMs: number; itemId: string | null }) => void): Unsubscribe;
  on(type: "speechStopped", fn: (info: { audioEndMs: number; itemId: string | null }) => void): Unsubscribe;
  on(type: "committed", fn: (info: { itemId: string; previousItemId: string | null }) => void): Unsubscribe;
  /** The user's speech in item `itemId`, transcribed (also the item's text in `conversation`). */
  on(type: "transcript", fn: (info: { itemId: string; transcript: string }) => void): Unsubscribe;
  on(type: "connected", fn: (info: { session: Record<string, unknown>; restored: number }) => void): Unsubscribe;
  /** `reconnectInMs`: the gateway drained the session (1001 with a reconnect hint) and the client
   * reconnects by itself after that long; null for any other close. */
  on(type: "disconnected", fn: (info: { code: number; reason: string; reconnectInMs: number | null }) => void): Unsubscribe;
  on(type: "reconnecting", fn: (info: { attempt: number; delayMs: number; error: GatewayError }) => void): Unsubscribe;
  /** The reconnect after a drain gave up (every attempt failed); the next operation tries again.
   * Not emitted once the client is closed. */
  on(type: "reconnect_failed", fn: (info: { error: GatewayError }) => void): Unsubscribe;
  once(type: string): Promise<any>;
}

export function realtimeUrl(url: string, model?: string | null): string;
/** The gateway's drain hint: for a close with 1001 and the reason `{"reconnect":true,"after_ms":N}`,
 * N (ms, at most 60000); null for any other close. */
export function reconnectHint(code: number, reason: string): number | null;
export function backoffDelays(backoff?: Backoff, random?: () => number): Generator<number>;
export function newId(prefix: string): string;
/** A call's arguments parsed: the object, or null when they are not a JSON object. */
export function parseArguments(text: string): Record<string, unknown> | null;
export function normalizeTools(tools: unknown[]): FunctionTool[];
/** Length in Unicode code points, the unit of `heardChars` and the gateway's x_text_end. */
export function codePointLength(text: string): number;
export function codePointSlice(text: string, end: number): string;

// --- voice: the wire side (the browser's is rtgw-voice.d.ts) ---

/** The Realtime API's audio/pcm: 16-bit little-endian mono at 24 kHz. */
export const SAMPLE_RATE: 24000;

export interface AudioCut {
  itemId: string;
  /** The ms of the item's audio that were played, as sent in the truncate. */
  audioEndMs: number;
  /** What the item keeps: the words said by then. */
  text: string;
}

export function sessionFields(options: SessionSettings & VoiceSettings): Record<string, unknown>;
export function base64FromBytes(bytes: Uint8Array): string;
export function bytesFromBase64(text: string): Uint8Array;
