// The SDK against a real gateway: RTGW_URL (http base URL) and RTGW_KEY (its API key);
// RTGW_CONTROL_URL, when set, has `POST /restart` that restarts the gateway on the same port
// and answers once it is ready again. Run through tests/client_sdk/test_js_sdk.py, or by hand:
//   RTGW_URL=http://127.0.0.1:8000 node --test client_sdk/js/test/gateway.test.mjs
// (Node 20: add --experimental-websocket). The model runs on a busy CPU: every wait is long,
// and no test sleeps to wait for something.
import assert from "node:assert/strict";
import { after, test } from "node:test";

import * as msgpack from "../msgpack.js";
import { codePointLength, GatewayRefused, RealtimeClient } from "../rtgw.js";

const URL_ = process.env.RTGW_URL;
const KEY = process.env.RTGW_KEY || null;
const CONTROL = process.env.RTGW_CONTROL_URL;
const TIMEOUT = 240_000;
const skip = URL_ ? false : "RTGW_URL is not set";
const STORY = "Tell me a long story about a dragon who learns to bake bread.";

const clients = [];
function client(options = {}) {
  const c = new RealtimeClient({ url: URL_, apiKey: KEY, silenceTimeoutMs: 120_000, requestTimeoutMs: 60_000,
    connectTimeoutMs: 60_000, ...options });
  clients.push(c);
  return c;
}
after(() => { for (const c of clients) c.close(); });

/** Resolves when `turn` has streamed at least `chars` characters (or has ended). */
function streamed(turn, chars) {
  return new Promise((resolve) => {
    const check = () => { if (turn.text.length >= chars || turn.done) { off(); offDone(); resolve(); } };
    const off = turn.on("delta", check);
    const offDone = turn.on("done", check);
    check();
  });
}

test("a turn streams deltas and ends with text, tier and usage", { skip, timeout: TIMEOUT }, async () => {
  const c = client({ instructions: "You are a helpful assistant. Answer briefly." });
  const turn = await c.send("What is the capital of France?", { maxOutputTokens: 24 });
  const deltas = [];
  for await (const delta of turn) deltas.push(delta);
  const result = await turn.result;
  assert.ok(["completed", "incomplete"].includes(result.status), JSON.stringify(result));
  assert.ok(deltas.length >= 1);
  assert.equal(deltas.join(""), result.text);
  assert.ok(result.text.length > 0);
  assert.equal(result.tier, "edge");
  assert.equal(result.metadata.x_tier, "edge");
  assert.ok(result.usage.output_tokens > 0 && result.usage.input_tokens > 0);
  assert.equal(typeof result.cachedTokens, "number");
  assert.ok(result.ttftMs > 0 && result.elapsedMs >= result.ttftMs);
  assert.deepEqual(c.conversation.map((i) => i.role), ["user", "assistant"]);
  assert.equal(c.conversation[1].id, result.itemId);
  assert.equal(c.conversation[1].text, result.text);

  // a second turn reuses the prefix: the same instructions and first turn come from the cache
  const second = await c.ask("And of Italy?", { maxOutputTokens: 8 });
  assert.ok(second.usage.input_tokens > result.usage.input_tokens);
  assert.ok(second.cachedTokens > 0, JSON.stringify(second.usage));
});

test("cancel() ends the turn cancelled; the session goes on", { skip, timeout: TIMEOUT }, async () => {
  const c = client();
  const events = c.events();
  const turn = await c.send(STORY, { maxOutputTokens: 400 });
  await streamed(turn, 1);
  const result = await c.cancel();
  assert.equal(result.status, "cancelled");
  assert.equal(result.reason, "client_cancelled");
  assert.equal(c.activeTurn, null);
  let sawDone = false;
  for await (const event of events) {
    if (event.type === "response.done") { sawDone = true; break; }
  }
  assert.ok(sawDone);
  const next = await c.ask("Say hi.", { maxOutputTokens: 4 });
  assert.ok(["completed", "incomplete"].includes(next.status));
});

test("interrupt() keeps only the heard characters, here and on the server", { skip, timeout: TIMEOUT }, async () => {
  const c = client();
  const truncated = new Promise((resolve) => {
    const off = c.on("event", (e) => { if (e.type === "conversation.item.truncated") { off(); resolve(e); } });
  });
  const turn = await c.send(STORY, { maxOutputTokens: 400 });
  await streamed(turn, 12);
  const heard = 5;
  const cut = await c.interrupt(heard);
  const result = await turn.result;
  assert.equal(result.status, "cancelled");
  assert.equal(cut.method, "truncate");
  assert.equal(cut.itemId, result.itemId);
  const server = await truncated;
  assert.equal(server.item_id, result.itemId);
  assert.equal(server.x_text_end, heard);
  const item = c.conversation.find((i) => i.id === result.itemId);
  assert.equal(codePointLength(item.text), heard);
  assert.equal(item.text, Array.from(result.text).slice(0, heard).join(""));
  assert.equal(cut.text, item.text);
});

test("msgpack framing gives the same kind of turn", { skip, timeout: TIMEOUT }, async () => {
  const c = client({ framing: "msgpack", msgpack });
  const result = await c.ask("What is the capital of France?", { maxOutputTokens: 12 });
  assert.ok(["completed", "incomplete"].includes(result.status), JSON.stringify(result));
  assert.ok(result.text.length > 0);
  assert.equal(result.tier, "edge");
  assert.ok(result.usage.output_tokens > 0);
});

