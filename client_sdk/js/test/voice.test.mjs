// The SDK's voice parts in Node: no gateway, no browser. The conversions and the downsampler on
// numbers; the player on a fake AudioContext whose clock the test moves; the client's audio events
// and a VoiceSession's barge-in over a scripted socket that answers as the gateway does. The real
// thing (a microphone, Web Audio, the voice pipeline) is tests/gateway/test_demo_voice.py.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import * as msgpack from "../msgpack.js";
import { AudioPlayer, Downsampler, float32ToPcm16, pcm16ToFloat32, VoiceSession } from "../rtgw-voice.js";
import { base64FromBytes, bytesFromBase64, RealtimeClient, sessionFields } from "../rtgw.js";

const tick = () => new Promise((resolve) => setTimeout(resolve, 0));

function sine(hz, rate, seconds) {
  const n = Math.round(rate * seconds);
  return Float32Array.from({ length: n }, (_, i) => 0.5 * Math.sin((2 * Math.PI * hz * i) / rate));
}

function crossings(samples) {
  let n = 0;
  for (let i = 1; i < samples.length; i++) if ((samples[i - 1] < 0) !== (samples[i] < 0)) n++;
  return n;
}

// A module's static imports: their specifiers, comments left out.
const importsOf = (file) => [...readFileSync(new URL(`../${file}`, import.meta.url), "utf8")
  .replace(/^\s*\/\/.*$/gm, "").matchAll(/^(?:import|export)\b[^;]*?\bfrom\s+"([^"]+)"/gms)].map((m) => m[1]);

test("the voice classes build on the client, never the other way round", () => {
  // rtgw.js must load without them (text clients, no Web Audio); an import back would be a cycle
  // in which the voice classes would extend an Emitter not yet initialized
  assert.deepEqual(importsOf("rtgw.js"), []);
  assert.deepEqual(importsOf("rtgw-voice.js"), ["./rtgw.js"]);
});

test("voice settings go into the GA session's audio object", () => {
  assert.deepEqual(sessionFields({ outputModalities: "audio", voice: "marin", turnDetection: "server_vad",
    instructions: "Be brief." }), { instructions: "Be brief.", output_modalities: ["audio"],
    audio: { output: { voice: "marin" }, input: { turn_detection: { type: "server_vad" } } } });
  assert.deepEqual(sessionFields({ turnDetection: null }), { audio: { input: { turn_detection: null } } });
  assert.deepEqual(sessionFields({ turnDetection: "semantic_vad" }),
    { audio: { input: { turn_detection: { type: "semantic_vad" } } } });
  assert.deepEqual(sessionFields({ turnDetection: { type: "semantic_vad", eagerness: "high" } }),
    { audio: { input: { turn_detection: { type: "semantic_vad", eagerness: "high" } } } });
});

test("PCM16 and base64 round trips", () => {
  const pcm = float32ToPcm16(Float32Array.from([-1, -0.5, 0, 0.5, 1, 2]));
  assert.deepEqual([...pcm], [-32768, -16384, 0, 16383, 32767, 32767]);
  assert.ok(Math.abs(pcm16ToFloat32(pcm)[1] + 0.5) < 1e-4);
  const bytes = Uint8Array.from({ length: 100_000 }, (_, i) => (i * 7) & 255); // past one btoa piece
  assert.deepEqual(bytesFromBase64(base64FromBytes(bytes)), bytes);
});

test("the downsampler keeps the tone and the length, chunked as whole", () => {
  for (const rate of [48000, 44100, 24000]) {
    const input = sine(440, rate, 1);
    const whole = new Downsampler(rate).feed(input);
    const chunked = new Downsampler(rate);
    const parts = [];
    for (let i = 0; i < input.length; i += 128) parts.push(...chunked.feed(input.subarray(i, i + 128)));
    assert.ok(whole.length <= 24000 && whole.length >= 23980, `${rate}: ${whole.length}`); // less the filter lag
    assert.deepEqual(parts, [...whole], `${rate}: chunks differ`);
    assert.ok(Math.abs(crossings(whole) - 880) <= 2, `${rate}: ${crossings(whole)} zero crossings`);
  }
  // 15 kHz at 48 kHz cannot exist at 24 kHz (Nyquist 12 kHz): filtered, not folded onto 9 kHz
  const peak = (xs) => Math.max(...xs.slice(100, -100).map(Math.abs));
  assert.ok(peak(new Downsampler(48000).feed(sine(15000, 48000, 0.2))) < 0.02);
  assert.ok(peak(new Downsampler(48000).feed(sine(1000, 48000, 0.2))) > 0.47); // speech kept at its level
});

