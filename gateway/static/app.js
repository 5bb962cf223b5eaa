// The demo page: a chat over the JS SDK the gateway serves at /sdk/rtgw.js (its voice classes, for
// Talk, at /sdk/rtgw-voice.js); no build step.
// Each answer streams into its bubble; in speaking mode it is revealed at a speaking rate, as a
// voice would read it, and Stop is barge-in: the conversation keeps what was shown. With the demo
// tools on, a call is shown in the answer (its function and arguments), answered by the page with
// a canned JSON output, and the model goes on from it in the next bubble. Talk starts a voice
// conversation (the SDK's VoiceSession): the microphone streams to the server, whose voice detection
// answers each utterance in speech; the page plays it, and talking over an answer interrupts it (the
// conversation keeps the words played).
// Answers render as markdown (answer.js: marked, then DOMPurify; the model's raw HTML is shown as text, never
// injected; images are not fetched). With "Answer on this device" on (Settings), the page loads the
// SDK's on-device fallback (rtgw-device.js, llama.cpp in WebAssembly), downloads the model once with
// a progress bar, and answers on the device whenever the server is away; the badge says where.
import { GatewayRefused, GatewayUnreachable, RealtimeClient } from "../sdk/rtgw.js";
import { VoiceSession } from "../sdk/rtgw-voice.js";
import { renderMarkdown, SPEAK_RATE, TurnView } from "./answer.js";

const STORE = "rtgw-demo";
const MAX_TOOL_ROUNDS = 3; // calls answered in a row before the model must answer in text
const DEFAULT_MAX_TOKENS = 512; // the gateway's own default: room for a code answer

// The demo tools, answered by this page. Strings are bounded so that a small model cannot write
// one until it runs out of tokens.
const DEMO_TOOLS = [
  { type: "function", name: "get_weather", description: "The current weather in a city.",
    parameters: { type: "object", properties: { city: { type: "string", maxLength: 40 },
      unit: { type: "string", enum: ["C", "F"] } }, required: ["city", "unit"], additionalProperties: false } },
  { type: "function", name: "get_time", description: "The current time in a time zone.",
    parameters: { type: "object", properties: { timezone: { type: "string", maxLength: 40 } },
      required: ["timezone"], additionalProperties: false } },
];

function answerCall(call) {
  const args = call.parsed ?? {};
  if (call.name === "get_weather") {
    const celsius = args.unit !== "F";
    return { city: args.city ?? "", temperature: celsius ? 21 : 70, unit: celsius ? "C" : "F", sky: "clear",
      note: "canned by the demo page" };
  }
  if (call.name === "get_time") return { timezone: args.timezone ?? "UTC", time: new Date().toISOString() };
  return { error: `no such tool: ${call.name}` };
}

const el = (id) => document.getElementById(id);
const ui = {
  status: el("status"), banner: el("banner"), messages: el("messages"), form: el("composer"), prompt: el("prompt"),
  send: el("send"), stop: el("stop"), model: el("model"), maxTokens: el("max-tokens"), apiKey: el("api-key"),
  speaking: el("speaking"), newChat: el("new-chat"), rate: el("rate"), tools: el("tools"), mic: el("mic"),
  voiceState: el("voice-state"), offline: el("offline"), device: el("device"), deviceLabel: el("device-label"),
  deviceProgress: el("device-progress"),
};

let client = null;
let active = null; // the TurnView of the answer being streamed or spoken
let voice = null; // the VoiceSession while Talk is on
let deviceModule = null; // rtgw-device.js, imported only once the on-device setting is on
let device = null; // its DeviceFallback, shared by the clients of this page (the model stays loaded)
let lastProgress = null;
// What the voice conversation did, for the console and the page's test.
const voiceStats = { audioDeltas: 0, receivedMs: 0, playbackStarts: 0, cuts: [], transcripts: [], turns: [],
  errors: [] };

// --- settings, kept in localStorage ---

function loadSettings() {
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(STORE) || "{}"); } catch { /* a fresh start */ }
  ui.apiKey.value = saved.apiKey ?? "";
  ui.maxTokens.value = saved.maxTokens ?? DEFAULT_MAX_TOKENS;
  ui.offline.checked = Boolean(saved.offline);
  ui.speaking.checked = Boolean(saved.speaking);
  ui.tools.value = ["auto", "required"].includes(saved.tools) ? saved.tools : "off";
  ui.rate.textContent = String(SPEAK_RATE);
  return saved;
}

