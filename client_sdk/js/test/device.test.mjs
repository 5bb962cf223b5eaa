// The on-device fallback's logic without a browser: the model store over fake Cache Storage and a
// fake gateway file route (Range, truncation, a wrong hash, a full quota), the prompt, and the
// client's fallback over the scripted gateway with a scripted engine. The real engine (wllama in
// Chromium) is tests/gateway/test_demo_offline.py.
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { test } from "node:test";

import { readLayout } from "../gguf.js";
import { DeviceFallback, DeviceModelError, ModelStore, WllamaEngine, conversationMessages, renderPrompt } from "../rtgw-device.js";
import { RealtimeClient } from "../rtgw.js";
import { FakeServer } from "./fake_server.mjs";
import { buildGguf } from "./gguf_fixture.mjs";

// --- fakes ------------------------------------------------------------------------------------

class FakeCache {
  constructor(owner) { this.owner = owner; this.entries = new Map(); }
  async match(url) { const r = this.entries.get(String(url)); return r ? r.clone() : undefined; }
  async put(url, response) {
    const body = await response.arrayBuffer();
    if (this.owner.quota !== null && body.byteLength > this.owner.quota) {
      const e = new Error("The quota has been exceeded."); e.name = "QuotaExceededError"; throw e;
    }
    this.entries.set(String(url), new Response(body, { headers: response.headers }));
  }
}

class FakeCaches {
  constructor({ quota = null } = {}) { this.quota = quota; this.caches = new Map(); }
  async open(name) { if (!this.caches.has(name)) this.caches.set(name, new FakeCache(this)); return this.caches.get(name); }
  async delete(name) { return this.caches.delete(name); }
}

const BYTES = Uint8Array.from({ length: 300_000 }, (_, i) => (i * 7919) % 251);
const sha = (bytes) => createHash("sha256").update(bytes).digest("hex");
const CARD = { model: "tiny", url: "/v1/models/tiny/file", format: "gguf", bytes: BYTES.length, sha256: sha(BYTES),
  family: "smollm2", context_length: 0 };

/** The gateway's file route: Range and If-Range as aiohttp answers them; `cutAt`: the first
 * response stops after that many bytes (a dropped connection); `serve`: the bytes it sends. */
function fileServer({ serve = BYTES, cutAt = null, status = 200 } = {}) {
  const calls = [];
  const fetch = async (url, init = {}) => {
    calls.push({ url, headers: { ...init.headers } });
    if (status !== 200) return new Response(JSON.stringify({ error: { message: "nope" } }), { status });
    const range = /^bytes=(\d+)-$/.exec(init.headers?.Range ?? "");
    const start = range ? Number(range[1]) : 0;
    let body = serve.subarray(start);
    const cut = calls.length === 1 && cutAt !== null;
    const stream = new ReadableStream({
      pull(controller) {
        if (!body.length) { controller.close(); return; }
        const piece = body.subarray(0, 65536);
        body = body.subarray(piece.length);
        const sent = start + (serve.length - start - body.length);
        if (cut && sent > cutAt) { controller.error(new TypeError("network error")); return; }
        controller.enqueue(piece);
      },
    });
    return new Response(stream, { status: range ? 206 : 200, headers: { ETag: '"v1"' } });
  };
  return { fetch, calls };
}

// --- the store --------------------------------------------------------------------------------

test("the model is downloaded with progress, checked, stored, and loaded again without a request", async () => {
  const caches = new FakeCaches();
  const server = fileServer();
  const store = new ModelStore({ caches, fetch: server.fetch, base: "http://gw.test:8000" });
  const progress = [];
  const blob = await store.download(CARD, { headers: { Authorization: "Bearer k" }, onProgress: (p) => progress.push(p) });
  assert.equal(blob.size, BYTES.length);
  assert.equal(server.calls[0].url, "http://gw.test:8000/v1/models/tiny/file");
  assert.equal(server.calls[0].headers.Authorization, "Bearer k");
  assert.deepEqual(progress[0], { loaded: 0, total: BYTES.length });
  assert.deepEqual(progress.at(-1), { loaded: BYTES.length, total: BYTES.length });
  assert.ok(progress.every((p, i) => i === 0 || p.loaded > progress[i - 1].loaded));
  assert.deepEqual(await store.stored(), { ...CARD, storedBytes: BYTES.length, storedAt: (await store.stored()).storedAt });
  const again = await new ModelStore({ caches, fetch: async () => { throw new Error("no request expected"); },
    base: "http://gw.test:8000" }).load(CARD);
  assert.equal(sha(new Uint8Array(await again.arrayBuffer())), CARD.sha256);
});