/** Web Audio's scheduling as far as the player uses it, on a clock the test sets. */
class FakeContext {
  constructor() {
    this.currentTime = 10;
    this.state = "running";
    this.destination = {};
    this.started = [];
  }

  createBuffer(channels, length, rate) {
    const data = new Float32Array(length);
    return { length, sampleRate: rate, duration: length / rate, getChannelData: () => data };
  }

  createBufferSource() {
    const context = this;
    return { connect() {}, start(at) { this.at = at; context.started.push(this); }, stop() { this.stopped = true; } };
  }
}

test("the player schedules chunks back to back and counts what the clock played", () => {
  const context = new FakeContext();
  const player = new AudioPlayer({ context, leadMs: 50 });
  player.enqueue("item_a", new Int16Array(2400)); // 100 ms
  player.enqueue("item_a", new Int16Array(4800)); // 200 ms, right after
  assert.deepEqual(context.started.map((s) => s.at), [10.05, 10.15]);
  assert.equal(player.receivedMs, 300);
  context.currentTime = 10.2;
  assert.ok(Math.abs(player.playedMs() - 150) < 1e-6 && player.playing);
  const stopped = player.stop();
  assert.equal(stopped.itemId, "item_a");
  assert.ok(Math.abs(stopped.playedMs - 150) < 1e-6);
  assert.ok(context.started.every((s) => s.stopped) && !player.playing);
  context.currentTime = 11; // after a gap the next chunk starts ahead of the clock again
  player.enqueue("item_b", new Int16Array(240));
  assert.equal(context.started.at(-1).at, 11.05);
});

/** A scripted gateway for one session: answers settings, truncates and retrieves as the gateway does. */
function scriptedSocket({ binary = false, kept = "" } = {}) {
  const script = { sent: [], socket: null, binary };
  script.WebSocket = class {
    constructor(url, protocols) {
      this.readyState = 0;
      this.protocol = binary ? protocols[0] : "";
      script.socket = this;
      queueMicrotask(() => {
        this.readyState = 1;
        this.onopen?.({});
        script.emit({ type: "session.created", session: { id: "sess_1" } });
      });
    }

    send(data) {
      const event = binary ? msgpack.decode(data) : JSON.parse(data);
      script.sent.push(event);
      const reply = (e) => queueMicrotask(() => script.emit(e));
      if (event.type === "session.update") reply({ type: "session.updated", session: event.session });
      if (event.type === "conversation.item.truncate") {
        reply({ type: "conversation.item.truncated", item_id: event.item_id, content_index: 0,
          audio_end_ms: event.audio_end_ms });
      }
      if (event.type === "conversation.item.retrieve") {
        reply({ type: "conversation.item.retrieved", item: { id: event.item_id, type: "message", role: "assistant",
          content: [{ type: "output_audio", transcript: kept }] } });
      }
      if (event.type === "response.cancel") reply(script.done("cancelled"));
    }

    close() {}
  };
  script.emit = (event) => script.socket.onmessage?.({
    data: binary ? msgpack.encode(event).buffer : JSON.stringify(event) });
  script.done = (status) => ({ type: "response.done", response: { id: "resp_1", status, output: [{ id: "item_a",
    type: "message", role: "assistant", content: [{ type: "output_audio", transcript: "One two three." }] }] } });
  /** The server answers the user's speech by itself: a spoken answer of `chunks` x 100 ms. */
  script.answer = (chunks) => {
    script.emit({ type: "input_audio_buffer.committed", item_id: "item_u", previous_item_id: null });
    script.emit({ type: "conversation.item.added", item: { id: "item_u", type: "message", role: "user",
      content: [{ type: "input_audio", transcript: null }] } });
    script.emit({ type: "response.created", response: { id: "resp_1" } });
    script.emit({ type: "conversation.item.added",
      item: { id: "item_a", type: "message", role: "assistant", content: [] } });
    script.emit({ type: "conversation.item.input_audio_transcription.completed", item_id: "item_u",
      transcript: "Hi." });
    script.emit({ type: "response.output_audio_transcript.delta", response_id: "resp_1", item_id: "item_a",
      delta: "One two three." });
    const pcm = new Uint8Array(4800);
    for (let i = 0; i < chunks; i++) {
      script.emit({ type: "response.output_audio.delta", response_id: "resp_1", item_id: "item_a",
        delta: binary ? pcm : base64FromBytes(pcm) });
    }
  };
  return script;
}