test("a refused key is a clear GatewayRefused error, not retried", { skip: skip || (KEY ? false : "no RTGW_KEY"),
  timeout: TIMEOUT }, async () => {
  const c = client({ apiKey: "sk-not-a-key", backoff: { attempts: 3, initialMs: 10 } });
  let retries = 0;
  c.on("reconnecting", () => { retries += 1; });
  await assert.rejects(c.send("Hi"), (error) => {
    assert.ok(error instanceof GatewayRefused, String(error));
    assert.equal(error.status, 401);
    assert.equal(error.code, "invalid_api_key");
    assert.match(error.message, /refused/);
    return true;
  });
  assert.equal(retries, 0);
  assert.equal(c.activeTurn, null);
});

const WEATHER = { type: "function", name: "get_weather", description: "Current weather in a city.",
  parameters: { type: "object", properties: { city: { type: "string" }, unit: { type: "string", enum: ["C", "F"] } },
    required: ["city", "unit"], additionalProperties: false } };

test("function calling: a required call with parsed arguments, its output sent back, then the answer",
  { skip, timeout: TIMEOUT }, async () => {
    const c = client({ tools: [WEATHER], temperature: 0 });
    const seen = [];
    c.on("functionCall", ({ call }) => seen.push(call));
    const turn = await c.send("What is the weather in Paris, in Celsius?", { toolChoice: "required", parallelToolCalls: false,
      maxOutputTokens: 80 });
    const onTurn = [];
    turn.on("functionCall", (call) => onTurn.push(call));
    const result = await turn.result;
    assert.equal(result.status, "completed", JSON.stringify(result));
    assert.equal(result.tier, "edge");
    assert.equal(result.calls.length, 1, JSON.stringify(result.calls));
    const [call] = result.calls;
    assert.deepEqual(seen, [call]);
    assert.deepEqual(onTurn, [call]);
    assert.equal(call.name, "get_weather");
    assert.ok(call.complete && call.callId.startsWith("call_"), JSON.stringify(call));
    assert.deepEqual(Object.keys(call.parsed).sort(), ["city", "unit"]);
    assert.equal(typeof call.parsed.city, "string");
    assert.ok(["C", "F"].includes(call.parsed.unit));
    assert.deepEqual(JSON.parse(call.arguments), call.parsed);
    assert.deepEqual(c.conversation.map((i) => i.type), ["message", "function_call"]);

    const next = await c.sendToolOutput(call.callId, { temperature: 21, sky: "clear" },
      { toolChoice: "none", maxOutputTokens: 40 });
    const answer = await next.result;
    assert.ok(["completed", "incomplete"].includes(answer.status), JSON.stringify(answer));
    assert.ok(answer.text.trim().length > 0);
    assert.deepEqual(answer.calls, []);
    assert.deepEqual(c.conversation.map((i) => i.type), ["message", "function_call", "function_call_output", "message"]);
    assert.equal(c.conversation[2].callId, call.callId);
  });

// Last: it restarts the gateway. The restart is a SIGTERM, so the gateway drains: it lets the
// answer in progress finish, then closes the session with 1001 and a reconnect hint, and the
// client comes back by itself to the fresh process on the same port.
test("a drained gateway: the turn in progress finishes, the client reconnects by itself and keeps the conversation",
  { skip: skip || (CONTROL ? false : "RTGW_CONTROL_URL is not set"), timeout: TIMEOUT }, async () => {
    const c = client({ backoff: { initialMs: 200, maxMs: 2000, attempts: 150 } });
    const errors = [];
    c.on("error", (e) => errors.push(e));
    c.on("reconnect_failed", (e) => errors.push(e));
    const first = await c.ask("My name is Zorblax and my favourite colour is teal.", { maxOutputTokens: 24 });
    assert.ok(first.text.length > 0);

    const disconnected = c.once("disconnected");
    const reconnected = c.once("connected");
    const turn = await c.send("Tell me about the colour teal.", { maxOutputTokens: 48 });
    await streamed(turn, 1);
    const restart = fetch(`${CONTROL}/restart`, { method: "POST" }); // not awaited: the answer streams on
    const during = await turn.result;
    assert.ok(["completed", "incomplete"].includes(during.status), JSON.stringify(during)); // not cancelled, not lost
    const closed = await disconnected;
    assert.equal(closed.code, 1001);
    assert.ok(Number.isInteger(closed.reconnectInMs) && closed.reconnectInMs >= 0, JSON.stringify(closed));
    const itemsBefore = c.conversation.map((i) => [i.id, i.text]);
    assert.equal(itemsBefore.length, 4);
    assert.deepEqual(itemsBefore[3], [during.itemId, during.text]);

    const restarted = await restart;
    assert.equal(restarted.status, 200, await restarted.text());
    const { restored } = await reconnected; // no operation asked for it
    assert.equal(restored, 4);
    assert.equal(c.sessions, 2);

    const message = "What is my name?";
    const next = await c.ask(message, { maxOutputTokens: 12 });
    assert.ok(["completed", "incomplete"].includes(next.status), JSON.stringify(next));
    assert.deepEqual(c.conversation.slice(0, 4).map((i) => [i.id, i.text]), itemsBefore);
    assert.deepEqual(errors, []);

    // the same message alone on a fresh session: the restored turns must make the prompt longer
    const fresh = client();
    const alone = await fresh.ask(message, { maxOutputTokens: 1 });
    assert.ok(next.usage.input_tokens > alone.usage.input_tokens + 10,
      `${next.usage.input_tokens} vs ${alone.usage.input_tokens}`);
  });
