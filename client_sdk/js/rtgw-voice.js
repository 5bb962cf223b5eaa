// rtgw-voice: voice in browsers on top of the rtgw client (rtgw.js), with Web Audio.
// The client speaks audio in any runtime (`appendAudio`, `commitAudio`, `respond`, `truncateAudio`,
// the `audio` and `serverTurn` events); this module is the browser's side of it: `Microphone`
// captures (getUserMedia, an AudioWorklet or a ScriptProcessor, downsampled to 24 kHz),
// `AudioPlayer` plays with Web Audio and counts the ms played, and `VoiceSession` joins them to a
// client with barge-in: speech that starts over an answer stops the player and truncates the
// answer to the audio played (`conversation.item.truncate` with `audio_end_ms`).
//
//   import { RealtimeClient } from "./rtgw.js";
//   import { VoiceSession } from "./rtgw-voice.js";
//   const voice = new VoiceSession(new RealtimeClient({ url }), { voice: "marin" });
//   talkButton.onclick = () => voice.start();   // from a click: browsers want a gesture for audio
//
// It imports from rtgw.js and rtgw.js nothing from it: text-only clients (Node, React Native)
// load no Web Audio code, and the two modules form no import cycle.

import { Emitter, GatewayError, SAMPLE_RATE } from "./rtgw.js";

// --- PCM as floats, and a lower sample rate ---------------------------------------------------

export function float32ToPcm16(samples) {
  const out = new Int16Array(samples.length);
  for (let i = 0; i < samples.length; i++) {
    const x = Math.max(-1, Math.min(1, samples[i]));
    out[i] = x < 0 ? x * 0x8000 : x * 0x7fff;
  }
  return out;
}

export function pcm16ToFloat32(pcm) {
  const out = new Float32Array(pcm.length);
  for (let i = 0; i < pcm.length; i++) out[i] = pcm[i] / 0x8000;
  return out;
}

/** A stream at `fromRate` to `toRate` (lower), fed in chunks of any size: low-passed below the new
 * Nyquist frequency (a Hann-windowed sinc, 16 taps a side per rate ratio: a 48 kHz microphone's
 * 15 kHz is gone at 24 kHz, not folded back onto speech), then read at the new rate by linear
 * interpolation. Positions count from the stream's start (zeros before it), so chunks give exactly
 * what the whole stream would; the output lags by the filter's half length (~1.3 ms). */
export class Downsampler {
  constructor(fromRate, toRate = SAMPLE_RATE) {
    if (!(toRate <= fromRate)) throw new RangeError(`cannot downsample ${fromRate} Hz to ${toRate} Hz`);
    this.ratio = fromRate / toRate;
    const cutoff = 0.45 / this.ratio; // cycles per input sample; the new Nyquist is 0.5 / ratio
    this._half = this.ratio === 1 ? 0 : Math.ceil(16 * this.ratio);
    const taps = [];
    for (let j = -this._half; j <= this._half; j++) {
      const sinc = j === 0 ? 1 : Math.sin(2 * Math.PI * cutoff * j) / (2 * Math.PI * cutoff * j);
      taps.push(2 * cutoff * sinc * (0.5 + 0.5 * Math.cos((Math.PI * j) / (this._half + 1))));
    }
    const sum = taps.reduce((a, b) => a + b, 0);
    this._taps = Float32Array.from(taps, (t) => t / sum);
    this._x = new Float32Array(this._half); // input not used up yet (zeros before the stream)
    this._offset = -this._half; // the stream index of _x[0]
    this._n = 0; // output samples made
  }

  /** Float32 samples in, Float32 samples at the lower rate out. */
  feed(samples) {
    const x = new Float32Array(this._x.length + samples.length);
    x.set(this._x);
    x.set(samples, this._x.length);
    const half = this._half;
    const taps = this._taps;
    const filtered = (k) => { // the low-passed input at stream index k
      let acc = 0;
      for (let j = 0, i = k - half - this._offset; j < taps.length; j++, i++) acc += taps[j] * x[i];
      return acc;
    };
    const out = [];
    for (;;) {
      const p = this._n * this.ratio;
      const k = Math.floor(p);
      const frac = p - k;
      if (k + 1 + half - this._offset >= x.length + (frac === 0 ? 1 : 0)) break;
      out.push(frac === 0 ? filtered(k) : (1 - frac) * filtered(k) + frac * filtered(k + 1));
      this._n += 1;
    }
    const keep = Math.floor(this._n * this.ratio) - half - this._offset;
    this._x = x.slice(keep);
    this._offset += keep;
    return Float32Array.from(out);
  }
}

// --- playback ---------------------------------------------------------------------------------

/** Plays spoken answers with Web Audio: each PCM chunk becomes an AudioBuffer scheduled right after
 * the previous one, and the player knows, per item, how many ms have been played by the clock of
 * the AudioContext (not how many were received). `stop()` silences it at once. */
