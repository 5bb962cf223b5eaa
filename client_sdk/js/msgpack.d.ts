/** A small msgpack codec for the Realtime events (no ext types). */
export class MsgpackError extends Error {}
export function encode(value: unknown): Uint8Array;
export function decode(data: Uint8Array | ArrayBuffer | ArrayBufferView): unknown;