function saveSettings() {
  localStorage.setItem(STORE, JSON.stringify({ apiKey: ui.apiKey.value.trim(), model: ui.model.value,
    maxTokens: Number(ui.maxTokens.value) || DEFAULT_MAX_TOKENS, speaking: ui.speaking.checked, tools: ui.tools.value,
    offline: ui.offline.checked }));
}

const authHeaders = () => (ui.apiKey.value.trim() ? { Authorization: `Bearer ${ui.apiKey.value.trim()}` } : {});

// --- status and messages ---

function setStatus(state, text) {
  ui.status.dataset.state = state;
  ui.status.textContent = text;
}

function showBanner(text) {
  ui.banner.textContent = text;
  ui.banner.hidden = false;
}

function hideBanner() { ui.banner.hidden = true; }

function explain(error) {
  if (error instanceof GatewayRefused) {
    if (error.status === 401) return `The server refused the API key (${error.code}). Enter a valid key in Settings.`;
    if (error.status === 403) return `The server refused this page (${error.code}).`;
    if (error.status === 404) return `The server does not serve this model (${error.code}). Pick another in Settings.`;
    return error.message;
  }
  if (error instanceof GatewayUnreachable) {
    return `Cannot reach the server at ${location.origin}. Is it running? (${error.message})`;
  }
  return error?.message ?? String(error);
}

function addMessage(role, text) {
  ui.messages.querySelector(".hint")?.remove();
  const box = document.createElement("div");
  box.className = `msg ${role}`;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  box.append(body);
  if (role === "assistant") {
    const meta = document.createElement("div");
    meta.className = "meta";
    box.append(meta);
  }
  ui.messages.append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
}

// --- on the device ---

async function loadDevice() {
  if (!ui.offline.checked) return null;
  deviceModule ??= await import("../sdk/rtgw-device.js");
  if (!device) {
    device = new deviceModule.DeviceFallback();
    device.on("state", showDevice);
    device.on("progress", (p) => { lastProgress = p; showDevice(); });
  }
  return device;
}

function showDevice() {
  ui.device.hidden = !device;
  if (!device) return;
  const state = device.state;
  let mode = client?.mode === "device" ? "device" : "online";
  let label = mode === "device" ? "on device" : state === "ready" ? "online · device ready" : "online";
  if (state === "downloading") {
    mode = "downloading";
    const p = lastProgress;
    label = p?.total ? `downloading ${Math.floor((100 * p.loaded) / p.total)}%` : "downloading";
    ui.deviceProgress.max = p?.total || 1;
    ui.deviceProgress.value = p?.loaded ?? 0;
  } else if (state === "loading") {
    mode = "loading";
    label = "loading the model";
  } else if (state === "error" && mode !== "device") {
    mode = "error";
    label = "device: unavailable";
    ui.device.title = device.error?.message ?? "";
  }
  ui.deviceProgress.hidden = state !== "downloading";
  ui.device.dataset.mode = mode;
  ui.deviceLabel.textContent = label;
}

function prefetch() {
  if (!device || !client?.connected) return;
  client.prefetchOffline().catch((e) => showBanner(`The on-device model is not available: ${e.message}`));
}

// --- the client ---

function newClient() {
  client?.close();
  const c = new RealtimeClient({
    url: location.origin, apiKey: ui.apiKey.value.trim() || null, model: ui.model.value || null,
    backoff: { initialMs: 250, maxMs: 2000, attempts: 3 }, connectTimeoutMs: 15000, silenceTimeoutMs: 120000,
    device,
  });
  c.on("mode", () => { if (client === c) showDevice(); });
  c.on("connected", ({ restored }) => {
    if (client !== c) return;
    hideBanner();
    setStatus("connected", restored ? `reconnected, ${restored} messages restored` : "connected");
    showDevice();
    prefetch();
  });
  c.on("disconnected", ({ reconnectInMs }) => {
    if (client !== c) return;
    // reconnectInMs: the server is going away (drained) and the client reconnects by itself
    setStatus("idle", reconnectInMs === null ? "disconnected: the next message reconnects" : "the server is restarting: reconnecting…");
  });
  c.on("reconnect_failed", () => { if (client === c) setStatus("idle", "disconnected: the next message reconnects"); });
  c.on("reconnecting", ({ attempt }) => { if (client === c) setStatus("connecting", `connecting (try ${attempt + 1})…`); });
  c.on("error", (e) => { if (client === c) showBanner(`Server error: ${e.message}`); });
  client = c;
  return c;
}

