// gguf: the layout of a GGUF model file (its tensors: name, shape, block type, where the data is),
// and one lossless rewrite of it for runtimes that lack a fast kernel for a block type.
//
// Why the rewrite: llama.cpp's WebAssembly build (wllama) has SIMD dot products for Q4_0, Q5_0,
// Q5_1 and Q8_0 blocks but none for Q4_1, which runs as scalar code there. A Q4_1 block (scale d,
// minimum m, 32 four-bit values) is a Q5_1 block whose fifth bits are all zero: the same weights,
// d * q + m, 24 bytes where it was 20. `widenQ4_1` writes that file; the device decodes the same
// weights 1.3x faster in Chromium (docs/benchmarks.md). Native llama.cpp keeps the file as it is.
//
// No DOM: Node, browsers and React Native alike. Every length and offset read from the file is
// checked against the file's size; a file that is not a GGUF this reads is a GgufError.

export class GgufError extends Error {
  /** `truncated`: the bytes read end before the header does (a longer read may succeed). */
  constructor(message, { truncated = false } = {}) {
    super(message);
    this.name = "GgufError";
    this.truncated = truncated;
  }
}

/** ggml block types this module sizes: elements per block, bytes per block. */
export const BLOCK = Object.freeze({
  0: { name: "F32", elements: 1, bytes: 4 },
  1: { name: "F16", elements: 1, bytes: 2 },
  2: { name: "Q4_0", elements: 32, bytes: 18 },
  3: { name: "Q4_1", elements: 32, bytes: 20 },
  6: { name: "Q5_0", elements: 32, bytes: 22 },
  7: { name: "Q5_1", elements: 32, bytes: 24 },
  8: { name: "Q8_0", elements: 32, bytes: 34 },
  10: { name: "Q2_K", elements: 256, bytes: 84 },
  11: { name: "Q3_K", elements: 256, bytes: 110 },
  12: { name: "Q4_K", elements: 256, bytes: 144 },
  13: { name: "Q5_K", elements: 256, bytes: 176 },
  14: { name: "Q6_K", elements: 256, bytes: 210 },
  30: { name: "BF16", elements: 1, bytes: 2 },
});

const Q4_1 = 3;
const Q5_1 = 7;
const MAGIC = 0x46554747; // "GGUF" little-endian
const STRING = 8;
const ARRAY = 9;
// bytes of each fixed-size metadata value type (u8 i8 u16 i16 u32 i32 f32 bool; u64 i64 f64)
const SCALAR_BYTES = { 0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8 };

/** A reader over the file's bytes that never reads past them. */
class Cursor {
  constructor(buffer) {
    this.view = new DataView(buffer);
    this.at = 0;
  }

  need(bytes, what) {
    if (!Number.isSafeInteger(bytes) || bytes < 0 || this.at + bytes > this.view.byteLength) {
      throw new GgufError(`the GGUF file ends inside ${what} (at byte ${this.at} of ${this.view.byteLength})`,
        { truncated: Number.isSafeInteger(bytes) && bytes >= 0 });
    }
  }

  u32(what) { this.need(4, what); const v = this.view.getUint32(this.at, true); this.at += 4; return v; }

  u64(what) {
    this.need(8, what);
    const v = this.view.getBigUint64(this.at, true);
    this.at += 8;
    if (v > BigInt(Number.MAX_SAFE_INTEGER)) throw new GgufError(`${what} is too large (${v})`);
    return Number(v);
  }

  string(what) {
    const length = this.u64(`${what}'s length`);
    this.need(length, what);
    const bytes = new Uint8Array(this.view.buffer, this.at, length);
    this.at += length;
    return new TextDecoder().decode(bytes);
  }

  skip(bytes, what) { this.need(bytes, what); this.at += bytes; }
}

/** Reads one metadata value, keeping numbers and strings (arrays are skipped: the tokenizer's). */
function readValue(cursor, type, key) {
  if (type === STRING) return cursor.string(`the value of ${key}`);
  if (type === ARRAY) {
    const itemType = cursor.u32(`the item type of ${key}`);
    const count = cursor.u64(`the length of ${key}`);
    if (itemType === STRING) {
      for (let i = 0; i < count; i += 1) cursor.skip(cursor.u64(`a string's length in ${key}`), `a string in ${key}`);
    } else if (SCALAR_BYTES[itemType] !== undefined) {
      cursor.skip(SCALAR_BYTES[itemType] * count, `the items of ${key}`);
    } else {
      throw new GgufError(`the metadata ${key} is an array of unknown type ${itemType}`);
    }
    return undefined;
  }
  const bytes = SCALAR_BYTES[type];
  if (bytes === undefined) throw new GgufError(`the metadata ${key} has unknown type ${type}`);
  cursor.need(bytes, `the value of ${key}`);
  const view = cursor.view;
  const at = cursor.at;
  cursor.at += bytes;
  switch (type) {
    case 0: return view.getUint8(at);
    case 1: return view.getInt8(at);
    case 2: return view.getUint16(at, true);
    case 3: return view.getInt16(at, true);
    case 4: return view.getUint32(at, true);
    case 5: return view.getInt32(at, true);
    case 6: return view.getFloat32(at, true);
    case 7: return view.getUint8(at) !== 0;
    case 12: return view.getFloat64(at, true);
    default: return Number(type === 10 ? view.getBigUint64(at, true) : view.getBigInt64(at, true));
  }
}