for (const binary of [false, true]) {
  test(`a server-started spoken answer, its audio and the user's words (${binary ? "msgpack" : "JSON"})`, async () => {
    const script = scriptedSocket({ binary });
    const client = new RealtimeClient({ WebSocket: script.WebSocket, framing: binary ? "msgpack" : "json", msgpack,
      outputModalities: ["audio"], voice: "ash" });
    await client.connect();
    assert.deepEqual(script.sent[0].session.audio, { output: { voice: "ash" } });
    client.appendAudio(new Int16Array(70_000)); // 140,000 bytes: two appends
    const appends = script.sent.filter((e) => e.type === "input_audio_buffer.append");
    assert.equal(appends.length, 2);
    const sizes = appends.map((e) => (binary ? e.audio.length : bytesFromBase64(e.audio).length));
    assert.deepEqual(sizes, [131072, 140000 - 131072]);
    assert.throws(() => client.appendAudio(new Uint8Array(3)), /whole 2-byte samples/);

    const turns = [];
    const audio = [];
    client.on("serverTurn", (turn) => { turns.push(turn); turn.on("audio", (pcm) => audio.push(pcm.length)); });
    script.answer(3);
    script.emit(script.done("completed"));
    assert.equal(turns.length, 1);
    const result = await turns[0].result;
    assert.equal(result.status, "completed");
    assert.equal(result.text, "One two three.");
    assert.deepEqual(audio, [2400, 2400, 2400]);
    assert.equal(turns[0].audioMs, 300);
    assert.equal(turns[0].userTranscript, "Hi.");
    assert.deepEqual(client.conversation.map((i) => [i.role, i.text]),
      [["user", "Hi."], ["assistant", "One two three."]]);
    client.close();
  });
}

test("speech over a playing answer stops the player and truncates to the ms it played", async () => {
  const script = scriptedSocket({ kept: "One" });
  const client = new RealtimeClient({ WebSocket: script.WebSocket });
  const context = new FakeContext();
  let onChunk = null;
  const microphone = { start: async (fn) => { onChunk = fn; }, stop() { onChunk = null; } };
  const voice = new VoiceSession(client, { player: new AudioPlayer({ context, leadMs: 0 }), microphone });
  const cuts = [];
  voice.on("interrupted", (cut) => cuts.push(cut));
  await voice.start();
  const update = script.sent.find((e) => e.type === "session.update");
  assert.deepEqual(update.session.output_modalities, ["audio"]);
  assert.deepEqual(update.session.audio.input.turn_detection, { type: "server_vad" });
  onChunk(new Int16Array(2400)); // the microphone's chunks become appends
  assert.equal(script.sent.at(-1).type, "input_audio_buffer.append");

  script.answer(5); // 500 ms, still streaming
  assert.equal(voice.player.receivedMs, 500);
  context.currentTime += 0.2375; // 237.5 ms played
  script.emit({ type: "input_audio_buffer.speech_started", audio_start_ms: 5000, item_id: "item_u2" });
  while (!cuts.length) await tick();
  assert.deepEqual(cuts, [{ itemId: "item_a", audioEndMs: 237, text: "One" }]);
  const truncate = script.sent.find((e) => e.type === "conversation.item.truncate");
  assert.equal(truncate.audio_end_ms, 237);
  assert.ok(context.started.every((s) => s.stopped));
  assert.equal(client.conversation.find((i) => i.id === "item_a").text, "One");
  assert.equal(voice.bargeIns, 1);

  // All of the next answer heard: talking after it cuts nothing.
  script.answer(1);
  script.emit(script.done("completed"));
  context.currentTime += 1;
  script.emit({ type: "input_audio_buffer.speech_started", audio_start_ms: 9000, item_id: "item_u3" });
  await tick();
  assert.equal(script.sent.filter((e) => e.type === "conversation.item.truncate").length, 1);
  voice.stop();
  assert.equal(onChunk, null);
  client.close();
});
