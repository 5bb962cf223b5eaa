// Types of rtgw-device.js: the on-device fallback (llama.cpp in WebAssembly, the model in Cache Storage).

import { ConversationItem, DeviceLike, Emitter, GatewayError, Usage } from "./rtgw.js";

export class DeviceModelError extends GatewayError {}

/** The model card the gateway publishes (`x_device` of GET /v1/models/{id}). */
export interface DeviceCard {
  model: string;
  url: string;
  format: "gguf";
  bytes: number;
  sha256: string;
  family: string;
  context_length: number;
}

export interface Message { role: "system" | "user" | "assistant"; content: string }

export const FAMILY_NAMES: readonly string[];
export function pyJson(value: unknown): string;
export function conversationMessages(conversation: ConversationItem[], instructions: string, family?: string): Message[];
/** `next: "user"` opens the user's turn (the start of the question after an answer). */
export function renderPrompt(family: string, messages: Message[], continueText?: string,
  options?: { next?: "assistant" | "user" }): string;

export interface GeneratePart { text: string; done?: undefined }
export interface GenerateEnd { done: true; finishReason: "stop" | "length" | string; usage: Usage }

/** The engine interface: llama.cpp in WebAssembly here; llama.rn or another runtime elsewhere. */
export interface DeviceEngine {
  load(model: Blob | string): Promise<void>;
  /** The form the engine keeps the model file in (called once, before it is stored); optional. */
  storedForm?(file: ArrayBuffer): ArrayBuffer;
  generate(request: { prompt: string; maxTokens: number; temperature?: number; signal?: AbortSignal }):
    AsyncIterable<GeneratePart | GenerateEnd>;
  readonly loaded?: boolean;
  readonly threads?: number;
}

export class ModelStore {
  constructor(options?: { caches?: CacheStorage; fetch?: typeof fetch; base?: string; maxAttempts?: number });
  /** The stored model's card, with the length of the file as kept (`storedBytes`). */
  stored(): Promise<(DeviceCard & { storedBytes: number; storedAt: number }) | null>;
  load(card: DeviceCard): Promise<Blob | null>;
  download(card: DeviceCard, options?: { headers?: Record<string, string>;
    onProgress?: (p: { loaded: number; total: number }) => void; signal?: AbortSignal;
    storedForm?: (file: ArrayBuffer) => ArrayBuffer }): Promise<Blob>;
  clear(): Promise<void>;
}

export class WllamaEngine implements DeviceEngine {
  /** `widen` (default true): Q4_1 tensors reach llama.cpp as Q5_1, the same weights (gguf.js). */
  /** `kvType` (default "f32"): the KV cache's element; f16 halves its memory, and is slower in WebAssembly. */
  constructor(options?: { assetsUrl?: string; threads?: number | null; nCtx?: number; Wllama?: unknown;
    widen?: boolean; kvType?: "f32" | "f16" });
  readonly widen: boolean;
  readonly kvType: "f32" | "f16";
  /** The latest load: ms spent widening (0 for a file stored widened), ms in all, bytes given to llama.cpp. */
  readonly lastLoad: { widenMs: number; loadMs: number; bytes: number } | null;
  storedForm(file: ArrayBuffer): ArrayBuffer;
  static defaultThreads(): number;
  readonly loaded: boolean;
  readonly threads: number;
  /** llama.cpp's timings of the latest generation (cache_n, prompt_n, prompt_ms, ...). */
  readonly lastTimings: Record<string, number> | null;
  load(model: Blob): Promise<void>;
  generate(request: { prompt: string; maxTokens: number; temperature?: number; signal?: AbortSignal }):
    AsyncIterable<GeneratePart | GenerateEnd>;
  unload(): Promise<void>;
}

export class DeviceFallback extends Emitter implements DeviceLike {
  constructor(options?: { engine?: DeviceEngine; store?: ModelStore; maxOutputTokens?: number;
    probeTimeoutMs?: number; temperature?: number; fetch?: typeof fetch; warm?: boolean });
  readonly state: "idle" | "downloading" | "loading" | "ready" | "error";
  readonly error: DeviceModelError | null;
  readonly card: DeviceCard | null;
  readonly engine: DeviceEngine | null;
  readonly store: ModelStore | null;
  readonly available: boolean;
  readonly probeTimeoutMs: number;
  /** The prompt of the latest answer. */
  readonly lastPrompt: string | null;
  bind(info: { baseUrl: string; apiKey: string | null; model: string | null; fetch?: typeof fetch }): void;
  fetchCard(): Promise<DeviceCard | null>;
  prepare(options?: { download?: boolean }): Promise<DeviceCard>;
  warm(request: { conversation: ConversationItem[]; instructions?: string }): Promise<void> | null;
  answer(request: { conversation: ConversationItem[]; instructions?: string; maxOutputTokens?: number;
    temperature?: number; continueText?: string; signal: AbortSignal }): AsyncIterable<GeneratePart | GenerateEnd>;
}