export class AudioPlayer extends Emitter {
  /** options: context (an AudioContext; default a new one), AudioContext (its constructor), leadMs (50). */
  constructor(options = {}) {
    super();
    this._Context = options.AudioContext ?? globalThis.AudioContext ?? globalThis.webkitAudioContext;
    this.context = options.context ?? null;
    this.leadMs = options.leadMs ?? 50; // the first chunk after a gap starts this far ahead: no clipped start
    this._chunks = []; // {itemId, source, start, seconds}, of the items not yet finished
    this._end = 0; // context time where the scheduled audio ends
    this.itemId = null; // the item whose audio came last
    this.receivedMs = 0; // of that item
    this.chunks = 0; // scheduled, all items
  }

  /** Creates (or resumes) the AudioContext: call it from a user gesture (a click), which browsers
   * require before audio may play. */
  resume() {
    if (!this.context) {
      if (!this._Context) throw new GatewayError("no Web Audio here: pass { context } or { AudioContext }", "no_audio");
      this.context = new this._Context();
    }
    if (this.context.state === "suspended") this.context.resume?.();
    return this.context;
  }

  /** Queues `pcm` (Int16Array at 24 kHz) of item `itemId` after what is scheduled. */
  enqueue(itemId, pcm) {
    const context = this.resume();
    if (itemId !== this.itemId) {
      this.itemId = itemId;
      this.receivedMs = 0;
      this._chunks = this._chunks.filter((c) => c.start + c.seconds > context.currentTime);
    }
    if (!pcm.length) return;
    const buffer = context.createBuffer(1, pcm.length, SAMPLE_RATE);
    buffer.getChannelData(0).set(pcm16ToFloat32(pcm));
    const source = context.createBufferSource();
    source.buffer = buffer;
    source.connect(context.destination);
    const start = Math.max(this._end, context.currentTime + this.leadMs / 1000);
    source.start(start);
    const seconds = pcm.length / SAMPLE_RATE;
    this._end = start + seconds;
    this._chunks.push({ itemId, source, start, seconds });
    this.receivedMs += seconds * 1000;
    this.chunks += 1;
    if (this.chunks === 1 || this._chunks.length === 1) this.emit("started", { itemId, at: start });
  }

  /** Ms of item `itemId` (default: the last one) played so far. */
  playedMs(itemId = this.itemId) {
    const now = this.context?.currentTime ?? 0;
    let played = 0;
    for (const c of this._chunks) {
      if (c.itemId === itemId) played += Math.min(Math.max(0, now - c.start), c.seconds);
    }
    return played * 1000;
  }

  /** Audio still to play (scheduled past the context's clock). */
  get playing() {
    return this.context !== null && this._end > this.context.currentTime;
  }

  /** Silences it now and drops what is scheduled; returns {itemId, playedMs} of the last item. */
  stop() {
    const stopped = { itemId: this.itemId, playedMs: this.playedMs() };
    for (const c of this._chunks) {
      try { c.source.stop(); } catch { /* not started yet, or ended */ }
    }
    this._chunks = [];
    this._end = 0;
    this.itemId = null;
    this.receivedMs = 0;
    this.emit("stopped", stopped);
    return stopped;
  }

  close() {
    this.stop();
    this.context?.close?.();
    this.context = null;
  }
}

// --- capture ----------------------------------------------------------------------------------

// The capture side of an AudioWorklet, loaded from a Blob URL (no file to serve): it posts each
// render quantum's mono samples to the main thread.
const CAPTURE_WORKLET = `registerProcessor("rtgw-capture", class extends AudioWorkletProcessor {
  process(inputs) { const x = inputs[0][0]; if (x) this.port.postMessage(x.slice(0)); return true; }
});`;

/** The microphone as PCM16 at 24 kHz: getUserMedia, an AudioWorklet (a ScriptProcessor where there
 * is none), downsampled from the context's rate, in chunks of `chunkMs`. */
export class Microphone {
  /** options: chunkMs (100), context, AudioContext, mediaDevices, constraints (getUserMedia's audio). */
  constructor(options = {}) {
    this.chunkMs = options.chunkMs ?? 100;
    this._Context = options.AudioContext ?? globalThis.AudioContext ?? globalThis.webkitAudioContext;
    this.context = options.context ?? null;
    this._mediaDevices = options.mediaDevices ?? globalThis.navigator?.mediaDevices;
    this.constraints = options.constraints ?? { channelCount: 1, echoCancellation: true, noiseSuppression: true,
      autoGainControl: true };
    this._stream = null;
    this._nodes = [];
    this.capturedMs = 0; // sent to onChunk so far
  }

