// A small msgpack codec for the Realtime events: nil, bool, ints, floats, str, bin, arrays and
// maps; no ext types (the gateway refuses them too). Optional: pass it to RealtimeClient as
// `msgpack` with `framing: "msgpack"`. Dependency-free, runs wherever TextEncoder does.
//
//   import * as msgpack from "./msgpack.js";
//   msgpack.decode(msgpack.encode({ type: "response.create" }))   // { type: "response.create" }
//
// Numbers that are safe integers are written as msgpack ints, others as float64; integers
// beyond 2^53 are read back as BigInt. Maps decode into plain objects (keys must be strings or
// numbers); an object's `undefined` values are skipped, as JSON.stringify does.

const MAX_DEPTH = 64;
const utf8Encoder = new TextEncoder();
const utf8Decoder = new TextDecoder("utf-8", { fatal: true });

export class MsgpackError extends Error {
  constructor(message) {
    super(message);
    this.name = "MsgpackError";
  }
}

// --- encoding ---------------------------------------------------------------------------------

class Writer {
  constructor() {
    this.bytes = new Uint8Array(256);
    this.view = new DataView(this.bytes.buffer);
    this.length = 0;
  }

  reserve(n) {
    if (this.length + n <= this.bytes.length) return;
    let size = this.bytes.length * 2;
    while (size < this.length + n) size *= 2;
    const bytes = new Uint8Array(size);
    bytes.set(this.bytes.subarray(0, this.length));
    this.bytes = bytes;
    this.view = new DataView(bytes.buffer);
  }

  u8(x) { this.reserve(1); this.view.setUint8(this.length, x); this.length += 1; }
  u16(x) { this.reserve(2); this.view.setUint16(this.length, x); this.length += 2; }
  u32(x) { this.reserve(4); this.view.setUint32(this.length, x); this.length += 4; }
  i8(x) { this.reserve(1); this.view.setInt8(this.length, x); this.length += 1; }
  i16(x) { this.reserve(2); this.view.setInt16(this.length, x); this.length += 2; }
  i32(x) { this.reserve(4); this.view.setInt32(this.length, x); this.length += 4; }
  u64(x) { this.reserve(8); this.view.setBigUint64(this.length, x); this.length += 8; }
  i64(x) { this.reserve(8); this.view.setBigInt64(this.length, x); this.length += 8; }
  f64(x) { this.reserve(8); this.view.setFloat64(this.length, x); this.length += 8; }
  raw(bytes) { this.reserve(bytes.length); this.bytes.set(bytes, this.length); this.length += bytes.length; }

  // A header whose size depends on the length: fix (when given), 8-, 16- or 32-bit.
  header(n, fix, fixLimit, c8, c16, c32) {
    if (fix !== null && n < fixLimit) this.u8(fix | n);
    else if (c8 !== null && n < 0x100) { this.u8(c8); this.u8(n); }
    else if (n < 0x10000) { this.u8(c16); this.u16(n); }
    else if (n <= 0xffffffff) { this.u8(c32); this.u32(n); }
    else throw new MsgpackError("too long for msgpack: " + n);
  }
}

function writeInt(w, v) {
  if (v >= 0) {
    if (v < 0x80) w.u8(v);
    else if (v < 0x100) { w.u8(0xcc); w.u8(v); }
    else if (v < 0x10000) { w.u8(0xcd); w.u16(v); }
    else if (v <= 0xffffffff) { w.u8(0xce); w.u32(v); }
    else { w.u8(0xcf); w.u64(BigInt(v)); }
  } else if (v >= -32) w.u8(v & 0xff);
  else if (v >= -0x80) { w.u8(0xd0); w.i8(v); }
  else if (v >= -0x8000) { w.u8(0xd1); w.i16(v); }
  else if (v >= -0x80000000) { w.u8(0xd2); w.i32(v); }
  else { w.u8(0xd3); w.i64(BigInt(v)); }
}

function writeBigInt(w, v) {
  if (v >= 0n && v <= 0xffffffffffffffffn) { w.u8(0xcf); w.u64(v); }
  else if (v < 0n && v >= -0x8000000000000000n) { w.u8(0xd3); w.i64(v); }
  else throw new MsgpackError("integer out of the 64-bit range");
}

function writeValue(w, value, depth) {
  if (depth > MAX_DEPTH) throw new MsgpackError(`nested deeper than ${MAX_DEPTH} levels`);
  if (value === null || value === undefined) return w.u8(0xc0);
  switch (typeof value) {
    case "boolean":
      return w.u8(value ? 0xc3 : 0xc2);
    case "number":
      if (Number.isSafeInteger(value)) return writeInt(w, value);
      w.u8(0xcb);
      return w.f64(value);
    case "bigint":
      return writeBigInt(w, value);
    case "string": {
      const bytes = utf8Encoder.encode(value);
      w.header(bytes.length, 0xa0, 32, 0xd9, 0xda, 0xdb);
      return w.raw(bytes);
    }
    case "object":
      break;
    default:
      throw new MsgpackError(`cannot encode a ${typeof value}`);
  }
  if (value instanceof ArrayBuffer || ArrayBuffer.isView(value)) {
    const bytes = value instanceof ArrayBuffer
      ? new Uint8Array(value) : new Uint8Array(value.buffer, value.byteOffset, value.byteLength);
    w.header(bytes.length, null, 0, 0xc4, 0xc5, 0xc6);
    return w.raw(bytes);
  }
  if (Array.isArray(value)) {
    w.header(value.length, 0x90, 16, null, 0xdc, 0xdd);
    for (const entry of value) writeValue(w, entry, depth + 1);
    return;
  }
  const entries = Object.entries(value).filter(([, v]) => v !== undefined);
  w.header(entries.length, 0x80, 16, null, 0xde, 0xdf);
  for (const [k, v] of entries) {
    writeValue(w, k, depth + 1);
    writeValue(w, v, depth + 1);
  }
}