test("a download that breaks off resumes with Range and If-Range", async () => {
  const server = fileServer({ cutAt: 100_000 });
  const store = new ModelStore({ caches: new FakeCaches(), fetch: server.fetch, base: "http://gw.test:8000" });
  const blob = await store.download(CARD);
  assert.equal(sha(new Uint8Array(await blob.arrayBuffer())), CARD.sha256);
  assert.equal(server.calls.length, 2);
  assert.match(server.calls[1].headers.Range, /^bytes=\d+-$/);
  assert.ok(Number(server.calls[1].headers.Range.slice(6, -1)) > 0);
  assert.equal(server.calls[1].headers["If-Range"], '"v1"');
});

test("a file that fails its hash is discarded and never stored", async () => {
  const bad = BYTES.slice();
  bad[1234] ^= 0xff;
  const caches = new FakeCaches();
  const store = new ModelStore({ caches, fetch: fileServer({ serve: bad }).fetch, base: "http://gw.test:8000" });
  await assert.rejects(store.download(CARD), (e) => e instanceof DeviceModelError && e.code === "model_hash_mismatch"
    && /discarded/.test(e.message));
  assert.equal(await store.stored(), null);
  assert.equal(await store.load(CARD), null);
});

test("a file that stays short after every try is discarded with a clear error", async () => {
  const short = BYTES.subarray(0, 1000);
  const store = new ModelStore({ caches: new FakeCaches(), fetch: fileServer({ serve: short }).fetch,
    base: "http://gw.test:8000", maxAttempts: 2 });
  await assert.rejects(store.download(CARD), (e) => e.code === "download_truncated" && /1000 of 300000 bytes/.test(e.message));
  assert.equal(await store.stored(), null);
});

test("a storage quota too small says so, and nothing half-stored is left", async () => {
  const caches = new FakeCaches({ quota: 1000 });
  const store = new ModelStore({ caches, fetch: fileServer().fetch, base: "http://gw.test:8000" });
  await assert.rejects(store.download(CARD), (e) => e.code === "storage_quota_exceeded" && /gateway still answers/.test(e.message));
  assert.equal(await store.stored(), null);
});

test("a refused file (no key, not downloadable) is an error naming the gateway's reason", async () => {
  const store = new ModelStore({ caches: new FakeCaches(), fetch: fileServer({ status: 401 }).fetch, base: "http://gw.test:8000" });
  await assert.rejects(store.download(CARD), (e) => e.code === "download_refused" && /nope/.test(e.message));
});

test("the engine's form of the file is what is stored and loaded; the hash is checked on the file as served", async () => {
  const caches = new FakeCaches();
  const store = new ModelStore({ caches, fetch: fileServer().fetch, base: "http://gw.test:8000" });
  const storedForm = (buffer) => new Uint8Array(buffer).slice(0, 1000).reverse().buffer;
  const blob = await store.download(CARD, { storedForm });
  const expected = BYTES.slice(0, 1000).reverse();
  assert.deepEqual(new Uint8Array(await blob.arrayBuffer()), expected);
  assert.equal((await store.stored()).storedBytes, 1000);
  assert.deepEqual(new Uint8Array(await (await store.load(CARD)).arrayBuffer()), expected);
});

test("a file the engine cannot read is discarded with a clear error", async () => {
  const store = new ModelStore({ caches: new FakeCaches(), fetch: fileServer().fetch, base: "http://gw.test:8000" });
  await assert.rejects(store.download(CARD, { storedForm: (b) => new WllamaEngine().storedForm(b) }),
    (e) => e.code === "model_unreadable" && /not a GGUF file.*discarded/.test(e.message));
  assert.equal(await store.stored(), null);
});

/** wllama's class as the engine sees it: records the Blob it is given. */
class RecordingWllama {
  static loaded = [];
  setCompat() {}
  async loadModel(blobs, options) { RecordingWllama.loaded.push({ blob: blobs[0], options }); }
  async exit() {}
}

