// Types of rtgw.js: a client for the rt-llm-gateway's Realtime sessions.

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

export interface ResponseOptions extends SessionSettings {
  metadata?: Record<string, string>;
}

export interface ClientOptions extends SessionSettings {
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
  /** Time to the first text delta, measured here; null when none came. */
  ttftMs: number | null;
  elapsedMs: number;
}

type Unsubscribe = () => void;

export class Turn implements AsyncIterable<string> {
  readonly userItemId: string | null;
  readonly responseId: string | null;
  readonly itemId: string | null;
  /** The text streamed so far. */
  readonly text: string;
  /** The function calls so far. */
  readonly calls: FunctionCall[];
  readonly done: boolean;
  /** Resolves when the turn ends; never rejects. */
  readonly result: Promise<TurnResult>;
  on(type: "delta", fn: (text: string) => void): Unsubscribe;
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

export class RealtimeClient {
  constructor(options?: ClientOptions);
  readonly wsUrl: string;
  /** The local copy of the conversation, oldest first. */
  readonly conversation: ConversationItem[];
  readonly session: Record<string, unknown> | null;
  /** Sessions opened so far (more than one: the client reconnected). */
  readonly sessions: number;
  readonly connected: boolean;
  readonly activeTurn: Turn | null;

  connect(): Promise<void>;
  /** Ends the session and any reconnect under way (a connect in progress rejects with
   * `client_closed`, and no session opens after it); the client cannot be opened again. */
  close(): void;
  configure(settings: SessionSettings): Promise<void>;
  send(text: string, options?: ResponseOptions): Promise<Turn>;
  ask(text: string, options?: ResponseOptions): Promise<TurnResult>;
  /** Answers function calls (`{[callId]: output}`; a string as it is, anything else as JSON) and
   * starts the next response. Rejects with code `unknown_call_id` for a call the conversation lacks. */
  sendToolOutputs(outputs: Record<string, unknown>, options?: ResponseOptions): Promise<Turn>;
  sendToolOutput(callId: string, output: unknown, options?: ResponseOptions): Promise<Turn>;
  cancel(): Promise<TurnResult | null>;
  interrupt(heardChars: number, options?: { itemId?: string }): Promise<InterruptResult | null>;
  events(): AsyncIterableIterator<RealtimeEvent>;

  on(type: "event", fn: (event: RealtimeEvent) => void): Unsubscribe;
  on(type: "delta", fn: (delta: { turn: Turn; text: string }) => void): Unsubscribe;
  on(type: "turn", fn: (turn: Turn) => void): Unsubscribe;
  on(type: "functionCall", fn: (info: { turn: Turn; call: FunctionCall }) => void): Unsubscribe;
  on(type: "error", fn: (error: ServerErrorBody) => void): Unsubscribe;
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