/** One value as msgpack bytes. */
export function encode(value) {
  const w = new Writer();
  writeValue(w, value, 0);
  return w.bytes.slice(0, w.length);
}

// --- decoding ---------------------------------------------------------------------------------

class Reader {
  constructor(bytes) {
    this.bytes = bytes;
    this.view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    this.pos = 0;
  }

  take(n) {
    if (this.pos + n > this.bytes.length) throw new MsgpackError("truncated msgpack data");
    const at = this.pos;
    this.pos += n;
    return at;
  }

  u8() { return this.view.getUint8(this.take(1)); }
  u16() { return this.view.getUint16(this.take(2)); }
  u32() { return this.view.getUint32(this.take(4)); }
  i8() { return this.view.getInt8(this.take(1)); }
  i16() { return this.view.getInt16(this.take(2)); }
  i32() { return this.view.getInt32(this.take(4)); }
  u64() { return exact(this.view.getBigUint64(this.take(8))); }
  i64() { return exact(this.view.getBigInt64(this.take(8))); }
  f32() { return this.view.getFloat32(this.take(4)); }
  f64() { return this.view.getFloat64(this.take(8)); }
  slice(n) { const at = this.take(n); return this.bytes.subarray(at, at + n); }

  // Every entry takes at least one byte: a count past the end is refused before allocating.
  count(n, perEntry) {
    if (n * perEntry > this.bytes.length - this.pos) throw new MsgpackError("truncated msgpack data");
    return n;
  }
}

function exact(big) {
  const n = Number(big);
  return Number.isSafeInteger(n) ? n : big;
}

function readString(r, n) {
  try {
    return utf8Decoder.decode(r.slice(n));
  } catch (e) {
    if (e instanceof MsgpackError) throw e;
    throw new MsgpackError("a msgpack str is not valid UTF-8");
  }
}

function readArray(r, n, depth) {
  const out = new Array(r.count(n, 1));
  for (let i = 0; i < n; i++) out[i] = readValue(r, depth + 1);
  return out;
}

function readMap(r, n, depth) {
  const out = {};
  r.count(n, 2);
  for (let i = 0; i < n; i++) {
    let key = readValue(r, depth + 1);
    if (typeof key === "number") key = String(key);
    if (typeof key !== "string") throw new MsgpackError("msgpack map keys must be strings");
    const value = readValue(r, depth + 1);
    // an own property even for "__proto__", as JSON.parse makes it
    Object.defineProperty(out, key, { value, enumerable: true, writable: true, configurable: true });
  }
  return out;
}

function readValue(r, depth) {
  if (depth > MAX_DEPTH) throw new MsgpackError(`msgpack nested deeper than ${MAX_DEPTH} levels`);
  const b = r.u8();
  if (b < 0x80) return b;
  if (b >= 0xe0) return b - 0x100;
  if (b < 0x90) return readMap(r, b & 0x0f, depth);
  if (b < 0xa0) return readArray(r, b & 0x0f, depth);
  if (b < 0xc0) return readString(r, b & 0x1f);
  switch (b) {
    case 0xc0: return null;
    case 0xc2: return false;
    case 0xc3: return true;
    case 0xc4: return r.slice(r.u8()).slice();
    case 0xc5: return r.slice(r.u16()).slice();
    case 0xc6: return r.slice(r.u32()).slice();
    case 0xca: return r.f32();
    case 0xcb: return r.f64();
    case 0xcc: return r.u8();
    case 0xcd: return r.u16();
    case 0xce: return r.u32();
    case 0xcf: return r.u64();
    case 0xd0: return r.i8();
    case 0xd1: return r.i16();
    case 0xd2: return r.i32();
    case 0xd3: return r.i64();
    case 0xd9: return readString(r, r.u8());
    case 0xda: return readString(r, r.u16());
    case 0xdb: return readString(r, r.u32());
    case 0xdc: return readArray(r, r.u16(), depth);
    case 0xdd: return readArray(r, r.u32(), depth);
    case 0xde: return readMap(r, r.u16(), depth);
    case 0xdf: return readMap(r, r.u32(), depth);
    case 0xc1: throw new MsgpackError("0xc1 is not a msgpack type");
    default: throw new MsgpackError("msgpack ext types are not supported");
  }
}

/** Exactly one value from msgpack bytes (a Uint8Array, another typed array or an ArrayBuffer). */
export function decode(data) {
  const bytes = data instanceof Uint8Array ? data
    : data instanceof ArrayBuffer ? new Uint8Array(data)
      : ArrayBuffer.isView(data) ? new Uint8Array(data.buffer, data.byteOffset, data.byteLength)
        : null;
  if (bytes === null) throw new MsgpackError("msgpack data must be bytes");
  const r = new Reader(bytes);
  const value = readValue(r, 0);
  if (r.pos !== bytes.length) throw new MsgpackError("trailing bytes after the msgpack value");
  return value;
}
