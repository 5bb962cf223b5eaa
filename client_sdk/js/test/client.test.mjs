// The client's logic over a scripted in-memory WebSocket: no gateway, no network. What a real
// gateway cannot show (a server without x_text_end, a silent server, a socket that never opens)
// is scripted here; gateway.test.mjs checks the rest against the real thing.
import assert from "node:assert/strict";
import { test } from "node:test";

import * as msgpack from "../msgpack.js";
import { FakeServer } from "./fake_server.mjs";
import { backoffDelays, GatewayUnreachable, RealtimeClient, realtimeUrl, reconnectHint } from "../rtgw.js";

/** Resolves once the active turn's response.created has arrived. */
async function responseCreated(c) {
  while (!c.activeTurn?.responseId) await c.once("event");
}

const client = (server, options = {}) => new RealtimeClient({ url: "http://gw.test:8000", WebSocket: server.WebSocket,
  backoff: { initialMs: 1, attempts: 3 }, fetch: async () => { throw new Error("no network"); }, ...options });

test("realtimeUrl maps http(s) to ws(s), adds the path and the model", () => {
  assert.equal(realtimeUrl("http://h:8000"), "ws://h:8000/v1/realtime");
  assert.equal(realtimeUrl("https://h/", "m 1"), "wss://h/v1/realtime?model=m+1");
  assert.equal(realtimeUrl("ws://h/v1/realtime"), "ws://h/v1/realtime");
});

test("backoff doubles up to its ceiling with jitter below each step", () => {
  assert.deepEqual([...backoffDelays({ initialMs: 100, maxMs: 500, attempts: 6 }, () => 0)], [100, 200, 400, 500, 500]);
  assert.deepEqual([...backoffDelays({ initialMs: 100, jitter: 0.5, attempts: 3 }, () => 1)], [50, 100]);
});

test("a turn: subprotocols, user item then response.create, deltas, result, local conversation", async () => {
  const server = new FakeServer();
  const c = client(server, { apiKey: "sk-1", model: "m", instructions: "Be brief.", maxOutputTokens: 50 });
  const turn = await c.send("Hi", { maxOutputTokens: 7, metadata: { k: "v" } });
  assert.equal(server.last.url, "ws://gw.test:8000/v1/realtime?model=m");
  assert.deepEqual(server.last.protocols, ["realtime", "openai-insecure-api-key.sk-1"]);
  assert.deepEqual(server.received.map(([, e]) => e.type), ["session.update", "conversation.item.create", "response.create"]);
  assert.deepEqual(server.sent("session.update")[0].session,
    { type: "realtime", instructions: "Be brief.", max_output_tokens: 50 });
  assert.deepEqual(server.sent("conversation.item.create")[0].item.content, [{ type: "input_text", text: "Hi" }]);
  assert.deepEqual(server.sent("response.create")[0].response, { max_output_tokens: 7, metadata: { k: "v" } });
  await responseCreated(c);
  const item = server.answer_(["Hel", "lo!"]);
  const deltas = [];
  for await (const d of turn) deltas.push(d);
  const result = await turn.result;
  assert.equal(deltas.join(""), "Hello!");
  assert.equal(result.status, "completed");
  assert.equal(result.tier, "edge");
  assert.equal(result.cachedTokens, 4);
  assert.deepEqual(c.conversation.map((i) => [i.role, i.text]), [["user", "Hi"], ["assistant", "Hello!"]]);
  assert.equal(c.conversation[1].id, item);
  c.close();
});

test("interrupt falls back to delete and re-create on a server without x_text_end", async () => {
  const server = new FakeServer({ truncate: false });
  const c = client(server);
  const turn = await c.send("Hi");
  await responseCreated(c);
  const item = server.answer_(["Once upon ", "a time"], { finish: false });
  const cut = await c.interrupt(4);
  assert.equal((await turn.result).status, "cancelled");
  assert.deepEqual(cut, { itemId: item, text: "Once", method: "replace" });
  const [deleted] = server.sent("conversation.item.delete");
  assert.equal(deleted.item_id, item);
  const recreate = server.sent("conversation.item.create").at(-1);
  assert.equal(recreate.previous_item_id, c.conversation[0].id);
  assert.deepEqual(recreate.item, { type: "message", id: item, role: "assistant", content: [{ type: "output_text", text: "Once" }] });
  assert.deepEqual(c.conversation.map((i) => [i.role, i.text]), [["user", "Hi"], ["assistant", "Once"]]);
  c.close();
});