test("the engine hands llama.cpp Q4_1 weights as Q5_1, whether the file comes as served or as stored", async () => {
  const { buffer } = buildGguf({ tensors: [{ name: "w", dims: [64, 4], type: 3 }, { name: "n", dims: [8], type: 0 }] });
  const types = async (blob) => readLayout(await blob.arrayBuffer()).tensors.map((t) => t.typeName);
  for (const given of [new Blob([buffer]), new Blob([new WllamaEngine().storedForm(buffer)])]) {
    RecordingWllama.loaded = [];
    const engine = new WllamaEngine({ Wllama: RecordingWllama, threads: 1 });
    await engine.load(given);
    assert.deepEqual(await types(RecordingWllama.loaded[0].blob), ["Q5_1", "F32"]);
    assert.equal(engine.lastLoad.bytes, RecordingWllama.loaded[0].blob.size);
    const { options } = RecordingWllama.loaded[0];
    assert.deepEqual([options.cache_type_k, options.cache_type_v, options.flash_attn], ["f32", "f32", false]);
  }
  assert.throws(() => new WllamaEngine({ kvType: "q4_0" }), /kvType must be "f32" or "f16"/);
  RecordingWllama.loaded = [];
  await new WllamaEngine({ Wllama: RecordingWllama, widen: false }).load(new Blob([buffer]));
  assert.deepEqual(await types(RecordingWllama.loaded[0].blob), ["Q4_1", "F32"]);
  await assert.rejects(new WllamaEngine({ Wllama: RecordingWllama }).load(new Blob([new Uint8Array(64)])),
    (e) => e instanceof DeviceModelError && e.code === "model_unreadable");
});

// --- the prompt -------------------------------------------------------------------------------

test("the conversation renders as SmolLM2's ChatML, with its default system turn and a continued answer", () => {
  const conversation = [
    { id: "a", type: "message", role: "user", text: "Hi" },
    { id: "b", type: "message", role: "assistant", text: "Hello!" },
    { id: "c", type: "message", role: "user", text: "" },
    { id: "d", type: "message", role: "user", text: "Again" },
  ];
  const messages = conversationMessages(conversation, "");
  assert.deepEqual(messages.map((m) => m.role), ["user", "assistant", "user"]);
  assert.equal(renderPrompt("smollm2", messages, "Par"),
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n" +
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n" +
    "<|im_start|>assistant\nPar");
  assert.throws(() => renderPrompt("llama9", messages), (e) => e.code === "unknown_family");
});

// --- the client's fallback --------------------------------------------------------------------

/** A scripted engine: each generate() yields `pieces`, pausing before each until `step()`
 * (when `gated`), and records what it was asked. */
class ScriptedEngine {
  constructor({ pieces = ["Bon", "jour", "!"], gated = false, fail = null } = {}) {
    Object.assign(this, { pieces, gated, fail });
    this.requests = [];
    this.loaded = false;
    this._gate = null;
  }
  async load() { this.loaded = true; }
  step() { const g = this._gate; this._gate = null; g?.(); }
  async* generate(request) {
    this.requests.push(request);
    if (this.fail) throw this.fail;
    for (const text of this.pieces) {
      if (this.gated) await new Promise((resolve) => { this._gate = resolve; request.signal?.addEventListener("abort", resolve); });
      if (request.signal?.aborted) throw Object.assign(new DeviceModelError("cancelled", "cancelled"), { cancelled: true });
      yield { text };
    }
    yield { done: true, finishReason: "stop", usage: { input_tokens: 40, output_tokens: this.pieces.length,
      input_token_details: { cached_tokens: 32 } } };
  }
}

const storedOnly = (card = CARD) => ({ stored: async () => card, load: async () => new Blob([BYTES]),
  download: async () => { throw new Error("no download expected"); } });

function deviceClient(server, engine, options = {}) {
  const device = new DeviceFallback({ engine, store: storedOnly(), probeTimeoutMs: 200 });
  const c = new RealtimeClient({ url: "http://gw.test:8000", WebSocket: server.WebSocket,
    backoff: { initialMs: 1, attempts: 3 }, fetch: async () => { throw new Error("no network"); }, device, ...options });
  return { c, device };
}

async function onlineTurn(c, server, text, answer) {
  const turn = await c.send(text);
  while (!turn.responseId) await c.once("event");
  server.answer_(answer);
  return turn.result;
}

