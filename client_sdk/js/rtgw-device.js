// rtgw-device: the JS SDK's on-device fallback. When the gateway cannot be reached, or its socket
// drops mid-turn, a RealtimeClient given `device: new DeviceFallback(...)` answers from the same
// conversation with the gateway's own edge model, run where the app runs.
//
//   import { RealtimeClient } from "/sdk/rtgw.js";
//   import { DeviceFallback } from "/sdk/rtgw-device.js";
//   const device = new DeviceFallback();            // the browser: wllama, Cache Storage
//   const client = new RealtimeClient({ url, apiKey, device });
//   device.on("progress", ({ loaded, total }) => bar(loaded / total));
//   await client.prefetchOffline();                 // while online: download, check, store, load
//
// Three parts, each replaceable:
// - an engine: `load(blob)` and `generate({prompt, maxTokens, temperature, signal})`, an async
//   iterator of `{text}` pieces and one last `{done, finishReason, usage}`. `WllamaEngine` is
//   llama.cpp in WebAssembly (@wllama/wllama, served by the gateway at /vendor/, never a CDN);
//   another runtime (llama.rn in React Native) plugs in with the same two calls;
// - a store (`ModelStore`, model-store.js): the model file, fetched once from the gateway
//   (`/v1/models/{id}/file`, behind the API key), checked against the SHA-256 the gateway
//   publishes, kept in Cache Storage;
// - the prompt: the conversation rendered with the model family's chat template, as the edge
//   tier renders it (`renderPrompt`), so the device sees the prompt the gateway would.
// Only an app that imports this module loads any of it; rtgw.js imports nothing.

import { GgufError, hasQ4_1, readLayout, widenQ4_1 } from "./gguf.js";
import { DeviceModelError, ModelStore } from "./model-store.js";
import { Emitter } from "./rtgw.js";

export { DeviceModelError, ModelStore };

// --- the prompt -------------------------------------------------------------------------------

/** JSON as Python's json.dumps writes it (", " and ": "; non-ASCII kept), which the gateway uses
 * for a call's arguments in the prompt. */
export function pyJson(value) {
  if (Array.isArray(value)) return `[${value.map(pyJson).join(", ")}]`;
  if (value !== null && typeof value === "object") {
    return `{${Object.entries(value).map(([k, v]) => `${JSON.stringify(k)}: ${pyJson(v)}`).join(", ")}}`;
  }
  return JSON.stringify(value);
}

/** Each family's way of writing calls and tool results in the prompt (llm_shared.structured.families). */
const FAMILIES = {
  smollm2: {
    calls: (calls) => {
      const items = calls.map(({ name, arguments: args }) => {
        let rendered;
        try { rendered = pyJson(JSON.parse(args)); } catch { rendered = JSON.stringify(args); }
        return `{"name": ${JSON.stringify(name)}, "arguments": ${rendered}}`;
      });
      return `<tool_call>[${items.join(", ")}]</tool_call>`;
    },
    toolResult: (content) => `<tool_response>\n${content}\n</tool_response>`,
    // ChatML as SmolLM2's GGUF template writes it, its default system turn included
    // `next`: the role whose turn the prompt opens (the assistant's, for an answer)
    template: (messages, next = "assistant") => {
      let out = messages[0]?.role === "system" ? ""
        : "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";
      for (const m of messages) out += `<|im_start|>${m.role}\n${m.content}<|im_end|>\n`;
      return `${out}<|im_start|>${next}\n`;
    },
  },
};

export const FAMILY_NAMES = Object.freeze(Object.keys(FAMILIES));

/** The local conversation (RealtimeClient.conversation) as role/content messages, as the gateway
 * renders a Realtime conversation with no tools offered: the instructions as the system turn, an
 * assistant's calls joined to its text, a call's output as a user turn; empty messages left out. */
export function conversationMessages(conversation, instructions, family = "smollm2") {
  const syntax = FAMILIES[family];
  if (!syntax) throw new DeviceModelError(`no chat format for the model family ${JSON.stringify(family)}`, "unknown_family");
  const history = instructions ? [{ role: "system", content: instructions, calls: [] }] : [];
  for (const item of conversation) {
    if (item.type === "function_call") {
      const last = history.at(-1);
      if (last?.role === "assistant") last.calls.push(item);
      else history.push({ role: "assistant", content: "", calls: [item] });
    } else if (item.type === "function_call_output") {
      history.push({ role: "user", content: syntax.toolResult(item.output), calls: [] });
    } else if (item.text) {
      history.push({ role: item.role, content: item.text, calls: [] });
    }
  }
  return history.map(({ role, content, calls }) => {
    if (!calls.length) return { role, content };
    const rendered = syntax.calls(calls);
    return { role, content: content ? `${content}\n${rendered}` : rendered };
  });
}