test("interrupt counts code points, not UTF-16 units", async () => {
  const server = new FakeServer();
  const c = client(server);
  const turn = await c.send("Hi");
  await responseCreated(c);
  server.answer_(["😀😀ab"]);
  await turn.result;
  const cut = await c.interrupt(3);
  assert.equal(server.sent("conversation.item.truncate")[0].x_text_end, 3);
  assert.equal(cut.text, "😀😀a");
  assert.equal(c.conversation[1].text, "😀😀a");
  c.close();
});

test("a silent server fails the turn with silence_timeout and drops the socket", async () => {
  const server = new FakeServer();
  const c = client(server, { silenceTimeoutMs: 50 });
  await c.connect();
  server.silent = true;
  const turn = await c.send("Hi");
  const result = await turn.result;
  assert.equal(result.status, "failed");
  assert.equal(result.error.code, "silence_timeout");
  assert.match(result.error.message, /no event from the gateway/);
  assert.equal(c.connected, false);
  c.close();
});

test("a lost connection fails the turn; the next send reconnects and restores the items with their ids", async () => {
  const server = new FakeServer({ refuse: 0 });
  const c = client(server, { framing: "msgpack", msgpack });
  server.binary = true;
  const first = await c.send("My name is Ada.");
  await responseCreated(c);
  server.answer_(["Hello Ada."]);
  await first.result;
  const second = await c.send("Tell me a story.");
  await responseCreated(c);
  server.answer_(["Once"], { finish: false });
  const disconnected = c.once("disconnected");
  server.drop(server.last);
  assert.deepEqual(await disconnected, { code: 1001, reason: "server shutting down", reconnectInMs: null });
  const lost = await second.result;
  assert.equal(lost.status, "failed");
  assert.equal(lost.error.code, "connection_lost");
  assert.equal(lost.text, "Once");

  server.refuse = 1; // the first attempt fails: backoff, then the second opens
  const retries = [];
  c.on("reconnecting", (r) => retries.push(r.attempt));
  const before = c.conversation.map((i) => ({ ...i }));
  const third = await c.send("What is my name?");
  assert.deepEqual(retries, [1]);
  assert.equal(server.sockets.length, 3);
  assert.deepEqual(server.last.protocols, ["x-openai-realtime-msgpack", "realtime"]);
  const onNew = server.received.filter(([i]) => i === 2).map(([, e]) => e);
  assert.deepEqual(onNew.map((e) => e.type), [...before.map(() => "conversation.item.create"), "conversation.item.create",
    "response.create"]);
  assert.deepEqual(onNew.slice(0, before.length).map((e) => [e.item.id, e.item.role, e.item.content[0]]),
    before.map((i) => [i.id, i.role, { type: i.role === "assistant" ? "output_text" : "input_text", text: i.text }]));
  assert.equal(c.sessions, 2);
  await responseCreated(c);
  server.answer_(["Ada."]);
  assert.equal((await third.result).text, "Ada.");
  c.close();
});

test("a socket that never opens is a connect timeout after the retries", async () => {
  const server = new FakeServer({ neverOpen: true });
  const c = client(server, { connectTimeoutMs: 20, backoff: { initialMs: 1, attempts: 2 } });
  await assert.rejects(c.send("Hi"), (e) => e instanceof GatewayUnreachable && e.code === "connect_timeout");
  assert.equal(server.sockets.length, 2);
  assert.equal(c.activeTurn, null);
  assert.deepEqual(c.conversation, []);
});

test("an unreachable gateway says so", async () => {
  const server = new FakeServer({ refuse: 5 });
  const c = client(server, { backoff: { attempts: 1 } });
  await assert.rejects(c.connect(), (e) => e instanceof GatewayUnreachable && /cannot reach the gateway/.test(e.message));
});