test("an unreachable gateway: the turn is answered on the device with the online events and the whole history", async () => {
  const server = new FakeServer();
  const engine = new ScriptedEngine();
  const { c, device } = deviceClient(server, engine);
  const first = await onlineTurn(c, server, "My name is Ada.", ["Nice to meet you, Ada."]);
  assert.equal(first.tier, "edge");
  server.drop(server.last, 1006, "");
  await c.once("disconnected");
  server.refuse = 100;
  const modes = [];
  c.on("mode", (m) => modes.push(m.mode));
  const seen = [];
  c.on("event", (e) => seen.push(e.type));
  const turn = await c.send("What is my name?");
  const deltas = [];
  for await (const d of turn) deltas.push(d);
  const result = await turn.result;
  assert.equal(result.status, "completed");
  assert.equal(result.text, "Bonjour!");
  assert.equal(result.tier, "device");
  assert.equal(result.cachedTokens, 32);
  assert.equal(deltas.join(""), "Bonjour!");
  assert.deepEqual(modes, ["device"]);
  // the gateway's own order (tests/test_response_order.py compares the two event by event)
  assert.deepEqual(seen.filter((t, i) => seen.indexOf(t) === i), ["response.created", "response.output_item.added",
    "conversation.item.added", "response.content_part.added", "response.output_text.delta",
    "response.output_text.done", "response.content_part.done", "response.output_item.done",
    "conversation.item.done", "response.done"]);
  // the device was given the conversation so far, the online answer included
  assert.match(device.lastPrompt, /My name is Ada\.<\|im_end\|>\n<\|im_start\|>assistant\nNice to meet you, Ada\.<\|im_end\|>/);
  assert.match(device.lastPrompt, /What is my name\?<\|im_end\|>\n<\|im_start\|>assistant\n$/);
  assert.deepEqual(c.conversation.map((i) => [i.role, i.text]), [["user", "My name is Ada."],
    ["assistant", "Nice to meet you, Ada."], ["user", "What is my name?"], ["assistant", "Bonjour!"]]);

  // the gateway is back: the next turn goes online, and the new session gets every item first
  server.refuse = 0;
  const back = await onlineTurn(c, server, "Thanks", ["You're welcome."]);
  assert.equal(back.tier, "edge");
  assert.deepEqual(modes, ["device", "online"]);
  const restored = server.received.filter(([s, e]) => s === server.sockets.length - 1 && e.type === "conversation.item.create")
    .map(([, e]) => e.item.content[0].text);
  assert.deepEqual(restored, ["My name is Ada.", "Nice to meet you, Ada.", "What is my name?", "Bonjour!", "Thanks"]);
  c.close();
});

test("cancel() stops a device answer at once and keeps what was shown", async () => {
  const server = new FakeServer({ refuse: 100 });
  const engine = new ScriptedEngine({ pieces: ["one ", "two ", "three"], gated: true });
  const { c } = deviceClient(server, engine);
  const turn = await c.send("Count");
  while (!engine._gate) await new Promise((r) => setTimeout(r, 1));
  engine.step();
  while (turn.text !== "one ") await turn.once("delta");
  const result = await c.cancel();
  assert.equal(result.status, "cancelled");
  assert.equal(result.text, "one ");
  assert.equal(engine.requests[0].signal.aborted, true);
  assert.deepEqual(c.conversation.at(-1).text, "one ");
  c.close();
});

test("the socket lost mid-answer: the device goes on from the text shown, in the same turn", async () => {
  const server = new FakeServer();
  const engine = new ScriptedEngine({ pieces: [" and", " done."] });
  const { c, device } = deviceClient(server, engine);
  await device.prepare({ download: false });
  const turn = await c.send("Tell me");
  while (!turn.responseId) await c.once("event");
  const responseId = turn.responseId;
  server.answer_(["Once", " upon"], { finish: false });
  server.refuse = 100;
  server.drop(server.last, 1006, "");
  const result = await turn.result;
  assert.equal(result.status, "completed");
  assert.equal(result.tier, "device");
  assert.equal(result.text, "Once upon and done.");
  assert.equal(result.responseId, responseId);
  // while the gateway answered, the device read the conversation up to the answer...
  const [warm, answer] = engine.requests;
  assert.equal(warm.maxTokens, 1);
  assert.ok(warm.prompt.endsWith("<|im_start|>user\nTell me<|im_end|>\n<|im_start|>assistant\n"));
  // ...so the continuation's prompt is that prefix and the text shown: all it must still read
  assert.equal(answer.prompt, warm.prompt + "Once upon");
  assert.equal(c.conversation.at(-1).text, "Once upon and done.");
  c.close();
});

