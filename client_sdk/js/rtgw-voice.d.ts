// Types of rtgw-voice.js: voice in browsers (microphone, Web Audio playback, barge-in) on top of
// the client of rtgw.js.

import { AudioCut, Emitter, RealtimeClient, TurnDetection, Unsubscribe, VoiceSettings } from "./rtgw.js";

export function float32ToPcm16(samples: Float32Array): Int16Array;
export function pcm16ToFloat32(pcm: Int16Array): Float32Array;

/** A stream to a lower rate in chunks of any size (a windowed-sinc low-pass, then linear
 * interpolation); chunks give exactly what the whole stream would. */
export class Downsampler {
  constructor(fromRate: number, toRate?: number);
  readonly ratio: number;
  feed(samples: Float32Array): Float32Array;
}

/** Plays spoken answers with Web Audio (scheduled buffers) and counts, per item, the ms played. */
export class AudioPlayer extends Emitter {
  constructor(options?: { context?: AudioContext; AudioContext?: typeof AudioContext; leadMs?: number });
  context: AudioContext | null;
  /** The item whose audio came last, and how much of it came. */
  readonly itemId: string | null;
  readonly receivedMs: number;
  /** Chunks scheduled so far, all items. */
  readonly chunks: number;
  /** Audio is scheduled past the context's clock. */
  readonly playing: boolean;
  /** Creates or resumes the AudioContext; call it from a user gesture. */
  resume(): AudioContext;
  enqueue(itemId: string, pcm: Int16Array): void;
  playedMs(itemId?: string | null): number;
  /** Silences it now; what was played of the last item. */
  stop(): { itemId: string | null; playedMs: number };
  close(): void;
  on(type: "started", fn: (info: { itemId: string; at: number }) => void): Unsubscribe;
  on(type: "stopped", fn: (info: { itemId: string | null; playedMs: number }) => void): Unsubscribe;
}

/** The microphone as PCM16 at 24 kHz chunks (getUserMedia, an AudioWorklet or a ScriptProcessor). */
export class Microphone {
  constructor(options?: { chunkMs?: number; context?: AudioContext; AudioContext?: typeof AudioContext;
    mediaDevices?: MediaDevices; constraints?: MediaTrackConstraints });
  context: AudioContext | null;
  readonly chunkMs: number;
  /** Ms of audio handed to onChunk so far. */
  readonly capturedMs: number;
  /** "worklet" or "script-processor", once started. */
  readonly kind?: string;
  start(onChunk: (pcm: Int16Array) => void): Promise<void>;
  stop(): void;
}

/** A voice conversation: microphone in, server VAD, spoken answers played, barge-in. */
export class VoiceSession extends Emitter {
  constructor(client: RealtimeClient, options?: { voice?: VoiceSettings["voice"]; turnDetection?: TurnDetection | "server_vad" | "semantic_vad";
    player?: AudioPlayer; microphone?: Microphone; bargeIn?: boolean; instructions?: string });
  readonly client: RealtimeClient;
  readonly player: AudioPlayer;
  readonly microphone: Microphone;
  /** Barge-ins done (answers truncated to what was played). */
  readonly bargeIns: number;
  readonly active: boolean;
  bargeIn: boolean;
  /** Asks for the microphone, configures the session (audio out, server VAD) and starts streaming. */
  start(): Promise<void>;
  /** Stops the answer playing now and truncates it to what was played; null when nothing plays. */
  interrupt(): Promise<AudioCut | null>;
  stop(): void;
  on(type: "interrupted", fn: (cut: AudioCut) => void): Unsubscribe;
  on(type: "error", fn: (error: Error) => void): Unsubscribe;
}