test("a refused response.create fails the turn with the server's error", async () => {
  const server = new FakeServer();
  const c = client(server);
  await c.connect();
  server.silent = true;
  const turn = await c.send("Hi");
  const create = server.sent("response.create")[0];
  server.emit(server.last, { type: "error", error: { code: "rate_limit_exceeded", message: "slow down",
    event_id: create.event_id } });
  const result = await turn.result;
  assert.equal(result.status, "failed");
  assert.equal(result.error.code, "rate_limit_exceeded");
  assert.equal(c.activeTurn, null);
  c.close();
});

test("function calls: tools on the session and the turn, the call with parsed arguments, its output, the restore", async () => {
  const server = new FakeServer();
  const weather = { type: "function", name: "get_weather", description: "Weather.",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } };
  const chatShaped = { type: "function", function: { name: "get_time", parameters: { type: "object" }, strict: true } };
  const c = client(server, { tools: [weather, chatShaped], toolChoice: "auto" });
  const turn = await c.send("Weather in Paris?", { toolChoice: "required", parallelToolCalls: false });
  assert.deepEqual(server.sent("session.update")[0].session, { type: "realtime", tool_choice: "auto",
    tools: [weather, { type: "function", name: "get_time", parameters: { type: "object" } }] });
  assert.deepEqual(server.sent("response.create")[0].response, { tool_choice: "required", parallel_tool_calls: false });
  const onTurn = [];
  turn.on("functionCall", (call) => onTurn.push(call));
  const onClient = c.once("functionCall");
  await responseCreated(c);
  const item = server.call_("get_weather", ['{"city": ', '"Paris"}']);
  const result = await turn.result;
  const call = { callId: "call_1", name: "get_weather", arguments: '{"city": "Paris"}', parsed: { city: "Paris" },
    itemId: item.id, responseId: "resp_1", status: "completed", complete: true };
  assert.deepEqual(onTurn, [call]);
  assert.deepEqual((await onClient).call, call);
  assert.deepEqual(result.calls, [call]);
  assert.equal(result.text, "");
  assert.equal(result.itemId, null);
  assert.deepEqual(c.conversation.map((i) => i.type), ["message", "function_call"]);
  assert.equal(await c.interrupt(3), null); // a call is not a message: nothing to cut

  await assert.rejects(c.sendToolOutput("call_nope", "{}"), (e) => e.code === "unknown_call_id");
  const next = await c.sendToolOutput(call.callId, { temperature: 21 }, { toolChoice: "none", maxOutputTokens: 40 });
  const output = server.sent("conversation.item.create").at(-1).item;
  assert.deepEqual(output, { type: "function_call_output", id: output.id, call_id: "call_1", output: '{"temperature":21}' });
  assert.deepEqual(server.sent("response.create").at(-1).response, { tool_choice: "none", max_output_tokens: 40 });
  assert.equal(next.userItemId, null);
  await responseCreated(c);
  server.answer_(["It is 21 degrees."]);
  assert.equal((await next.result).text, "It is 21 degrees.");
  assert.deepEqual(c.conversation.map((i) => i.type), ["message", "function_call", "function_call_output", "message"]);

  // a dropped connection: the next turn's new session gets the call and its output back, same ids
  const disconnected = c.once("disconnected");
  server.drop(server.last);
  await disconnected;
  const again = await c.send("Thanks");
  const onNew = server.received.filter(([i]) => i === 1).map(([, e]) => e).filter((e) => e.type === "conversation.item.create");
  assert.deepEqual(onNew.slice(0, 4).map((e) => [e.item.type, e.item.id]), c.conversation.slice(0, 4).map((i) => [i.type, i.id]));
  assert.deepEqual(onNew[1].item, { type: "function_call", id: item.id, call_id: "call_1", name: "get_weather",
    arguments: '{"city": "Paris"}', status: "completed" });
  await responseCreated(c);
  server.answer_(["You're welcome."]);
  await again.result;
  c.close();
});

const hint = (afterMs) => JSON.stringify({ reconnect: true, after_ms: afterMs });