  /** Starts capturing; `onChunk(Int16Array)` gets each chunk. Rejects when the user refuses. */
  async start(onChunk) {
    if (!this._mediaDevices?.getUserMedia) {
      throw new GatewayError("no microphone access here (getUserMedia)", "no_microphone");
    }
    this._stream = await this._mediaDevices.getUserMedia({ audio: this.constraints });
    this.context ??= new this._Context();
    if (this.context.state === "suspended") await this.context.resume?.();
    const downsampler = new Downsampler(this.context.sampleRate, SAMPLE_RATE);
    const size = Math.round(SAMPLE_RATE * this.chunkMs / 1000);
    let pending = new Int16Array(0);
    const take = (samples) => {
      const pcm = float32ToPcm16(downsampler.feed(samples));
      const joined = new Int16Array(pending.length + pcm.length);
      joined.set(pending);
      joined.set(pcm, pending.length);
      let at = 0;
      for (; joined.length - at >= size; at += size) {
        this.capturedMs += this.chunkMs;
        onChunk(joined.slice(at, at + size));
      }
      pending = joined.slice(at);
    };
    const source = this.context.createMediaStreamSource(this._stream);
    let node;
    if (this.context.audioWorklet && globalThis.AudioWorkletNode) {
      const url = URL.createObjectURL(new Blob([CAPTURE_WORKLET], { type: "application/javascript" }));
      try { await this.context.audioWorklet.addModule(url); } finally { URL.revokeObjectURL(url); }
      node = new AudioWorkletNode(this.context, "rtgw-capture");
      node.port.onmessage = (message) => take(message.data);
    } else {
      node = this.context.createScriptProcessor(4096, 1, 1); // older browsers
      node.onaudioprocess = (e) => take(e.inputBuffer.getChannelData(0));
    }
    // A muted gain keeps the graph pulling the capture node without playing the microphone back.
    const mute = this.context.createGain();
    mute.gain.value = 0;
    source.connect(node);
    node.connect(mute);
    mute.connect(this.context.destination);
    this._nodes = [source, node, mute];
    this.kind = node.port ? "worklet" : "script-processor";
  }

  stop() {
    for (const node of this._nodes) {
      try { node.disconnect(); } catch { /* not connected */ }
    }
    this._nodes = [];
    for (const track of this._stream?.getTracks() ?? []) track.stop();
    this._stream = null;
  }
}

// --- a voice conversation: capture, playback and barge-in -------------------------------------

/** A voice conversation on a client: the microphone streams into the input buffer, the server's VAD
 * commits each utterance and answers it in speech, the player plays it, and when the user speaks
 * over an answer the player stops and the answer is truncated to the audio played (barge-in).
 * Events: `interrupted` ({itemId, audioEndMs, text}), `error`. */
export class VoiceSession extends Emitter {
  /** options: voice, turnDetection ({type: "server_vad", ...}), player, microphone, bargeIn (true),
   * instructions. */
  constructor(client, options = {}) {
    super();
    this.client = client;
    this.options = options;
    this.player = options.player ?? new AudioPlayer();
    this.microphone = options.microphone ?? new Microphone();
    this.bargeIn = options.bargeIn ?? true;
    this.bargeIns = 0;
    this.active = false;
    this._off = [];
  }

  /** Call it from a user gesture (a click): browsers let audio play only after one. */
  async start() {
    this.player.resume(); // now, while the gesture counts
    const settings = { outputModalities: ["audio"], turnDetection: this.options.turnDetection ?? "server_vad" };
    if (this.options.voice) settings.voice = this.options.voice;
    if (this.options.instructions) settings.instructions = this.options.instructions;
    await this.client.configure(settings);
    await this.client.connect();
    this._off = [
      this.client.on("audio", ({ itemId, pcm }) => this.player.enqueue(itemId, pcm)),
      this.client.on("speechStarted", () => this._speechStarted()),
      this.client.on("disconnected", ({ reconnectInMs }) => { // the answer is gone; the microphone goes on
        if (this.player.playing) this.player.stop();
        if (!this.active || reconnectInMs !== null) return; // a drain: the client comes back by itself
        this.client.connect().catch((error) => { if (error.code !== "client_closed") this.emit("error", error); });
      }),
    ];
    this.active = true;
    try {
      await this.microphone.start((pcm) => {
        if (!this.client.connected) return; // dropped: the next connect takes over
        try { this.client.appendAudio(pcm); } catch (error) { this.emit("error", error); }
      });
    } catch (error) {
      this.stop();
      throw error;
    }
  }

  /** The user talks over the answer (or the app says so): stop it, keep what was heard. */
  async interrupt() {
    const itemId = this.player.itemId;
    const turn = this.client.activeTurn;
    const coming = turn !== null && turn.itemId === itemId;
    if (itemId === null || (!this.player.playing && !coming)) return null; // nothing playing
    const { playedMs } = this.player.stop();
    if (coming) await this.client.cancel(); // already cancelled by the server after speech_started
    this.bargeIns += 1;
    const cut = await this.client.truncateAudio(itemId, playedMs);
    this.emit("interrupted", cut);
    return cut;
  }

  _speechStarted() {
    if (!this.bargeIn) return;
    this.interrupt().catch((error) => this.emit("error", error));
  }

  stop() {
    this.active = false;
    for (const off of this._off) off();
    this._off = [];
    this.microphone.stop();
    if (this.player.playing) this.player.stop();
  }
}