/** The prompt text for `messages`; `continueText`: an assistant answer cut short, which the model
 * goes on writing (its end marker left out). `next: "user"` opens the user's turn instead: the
 * start of the prompt of the question that follows an answer. */
export function renderPrompt(family, messages, continueText = "", { next = "assistant" } = {}) {
  const syntax = FAMILIES[family];
  if (!syntax) throw new DeviceModelError(`no chat format for the model family ${JSON.stringify(family)}`, "unknown_family");
  return syntax.template(messages, next) + continueText;
}

// --- llama.cpp in WebAssembly -----------------------------------------------------------------

const QUIET = { debug() {}, log() {}, info() {}, warn: (...a) => console.warn("[wllama]", ...a),
  error: (...a) => console.error("[wllama]", ...a) };

/** The browser engine: @wllama/wllama from the gateway's /vendor/ (or the class passed as
 * `Wllama`). Threads: `threads`, else the cores when the page is cross-origin isolated (COOP and
 * COEP: SharedArrayBuffer), else one. Its "compat" mode, which fetches a build from a CDN, is off.
 * `widen`: Q4_1 tensors reach llama.cpp as Q5_1, the same weights in a block type its WebAssembly
 * build has SIMD code for (gguf.js; 1.3x the decode speed in Chromium). `storedForm` does it once,
 * before the file is stored; `load` does it for a file given as served (one stored before).
 * `kvType`: the KV cache's element, "f32" (the default) or "f16". WebAssembly has no half-float
 * instructions, so f16 costs a conversion per value read: at a 1,400-token conversation f32 reads
 * a new question in 0.65x the time and decodes 1.3x faster (Chromium, 2 threads), for twice the
 * memory (SmolLM2-135M at 4,096 tokens: 189 MB against 94 MB). */
export class WllamaEngine {
  constructor({ assetsUrl = "/vendor/", threads = null, nCtx = 4096, Wllama = null, widen = true, kvType = "f32" } = {}) {
    if (kvType !== "f32" && kvType !== "f16") throw new TypeError(`kvType must be "f32" or "f16", not ${JSON.stringify(kvType)}`);
    this.assetsUrl = new URL(assetsUrl, globalThis.location?.href ?? "http://localhost/").toString();
    this.kvType = kvType;
    this.requestedThreads = threads;
    this.nCtx = nCtx;
    this.widen = widen;
    this._Wllama = Wllama;
    this._wllama = null;
    this.lastTimings = null;
    this.lastLoad = null;
  }

  get loaded() { return this._wllama !== null; }
  get threads() { return this._wllama?.getNumThreads?.() ?? 0; }

  static defaultThreads() {
    const cores = globalThis.navigator?.hardwareConcurrency ?? 1;
    return globalThis.crossOriginIsolated ? Math.max(1, Math.min(cores, 8)) : 1;
  }

  /** The form this engine keeps the model in: the file as served, Q4_1 tensors widened. */
  storedForm(buffer) {
    return this.widen ? widenQ4_1(buffer) : buffer;
  }

  async load(blob) {
    if (this._wllama) return;
    const started = performance.now();
    let model = blob;
    try {
      if (this.widen && hasQ4_1(await headerLayout(blob))) {
        model = new Blob([widenQ4_1(await blob.arrayBuffer())], { type: "application/octet-stream" });
      }
    } catch (e) {
      if (!(e instanceof GgufError)) throw e;
      throw new DeviceModelError(`the model file cannot be read: ${e.message}`, "model_unreadable");
    }
    const widenMs = performance.now() - started;
    const Wllama = this._Wllama ?? (await import(new URL("wllama.js", this.assetsUrl).toString())).Wllama;
    const wllama = new Wllama({ default: new URL("wllama.wasm", this.assetsUrl).toString() }, { logger: QUIET });
    wllama.setCompat(null); // never the CDN build
    // flash attention off: in WebAssembly it is the slower path, 2x at a 1,600-token context (16
    // new tokens read in 1.45 s with it, 0.68 s without; decode 9.6 against 18.9 tok/s; Chromium, 2 threads)
    await wllama.loadModel([model], { n_ctx: this.nCtx, n_threads: this.requestedThreads ?? WllamaEngine.defaultThreads(),
      n_gpu_layers: 0, flash_attn: false, cache_type_k: this.kvType, cache_type_v: this.kvType });
    this._wllama = wllama;
    this.lastLoad = { widenMs, loadMs: performance.now() - started, bytes: model.size };
  }