test("reconnectHint reads the gateway's drain close and nothing else", () => {
  assert.equal(reconnectHint(1001, '{"reconnect":true,"after_ms":1234}'), 1234);
  assert.equal(reconnectHint(1001, '{"reconnect":true}'), 0);
  assert.equal(reconnectHint(1001, '{"reconnect":true,"after_ms":9e9}'), 60000);
  assert.equal(reconnectHint(1001, '{"reconnect":true,"after_ms":-5}'), 0);
  assert.equal(reconnectHint(1001, "server shutting down"), null);
  assert.equal(reconnectHint(1001, '{"reconnect":false,"after_ms":5}'), null);
  assert.equal(reconnectHint(1001, "[1]"), null);
  assert.equal(reconnectHint(1001, ""), null);
  assert.equal(reconnectHint(1000, '{"reconnect":true,"after_ms":5}'), null);
});

test("a drained session reconnects by itself after after_ms and restores every item, with no error", async () => {
  const server = new FakeServer();
  const c = client(server);
  const errors = [];
  c.on("error", (e) => errors.push(e));
  for (const [text, answer] of [["My name is Ada.", "Hello Ada."], ["I like tea.", "Noted."]]) {
    const turn = await c.send(text);
    await responseCreated(c);
    server.answer_([answer]);
    assert.equal((await turn.result).status, "completed");
  }
  const before = c.conversation.map((i) => ({ ...i }));
  const disconnected = c.once("disconnected");
  const connected = c.once("connected");
  const closedAt = performance.now();
  server.drop(server.last, 1001, hint(40));
  assert.deepEqual(await disconnected, { code: 1001, reason: hint(40), reconnectInMs: 40 });
  const { restored } = await connected; // no send() needed: the client came back by itself
  assert.ok(performance.now() - closedAt >= 35, "reconnected before after_ms");
  assert.equal(restored, 4);
  assert.equal(server.sockets.length, 2);
  assert.equal(c.sessions, 2);
  const onNew = server.received.filter(([i]) => i === 1).map(([, e]) => e);
  assert.deepEqual(onNew.map((e) => [e.type, e.item.id, e.item.role, e.item.content[0].text]),
    before.map((i) => ["conversation.item.create", i.id, i.role, i.text]));

  const third = await c.send("What is my name?");
  await responseCreated(c);
  server.answer_(["Ada."]);
  const result = await third.result;
  assert.equal(result.status, "completed");
  assert.equal(result.text, "Ada.");
  assert.deepEqual(errors, []);
  c.close();
});

test("a 1001 without the hint keeps today's behaviour: no reconnect until the next operation", async () => {
  const server = new FakeServer();
  const c = client(server);
  await c.connect();
  const disconnected = c.once("disconnected");
  server.drop(server.last, 1001, "server shutting down");
  assert.deepEqual(await disconnected, { code: 1001, reason: "server shutting down", reconnectInMs: null });
  assert.equal(c._reconnectTimer, null);
  assert.equal(server.sockets.length, 1);
  c.close();
});

test("a turn sent just as the session was drained starts on the next session", async () => {
  const server = new FakeServer({ drainOnCreate: hint(5) });
  const c = client(server);
  const errors = [];
  c.on("error", (e) => errors.push(e));
  const first = await c.send("Hi", { maxOutputTokens: 9 });
  const connected = await c.once("connected"); // the old session never took the request
  assert.equal(connected.restored, 1);
  await responseCreated(c);
  assert.equal(server.sockets.length, 2);
  const onNew = server.received.filter(([i]) => i === 1).map(([, e]) => e);
  assert.deepEqual(onNew.map((e) => e.type), ["conversation.item.create", "response.create"]);
  assert.equal(onNew[0].item.id, first.userItemId);
  assert.deepEqual(onNew[1].response, { max_output_tokens: 9 });
  assert.equal(onNew[1].event_id, first.createEventId);
  server.answer_(["Hello!"]);
  const result = await first.result;
  assert.equal(result.status, "completed");
  assert.equal(result.text, "Hello!");
  assert.deepEqual(c.conversation.map((i) => [i.role, i.text]), [["user", "Hi"], ["assistant", "Hello!"]]);
  assert.deepEqual(errors, []);
  c.close();
});

