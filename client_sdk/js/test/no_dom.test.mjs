// React Native has a WebSocket and fetch but no DOM (document, window, location) and no Web Audio:
// the protocol module and the device fallback must import and run there. This file removes every
// such global before it imports them (a fresh copy, so nothing loaded earlier counts), then runs a
// turn online and one on a scripted device engine.
import assert from "node:assert/strict";
import { test } from "node:test";

import { FakeServer } from "./fake_server.mjs";

const BROWSER_ONLY = ["document", "window", "location", "navigator", "AudioContext", "AudioWorkletNode",
  "MediaStream", "caches", "crossOriginIsolated", "self"];

test("rtgw.js and rtgw-device.js work without DOM or Web Audio globals", async () => {
  for (const name of BROWSER_ONLY) {
    try { delete globalThis[name]; } catch { /* not configurable */ }
    assert.equal(typeof globalThis[name], "undefined", `${name} is still defined`);
  }
  const { RealtimeClient } = await import("../rtgw.js?no-dom");
  const { DeviceFallback } = await import("../rtgw-device.js?no-dom");
  const engine = {
    async load() {},
    async* generate() { yield { text: "offline" }; yield { done: true, finishReason: "stop", usage: {} }; },
  };
  const store = { stored: async () => ({ model: "m", url: "/f", bytes: 1, sha256: "x", family: "smollm2" }),
    load: async () => new Blob(["x"]) };
  const server = new FakeServer();
  const client = new RealtimeClient({ url: "http://gw.test:8000", WebSocket: server.WebSocket, backoff: { initialMs: 1 },
    fetch: async () => { throw new Error("no network"); }, device: new DeviceFallback({ engine, store, probeTimeoutMs: 100 }) });
  const online = await client.send("Hi");
  while (!online.responseId) await client.once("event");
  server.answer_(["Hello"]);
  assert.equal((await online.result).text, "Hello");
  server.drop(server.last, 1006, "");
  await client.once("disconnected");
  server.refuse = 100;
  const result = await (await client.send("Still there?")).result;
  assert.equal(result.tier, "device");
  assert.equal(result.text, "offline");
  client.close();
});
