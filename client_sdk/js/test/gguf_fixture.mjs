// A small GGUF file written byte by byte, for the tests of gguf.js and of the engine that uses it:
// metadata of each kind the reader walks (numbers, a string, an array of strings as a tokenizer has),
// then tensors of the given types with deterministic data.

const TYPE_BYTES = { 0: [1, 4], 3: [32, 20], 7: [32, 24], 8: [32, 34] }; // elements, bytes a block

function stringBytes(text) {
  const body = new TextEncoder().encode(text);
  const out = new Uint8Array(8 + body.length);
  new DataView(out.buffer).setBigUint64(0, BigInt(body.length), true);
  out.set(body, 8);
  return out;
}

function u32(v) { const b = new Uint8Array(4); new DataView(b.buffer).setUint32(0, v, true); return b; }
function u64(v) { const b = new Uint8Array(8); new DataView(b.buffer).setBigUint64(0, BigInt(v), true); return b; }

/** The file as an ArrayBuffer. `tensors`: [{name, dims, type}] (types 0 F32, 3 Q4_1, 7 Q5_1,
 * 8 Q8_0, or another number with `bytes` given); `alignment` written as general.alignment. */
export function buildGguf({ tensors, alignment = 32, tokens = ["a", "bc", "<|im_end|>"] }) {
  const parts = [u32(0x46554747), u32(3), u64(tensors.length), u64(4)];
  parts.push(stringBytes("general.architecture"), u32(8), stringBytes("llama"));
  parts.push(stringBytes("general.alignment"), u32(4), u32(alignment));
  parts.push(stringBytes("llama.context_length"), u32(10), u64(2048));
  parts.push(stringBytes("tokenizer.ggml.tokens"), u32(9), u32(8), u64(tokens.length), ...tokens.map(stringBytes));
  let offset = 0;
  const placed = tensors.map((t) => {
    const [per, size] = TYPE_BYTES[t.type] ?? [1, t.bytesPerElement ?? 1];
    const bytes = (t.dims.reduce((a, b) => a * b, 1) / per) * size;
    offset = Math.ceil(offset / alignment) * alignment;
    const at = offset;
    offset += bytes;
    return { ...t, at, bytes };
  });
  for (const t of placed) {
    parts.push(stringBytes(t.name), u32(t.dims.length), ...t.dims.map(u64), u32(t.type), u64(t.at));
  }
  const header = parts.reduce((n, p) => n + p.length, 0);
  const dataStart = Math.ceil(header / alignment) * alignment;
  const out = new Uint8Array(dataStart + offset);
  let at = 0;
  for (const p of parts) { out.set(p, at); at += p.length; }
  for (const t of placed) {
    for (let i = 0; i < t.bytes; i += 1) out[dataStart + t.at + i] = (i * 31 + t.name.length * 7 + 3) % 256;
  }
  return { buffer: out.buffer, dataStart, placed };
}