async function connect() {
  const c = client;
  setStatus("connecting", "connecting…");
  try {
    await c.connect();
  } catch (e) {
    if (client !== c) return;
    setStatus("error", e instanceof GatewayRefused ? "refused" : "unreachable");
    showBanner(explain(e) + (device && !(e instanceof GatewayRefused) ? " Answers come from this device meanwhile." : ""));
  }
}

async function loadModels(wanted) {
  let response;
  try {
    response = await fetch("v1/models", { headers: authHeaders() });
  } catch {
    return; // the connection attempt says it better
  }
  if (!response.ok) return;
  const { data } = await response.json();
  ui.model.replaceChildren(new Option("server default", ""), ...data.map((m) => new Option(m.id, m.id)));
  if (data.some((m) => m.id === wanted)) ui.model.value = wanted;
}

function newChat() {
  if (active) return;
  if (voice) stopVoice();
  ui.messages.replaceChildren();
  newClient();
  connect();
}

function toolOptions(round) {
  const mode = ui.tools.value;
  if (mode === "off") return {};
  // After a call the model answers from its output: "required" would only call again.
  const choice = round === 0 ? mode : (mode === "required" || round >= MAX_TOOL_ROUNDS ? "none" : "auto");
  // An answer that may call makes one call, greedily: a 135M model otherwise tends to repeat it,
  // or to wander in its arguments.
  return { tools: DEMO_TOOLS, toolChoice: choice, parallelToolCalls: false,
    ...(choice === "none" ? {} : { temperature: 0 }) };
}

async function send(text) {
  hideBanner();
  addMessage("user", text);
  let view = new TurnView(addMessage("assistant", ""), ui.speaking.checked);
  active = view;
  setBusy(true);
  try {
    const maxOutputTokens = Number(ui.maxTokens.value) || DEFAULT_MAX_TOKENS;
    let turn = await client.send(text, { maxOutputTokens, ...toolOptions(0) });
    for (let round = 1; ; round++) {
      if (client.mode === "device") setStatus("idle", "the server is away: answering on this device");
      else if (ui.status.dataset.state !== "connected") setStatus("connected", "connected");
      view.attach(turn);
      const result = await turn.result;
      view.finish(result);
      if (result.tier === "device") hideBanner();
      if (result.error?.code === "connection_lost" || result.error?.code === "silence_timeout") {
        showBanner(`${result.error.message}. The next message reconnects and restores the conversation.`);
      }
      await view.revealed;
      const calls = result.calls.filter((call) => call.complete);
      if (result.status !== "completed" || !calls.length || active !== view) break;
      // The page answers each call, then the model goes on from the outputs in a new bubble.
      const outputs = {};
      for (const call of calls) {
        outputs[call.callId] = answerCall(call);
        view.showOutput(call.callId, outputs[call.callId]);
      }
      view = new TurnView(addMessage("assistant", ""), ui.speaking.checked);
      active = view;
      turn = await client.sendToolOutputs(outputs, { maxOutputTokens, ...toolOptions(round) });
    }
  } catch (e) {
    view.fail(explain(e));
    setStatus("error", e instanceof GatewayRefused ? "refused" : "unreachable");
    showBanner(explain(e));
  } finally {
    if (active === view) active = null;
    setBusy(false);
  }
}

async function stop() {
  const view = active;
  if (!view) return;
  ui.stop.disabled = true;
  if (voice && view.voice) { // Stop on a spoken answer: barge-in by hand
    try {
      await voice.interrupt();
    } catch (e) {
      showBanner(`Could not cut the answer on the server: ${e.message}`);
    }
    return;
  }
  if (!view.speaking) {
    await client.cancel();
    return;
  }
  const heard = view.shown; // barge-in: keep what was shown
  view.stopReveal();
  try {
    view.interrupted(await client.interrupt(heard));
  } catch (e) {
    showBanner(`Could not cut the answer on the server: ${e.message}`);
  }
}

// --- voice ---

function setVoiceState(text) {
  ui.voiceState.hidden = !text;
  ui.voiceState.textContent = text;
}

/** A spoken answer the server started (its voice detection committed what the user said). */
async function showVoiceTurn(turn) {
  const view = new TurnView(addMessage("assistant", ""), false);
  view.voice = true;
  view.box.classList.add("voice");
  const entry = { responseId: turn.responseId, itemId: null, view };
  voiceStats.turns.push(entry);
  if (!active) active = view;
  setBusy(true);
  view.attach(turn);
  const result = await turn.result;
  entry.itemId = result.itemId;
  if (result.itemId) view.box.dataset.itemId = result.itemId;
  view.finish(result);
  if (active === view) {
    active = null;
    setBusy(false);
  }
}