test("without a stored model the turn fails as it would without a fallback", async () => {
  const server = new FakeServer({ refuse: 100 });
  const device = new DeviceFallback({ engine: new ScriptedEngine(), store: { stored: async () => null },
    probeTimeoutMs: 200 });
  const c = new RealtimeClient({ url: "http://gw.test:8000", WebSocket: server.WebSocket, backoff: { initialMs: 1 },
    fetch: async () => { throw new Error("no network"); }, device });
  await assert.rejects(c.send("Hi"), (e) => e.code === "unreachable");
  c.close();
});

test("a device turn past the model's context fails with the server's code; a required tool call is refused", async () => {
  const server = new FakeServer({ refuse: 100 });
  const engine = new ScriptedEngine({ fail: new DeviceModelError("too long", "context_length_exceeded") });
  const { c } = deviceClient(server, engine);
  const result = await (await c.send("A very long story")).result;
  assert.equal(result.status, "failed");
  assert.equal(result.error.code, "context_length_exceeded");
  assert.equal(result.tier, "device");
  const tools = [{ type: "function", name: "get_time", parameters: { type: "object", properties: {} } }];
  const refused = await (await c.send("Time?", { tools, toolChoice: "required" })).result;
  assert.equal(refused.status, "failed");
  assert.equal(refused.error.code, "unsupported_on_device");
  c.close();
});

test("after an online turn a ready device reads the conversation, so a later device turn reuses it", async () => {
  const server = new FakeServer();
  const engine = new ScriptedEngine({ pieces: ["Yes."] });
  const { c, device } = deviceClient(server, engine);
  await device.prepare({ download: false });
  await onlineTurn(c, server, "Remember 42.", ["Noted: 42."]);
  await device.warming;
  assert.equal(engine.requests.length, 2); // at the request, and once the answer was in
  const warm = engine.requests[1];
  assert.equal(warm.maxTokens, 1);
  // the conversation, and the opening of the user's next turn
  assert.match(warm.prompt, /Remember 42\.<\|im_end\|>\n<\|im_start\|>assistant\nNoted: 42\.<\|im_end\|>\n<\|im_start\|>user\n$/);
  server.drop(server.last, 1006, "");
  await c.once("disconnected");
  server.refuse = 100;
  const result = await (await c.send("Which number?")).result;
  assert.equal(result.tier, "device");
  const answer = engine.requests[2].prompt;
  // the answer's prompt extends all that was read
  assert.ok(answer.startsWith(warm.prompt) && answer.endsWith("Which number?<|im_end|>\n<|im_start|>assistant\n"), answer);
  c.close();
});

test("a read asked for while one runs waits for it, then reads the newest conversation once", async () => {
  const server = new FakeServer();
  const engine = new ScriptedEngine({ pieces: ["x"], gated: true });
  const { c, device } = deviceClient(server, engine);
  await device.prepare({ download: false });
  await onlineTurn(c, server, "One.", ["1"]);
  while (!engine._gate) await new Promise((r) => setTimeout(r, 1)); // the first read is running
  await onlineTurn(c, server, "Two.", ["2"]);
  await onlineTurn(c, server, "Three.", ["3"]);
  engine.step();
  while (engine.requests.length < 2 || engine._gate === null) await new Promise((r) => setTimeout(r, 1));
  engine.step();
  await device.warming;
  assert.equal(engine.requests.length, 2); // the middle conversation was never read on its own
  assert.match(engine.requests[1].prompt, /Three\.<\|im_end\|>\n<\|im_start\|>assistant\n3<\|im_end\|>/);
  c.close();
});

test("interrupt() during a device answer cancels it and keeps the characters heard, locally", async () => {
  const server = new FakeServer({ refuse: 100 });
  const engine = new ScriptedEngine({ pieces: ["Hello ", "there, ", "friend"], gated: true });
  const { c } = deviceClient(server, engine);
  const turn = await c.send("Greet me");
  while (!engine._gate) await new Promise((r) => setTimeout(r, 1));
  engine.step();
  while (!engine._gate || turn.text.length < 6) await new Promise((r) => setTimeout(r, 1));
  engine.step();
  while (turn.text !== "Hello there, ") await turn.once("delta");
  const cut = await c.interrupt(5);
  assert.deepEqual(cut, { itemId: turn.itemId, text: "Hello", method: "local" });
  assert.equal((await turn.result).status, "cancelled");
  assert.equal(c.conversation.at(-1).text, "Hello");
  c.close();
});