/** The file's layout: {version, alignment, dataStart, tensors: [{name, dims, type, typeName,
 * offset, bytes, infoAt}]}, `offset` from `dataStart`, `infoAt` where the tensor's type field is.
 * `buffer` may be the file's start alone when `fileBytes` gives the whole file's length. */
export function readLayout(buffer, { fileBytes = buffer.byteLength } = {}) {
  const cursor = new Cursor(buffer);
  if (cursor.u32("the magic number") !== MAGIC) throw new GgufError("not a GGUF file (no GGUF magic number)");
  const version = cursor.u32("the version");
  if (version < 2 || version > 3) throw new GgufError(`GGUF version ${version} is not one this reads (2 or 3)`);
  const tensorCount = cursor.u64("the tensor count");
  const kvCount = cursor.u64("the metadata count");
  let alignment = 32;
  for (let i = 0; i < kvCount; i += 1) {
    const key = cursor.string("a metadata key");
    const value = readValue(cursor, cursor.u32(`the type of ${key}`), key);
    if (key === "general.alignment") alignment = value;
  }
  if (!Number.isInteger(alignment) || alignment <= 0 || alignment % 8 !== 0) {
    throw new GgufError(`general.alignment ${alignment} is not a positive multiple of 8`);
  }
  const tensors = [];
  for (let i = 0; i < tensorCount; i += 1) {
    const name = cursor.string("a tensor's name");
    const nDims = cursor.u32(`the rank of ${name}`);
    if (nDims < 1 || nDims > 4) throw new GgufError(`the tensor ${name} has rank ${nDims}`);
    const dims = [];
    for (let d = 0; d < nDims; d += 1) dims.push(cursor.u64(`a dimension of ${name}`));
    const infoAt = cursor.at;
    const type = cursor.u32(`the type of ${name}`);
    const offset = cursor.u64(`the offset of ${name}`);
    const block = BLOCK[type];
    const elements = dims.reduce((a, b) => a * b, 1);
    if (block && (!Number.isSafeInteger(elements) || dims[0] % block.elements !== 0)) {
      throw new GgufError(`the tensor ${name}'s rows (${dims[0]}) are not whole ${block.name} blocks`);
    }
    // bytes: null for a block type this does not size (the file is read, not rewritten)
    tensors.push({ name, dims, type, typeName: block?.name ?? `type ${type}`, offset,
      bytes: block ? (elements / block.elements) * block.bytes : null, infoAt });
  }
  const dataStart = Math.ceil(cursor.at / alignment) * alignment;
  for (const t of tensors) {
    if (t.offset % alignment !== 0 || dataStart + t.offset + (t.bytes ?? 0) > fileBytes) {
      throw new GgufError(`the tensor ${t.name}'s data (${t.bytes} bytes at ${t.offset}) lies outside the file ` +
        `or off its ${alignment}-byte alignment`);
    }
  }
  return { version, alignment, dataStart, tensors };
}

/** The file with every Q4_1 tensor written as Q5_1 (the same weights, see the top of this module);
 * the buffer itself when it has none. Tensors keep their order; the metadata is copied as is. */
export function widenQ4_1(buffer) {
  const layout = readLayout(buffer);
  if (!hasQ4_1(layout)) return buffer;
  const unsized = layout.tensors.find((t) => t.bytes === null);
  if (unsized) throw new GgufError(`the tensor ${unsized.name} has a block type (${unsized.type}) this does not size`);
  const { alignment, dataStart } = layout;
  const placed = [...layout.tensors].sort((a, b) => a.offset - b.offset);
  let end = 0;
  const moves = placed.map((t) => {
    const bytes = t.type === Q4_1 ? (t.bytes / 20) * 24 : t.bytes;
    const to = Math.ceil(end / alignment) * alignment;
    end = to + bytes;
    return { t, to, bytes };
  });
  const out = new ArrayBuffer(dataStart + end);
  const bytesIn = new Uint8Array(buffer);
  const bytesOut = new Uint8Array(out);
  bytesOut.set(bytesIn.subarray(0, dataStart));
  const header = new DataView(out);
  for (const { t, to } of moves) {
    header.setUint32(t.infoAt, t.type === Q4_1 ? Q5_1 : t.type, true);
    header.setBigUint64(t.infoAt + 4, BigInt(to), true);
    const from = dataStart + t.offset;
    if (t.type !== Q4_1) {
      bytesOut.set(bytesIn.subarray(from, from + t.bytes), dataStart + to);
      continue;
    }
    // 32-bit words: a Q4_1 block is 5 (d and m, then 16 bytes of nibbles), a Q5_1 block 6 (d and
    // m, the fifth bits: 0, the same nibbles). Both offsets are aligned to at least 8 bytes.
    const src = new Uint32Array(buffer, from, t.bytes / 4);
    const dst = new Uint32Array(out, dataStart + to, (t.bytes / 20) * 6);
    for (let i = 0, o = 0; i < src.length; i += 5, o += 6) {
      dst[o] = src[i];
      dst[o + 2] = src[i + 1];
      dst[o + 3] = src[i + 2];
      dst[o + 4] = src[i + 3];
      dst[o + 5] = src[i + 4];
    }
  }
  return out;
}

/** Whether a layout has Q4_1 tensors (which `widenQ4_1` rewrites). */
export function hasQ4_1(layout) {
  return layout.tensors.some((t) => t.type === Q4_1);
}