async function startVoice() {
  hideBanner();
  const c = client;
  const v = new VoiceSession(c, { voice: "alloy" });
  voice = v;
  ui.mic.setAttribute("aria-pressed", "true");
  ui.mic.textContent = "Stop talking";
  setVoiceState("starting the microphone…");
  v.off = [
    c.on("audio", ({ pcm }) => { voiceStats.audioDeltas += 1; voiceStats.receivedMs += pcm.length / 24; }),
    c.on("speechStarted", () => setVoiceState("hearing you…")),
    c.on("speechStopped", () => setVoiceState("thinking…")),
    c.on("committed", ({ itemId }) => {
      const box = addMessage("user", "");
      box.classList.add("voice");
      box.dataset.itemId = itemId;
    }),
    c.on("transcript", ({ itemId, transcript }) => {
      voiceStats.transcripts.push(transcript);
      const box = ui.messages.querySelector(`.msg.user[data-item-id="${CSS.escape(itemId)}"]`);
      if (box) box.querySelector(".text").textContent = transcript || "(nothing heard)";
    }),
    c.on("serverTurn", (turn) => { showVoiceTurn(turn); }),
    v.player.on("started", () => { voiceStats.playbackStarts += 1; setVoiceState("speaking (talk to interrupt)"); }),
    v.player.on("stopped", () => setVoiceState("listening…")),
  ];
  v.on("interrupted", (cut) => {
    voiceStats.cuts.push(cut);
    const entry = voiceStats.turns.find((t) => (t.itemId ?? t.view.turn?.itemId) === cut.itemId);
    entry?.view.interrupted(cut);
  });
  v.on("error", (e) => { voiceStats.errors.push(e.message); showBanner(`Voice: ${e.message}`); });
  try {
    await v.start();
    setVoiceState("listening…");
  } catch (e) {
    voiceStats.errors.push(e.message);
    stopVoice();
    showBanner(e.name === "NotAllowedError" ? "The microphone was refused: allow it for this page to talk."
      : `The microphone could not start: ${explain(e)}`);
  }
}

function stopVoice() {
  const v = voice;
  if (!v) return;
  voice = null;
  v.stop();
  for (const off of v.off ?? []) off();
  ui.mic.setAttribute("aria-pressed", "false");
  ui.mic.textContent = "Talk";
  setVoiceState("");
  v.client.configure({ outputModalities: ["text"] }).catch(() => {}); // typed turns are written again
}

// --- wiring ---

const saved = loadSettings();
ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.prompt.value.trim();
  if (!text || active) return;
  ui.prompt.value = "";
  send(text);
});
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.form.requestSubmit();
  }
});
ui.stop.addEventListener("click", stop);
ui.mic.addEventListener("click", () => (voice ? stopVoice() : startVoice()));
ui.newChat.addEventListener("click", newChat);
ui.maxTokens.addEventListener("change", saveSettings);
ui.speaking.addEventListener("change", saveSettings);
ui.tools.addEventListener("change", saveSettings);
ui.offline.addEventListener("change", async () => {
  saveSettings();
  if (active) return;
  if (!ui.offline.checked) {
    await device?.store?.clear(); // "keeps the model": off, it is not kept
    device = null;
  } else {
    await loadDevice();
  }
  showDevice();
  newChat(); // a client with (or without) the fallback; prefetch starts once it is connected
});
ui.model.addEventListener("change", () => { saveSettings(); newChat(); });
ui.apiKey.addEventListener("change", async () => {
  saveSettings();
  await loadModels(ui.model.value);
  newChat();
});

await loadModels(saved.model);
await loadDevice();
showDevice();
newClient();
connect();
// for the console and the page's tests
globalThis.rtgwDemo = {
  client: () => client,
  device: () => device,
  renderMarkdown,
  voice: () => ({ ...voiceStats, on: voice !== null, playing: voice?.player.playing ?? false,
    playedMs: voice?.player.playedMs() ?? 0, bargeIns: voice?.bargeIns ?? 0, micMs: voice?.microphone.capturedMs ?? 0,
    micKind: voice?.microphone.kind ?? null, turns: voiceStats.turns.map(({ responseId, itemId, view }) => ({
      responseId, itemId: itemId ?? view.turn?.itemId ?? null, status: view.box.dataset.status })) }),
};