  async* generate({ prompt, maxTokens, temperature = 0.8, signal }) {
    if (!this._wllama) throw new DeviceModelError("the on-device model is not loaded", "not_loaded");
    let stream;
    try {
      stream = await this._wllama.createCompletion({ prompt, stream: true, max_tokens: maxTokens, temperature,
        abortSignal: signal, cache_prompt: true });
    } catch (e) {
      throw engineError(e, signal);
    }
    let last = null;
    try {
      for await (const chunk of stream) {
        const text = chunk.choices?.[0]?.text ?? "";
        if (text) yield { text };
        last = chunk;
      }
    } catch (e) {
      throw engineError(e, signal);
    }
    const usage = last?.usage ?? {};
    this.lastTimings = last?.timings ?? null; // llama.cpp's: cache_n, prompt_n, prompt_ms, predicted_n, ...
    yield { done: true, finishReason: last?.choices?.[0]?.finish_reason ?? "stop", usage: {
      input_tokens: usage.prompt_tokens ?? 0, output_tokens: usage.completion_tokens ?? 0,
      total_tokens: usage.total_tokens ?? 0,
      input_token_details: { cached_tokens: usage.prompt_tokens_details?.cached_tokens ?? 0 } } };
  }

  async unload() {
    const wllama = this._wllama;
    this._wllama = null;
    await wllama?.exit();
  }
}

/** The layout of a GGUF Blob, reading no more of it than its header (a few MB: the tokenizer). */
async function headerLayout(blob) {
  for (let bytes = 4 << 20; ; bytes *= 4) {
    try {
      return readLayout(await blob.slice(0, Math.min(bytes, blob.size)).arrayBuffer(), { fileBytes: blob.size });
    } catch (e) {
      if (!(e instanceof GgufError && e.truncated) || bytes >= blob.size) throw e;
    }
  }
}

/** An aborted generation, or llama.cpp's refusal (a prompt past the context), as our error. */
function engineError(e, signal) {
  if (signal?.aborted || e?.name === "AbortError" || e?.name === "WllamaAbortError") {
    const aborted = new DeviceModelError("the on-device answer was cancelled", "cancelled");
    aborted.cancelled = true;
    return aborted;
  }
  const message = e?.message ?? String(e);
  if (/context|exceed/i.test(message)) {
    return new DeviceModelError(`the conversation is too long for the on-device model's context: ${message}`,
      "context_length_exceeded");
  }
  return new DeviceModelError(`the on-device model failed: ${message}`, "device_failed");
}

// --- the fallback -----------------------------------------------------------------------------

/** What a RealtimeClient calls when the gateway is away. Events: `state` ({state: "idle" |
 * "downloading" | "loading" | "ready" | "error", error}), `progress` ({loaded, total}). */
export class DeviceFallback extends Emitter {
  /** @param {object} options  engine (default WllamaEngine), store (default ModelStore),
   *   maxOutputTokens (when the turn names none: the gateway's default, 512), probeTimeoutMs (how
   *   long a turn waits for the gateway before answering here), temperature, fetch. */
  constructor({ engine = null, store = null, maxOutputTokens = 512, probeTimeoutMs = 1500, temperature = 0.8,
    fetch = null, warm = true } = {}) {
    super();
    this.warmEnabled = warm;
    this._busy = false;
    this._warmNext = null; // the newest conversation to read once the running read ends
    this.warming = null;
    this._engineOption = engine;
    this._storeOption = store;
    this.maxOutputTokens = maxOutputTokens;
    this.probeTimeoutMs = probeTimeoutMs;
    this.temperature = temperature;
    this._fetch = fetch;
    this.state = "idle";
    this.card = null; // the model's x_device card: from the gateway, or from the store when offline
    this.error = null;
    this.engine = null;
    this.store = null;
    this._ready = null;
    this.lastPrompt = null; // the prompt of the latest answer (what the model was given)
  }

  /** Called by the RealtimeClient it is given to: where the gateway is and how to authenticate. */
  bind({ baseUrl, apiKey, model, fetch }) {
    this.baseUrl = baseUrl.replace(/\/+$/, "");
    this.apiKey = apiKey;
    this.model = model;
    this._fetch ??= fetch;
    // bound again by a new client of the same app: the loaded engine and its store stay
    this.store ??= this._storeOption ?? new ModelStore({ base: this.baseUrl, fetch: this._fetch });
    this.engine ??= this._engineOption ?? new WllamaEngine({ assetsUrl: `${this.baseUrl}/vendor/` });
  }

  get available() { return this.state === "ready"; }

  _setState(state, error = null) {
    this.state = state;
    this.error = error;
    this.emit("state", { state, error });
  }

  _headers() { return this.apiKey ? { Authorization: `Bearer ${this.apiKey}` } : {}; }