test("cancel() while a drained turn waits for the next session ends it cancelled, and close() stops the reconnect", async () => {
  const server = new FakeServer({ drainOnCreate: hint(60000) });
  const c = client(server);
  const disconnected = c.once("disconnected");
  const turn = await c.send("Hi");
  assert.equal((await disconnected).reconnectInMs, 60000);
  assert.equal(c.activeTurn, turn);
  const result = await c.cancel();
  assert.equal(result.status, "cancelled");
  assert.equal(c.activeTurn, null);
  c.close(); // clears the 60 s timer: the test process would otherwise wait for it
  assert.equal(c._reconnectTimer, null);
  assert.equal(server.sockets.length, 1);
});

test("close() while a drained client waits between reconnect attempts ends the reconnect: no session opens after it",
  async (t) => {
    t.mock.timers.enable({ apis: ["setTimeout"] });
    const server = new FakeServer();
    const c = client(server, { backoff: { initialMs: 1000, attempts: 3 }, random: () => 0 });
    const failures = [];
    c.on("reconnect_failed", (e) => failures.push(e));
    await c.connect();
    server.refuse = 1; // the first attempt after the drain fails: the next one is 1 s later
    const disconnected = c.once("disconnected");
    const retrying = c.once("reconnecting");
    server.drop(server.last, 1001, hint(0));
    await disconnected;
    t.mock.timers.tick(0); // the hint's 0 ms
    assert.equal((await retrying).delayMs, 1000);
    c.close(); // as an application does when its user leaves, or node:test's after() hook
    t.mock.timers.tick(1000);
    await new Promise(setImmediate); // the fake server answers within microtasks
    assert.equal(server.sockets.length, 2, "a socket was opened after close()");
    assert.equal(c.connected, false);
    assert.deepEqual(failures, []);
  });

test("a reconnect whose restore gets no answer drops that session and tries again", { timeout: 5000 }, async () => {
  const server = new FakeServer();
  const c = client(server, { requestTimeoutMs: 20 });
  const failures = [];
  c.on("reconnect_failed", (e) => failures.push(e));
  const turn = await c.send("My name is Ada.");
  await responseCreated(c);
  server.answer_(["Hello Ada."]);
  await turn.result;
  const connected = c.once("connected");
  server.stall = 1; // the next session takes the socket, then leaves the first restored item unanswered
  server.drop(server.last, 1001, hint(0));
  const { restored } = await connected;
  assert.equal(restored, 2);
  assert.equal(server.sockets.length, 3);
  assert.equal(server.sockets[1].readyState, 3, "the half-restored session was left open");
  assert.equal(c.sessions, 3);
  assert.deepEqual(failures, []);
  c.close();
});

test("a session lost while send() reconnects does not fail its turn: the next attempt carries it", async () => {
  const server = new FakeServer();
  const c = client(server);
  const first = await c.send("My name is Ada.");
  await responseCreated(c);
  server.answer_(["Hello Ada."]);
  await first.result;
  const disconnected = c.once("disconnected");
  server.drop(server.last, 1006, "");
  await disconnected;
  // the next session goes away while its items are being restored (the first one unanswered)
  server.stall = 1;
  const off = c.on("event", (e) => {
    if (e.type === "session.created") { off(); queueMicrotask(() => server.drop(server.last, 1006, "")); }
  });
  const turn = await c.send("What is my name?");
  await responseCreated(c);
  server.answer_(["Ada."]);
  const result = await turn.result;
  assert.equal(result.status, "completed", JSON.stringify(result));
  assert.equal(server.sockets.length, 3);
  assert.equal(server.sent("response.create").length, 2);
  assert.deepEqual(c.conversation.map((i) => i.text), ["My name is Ada.", "Hello Ada.", "What is my name?", "Ada."]);
  c.close();
});

test("a session lost just as send()'s reconnect completes fails the turn at once", { timeout: 5000 }, async () => {
  const server = new FakeServer();
  const c = client(server);
  await c.connect();
  const disconnected = c.once("disconnected");
  server.drop(server.last, 1006, "");
  await disconnected;
  c.on("connected", () => { // the close arrives before send() goes on
    const ws = server.last;
    ws.readyState = 3;
    ws.onclose({ code: 1006, reason: "" });
  });
  await assert.rejects(c.send("Hi"), (e) => e.code === "connection_lost");
  assert.equal(c.activeTurn, null);
  c.close();
});