  /** The model's card from the gateway (`x_device` of GET /v1/models/{id}); null when the gateway
   * offers no downloadable model. Throws when it cannot be reached. */
  async fetchCard() {
    const path = this.model ? `/v1/models/${encodeURIComponent(this.model)}` : "/v1/models";
    const response = await this._fetch(this.baseUrl + path, { headers: this._headers(), cache: "no-store" });
    if (!response.ok) throw new DeviceModelError(`the gateway answered HTTP ${response.status} for ${path}`, "card_refused");
    const body = await response.json();
    return this.model ? body.x_device ?? null : this._firstCard(body); // a list names no files: ask each card
  }

  async _firstCard(list) {
    for (const entry of list.data ?? []) {
      const response = await this._fetch(`${this.baseUrl}/v1/models/${encodeURIComponent(entry.id)}`,
        { headers: this._headers(), cache: "no-store" });
      if (response.ok) {
        const card = (await response.json()).x_device;
        if (card) return card;
      }
    }
    return null;
  }

  /** Ready to answer: the model stored (downloaded first when the gateway offers a newer one or
   * none is stored) and loaded into the engine. With `download: false`, only a stored model is
   * used (the gateway is away). Resolves with the card; rejects with DeviceModelError. */
  prepare({ download = true } = {}) {
    this._ready ??= this._prepare(download).catch((error) => {
      this._ready = null;
      const failure = error instanceof DeviceModelError ? error
        : new DeviceModelError(`the on-device model could not be made ready: ${error.message}`, "device_failed");
      this._setState("error", failure);
      throw failure;
    });
    return this._ready;
  }

  async _prepare(download) {
    if (!this.store) throw new DeviceModelError("the fallback is not bound to a client", "not_bound");
    if (this.state === "ready" && this.card) return this.card;
    let card = null;
    if (download) {
      try {
        card = await this.fetchCard();
      } catch (e) {
        if (e instanceof DeviceModelError) throw e;
        card = null; // the gateway is away: what is stored will do
      }
    }
    const stored = await this.store.stored();
    card ??= stored;
    if (!card) {
      throw new DeviceModelError(download ? "the gateway offers no downloadable model" :
        "no model is stored on this device (prefetch it while online)", "no_model");
    }
    let blob = stored && stored.sha256 === card.sha256 ? await this.store.load(card) : null;
    if (!blob) {
      if (!download) throw new DeviceModelError("no model is stored on this device (prefetch it while online)", "no_model");
      this._setState("downloading");
      blob = await this.store.download(card, { headers: this._headers(),
        onProgress: (p) => this.emit("progress", p), storedForm: this.engine.storedForm?.bind(this.engine) });
    }
    this.card = card;
    this._setState("loading");
    await this.engine.load(blob);
    this._setState("ready");
    return card;
  }

  /** After a turn served online: the engine reads the conversation so far (one token generated,
   * thrown away), so that its KV cache holds it and a turn the device must take later computes only
   * what is new (`warm: false` in the options turns this off). A call while a read is running
   * waits for it, then reads the newest conversation once. */
  warm({ conversation, instructions = "" }) {
    if (!this.warmEnabled || !this.available) return null;
    this._warmNext = { conversation, instructions };
    if (this._busy) return this.warming;
    this._busy = true;
    this.warming = (async () => {
      try {
        while (this._warmNext) {
          const next = this._warmNext;
          this._warmNext = null;
          const family = this.card.family || "smollm2";
          const messages = conversationMessages(next.conversation, next.instructions, family);
          // after an answer the next prompt goes on with the user's turn: read its opening too
          const prompt = renderPrompt(family, messages, "",
            { next: messages.at(-1)?.role === "assistant" ? "user" : "assistant" });
          try {
            for await (const _ of this.engine.generate({ prompt, maxTokens: 1, temperature: 0 })) { /* discarded */ }
          } catch { /* the next answer reads the prompt itself */ }
        }
      } finally {
        this._busy = false;
      }
    })();
    return this.warming;
  }

  /** The answer to `conversation` (the client's local items): `{text}` pieces, then `{done,
   * finishReason, usage}`. `continueText`: an answer cut short by a lost gateway, continued. */
  async* answer({ conversation, instructions = "", maxOutputTokens, temperature, continueText = "", signal }) {
    if (!this.available) await this.prepare({ download: false });
    this._warmNext = null; // an answer is wanted now: no further read-ahead before it
    await this.warming; // one generation at a time: a read in flight ends first (its KV is reused)
    const messages = conversationMessages(conversation, instructions, this.card.family || "smollm2");
    const prompt = renderPrompt(this.card.family || "smollm2", messages, continueText);
    this.lastPrompt = prompt;
    yield* this.engine.generate({ prompt, maxTokens: maxOutputTokens ?? this.maxOutputTokens,
      temperature: temperature ?? this.temperature, signal });
  }
}
