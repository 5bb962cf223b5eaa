// gguf.js on files written byte by byte: the layout read back, Q4_1 widened to Q5_1 block by block
// with everything else copied, and files it must refuse. That the widened weights are the same
// numbers (dequantized by the gguf library) and give llama.cpp the same answer is
// tests/client_sdk/test_js_gguf.py, on the real model file.
import assert from "node:assert/strict";
import { test } from "node:test";

import { GgufError, hasQ4_1, readLayout, widenQ4_1 } from "../gguf.js";
import { buildGguf } from "./gguf_fixture.mjs";

const TENSORS = [
  { name: "token_embd.weight", dims: [64, 3], type: 8 },
  { name: "blk.0.attn_q.weight", dims: [64, 2], type: 3 },
  { name: "blk.0.attn_norm.weight", dims: [5], type: 0 },
  { name: "blk.0.ffn_up.weight", dims: [96, 1], type: 3 },
];

test("the layout: tensors, shapes, types, data offsets and the data's start after the metadata", () => {
  const { buffer, dataStart, placed } = buildGguf({ tensors: TENSORS });
  const layout = readLayout(buffer);
  assert.equal(layout.version, 3);
  assert.equal(layout.alignment, 32);
  assert.equal(layout.dataStart, dataStart);
  assert.deepEqual(layout.tensors.map((t) => [t.name, t.dims, t.typeName, t.offset, t.bytes]),
    placed.map((t) => [t.name, t.dims, { 8: "Q8_0", 3: "Q4_1", 0: "F32" }[t.type], t.at, t.bytes]));
  assert.ok(hasQ4_1(layout));
});

test("Q4_1 tensors become Q5_1 with zero fifth bits and the same scale, minimum and nibbles; others are copied", () => {
  const { buffer } = buildGguf({ tensors: TENSORS, alignment: 64 });
  const before = readLayout(buffer);
  const widened = widenQ4_1(buffer);
  const after = readLayout(widened);
  assert.equal(after.dataStart, before.dataStart);
  assert.ok(!hasQ4_1(after));
  const src = new Uint8Array(buffer);
  const out = new Uint8Array(widened);
  for (const [i, t] of after.tensors.entries()) {
    const old = before.tensors[i];
    assert.equal(t.name, old.name);
    assert.equal(t.offset % 64, 0, `${t.name} is aligned`);
    const from = src.subarray(before.dataStart + old.offset, before.dataStart + old.offset + old.bytes);
    const to = out.subarray(after.dataStart + t.offset, after.dataStart + t.offset + t.bytes);
    if (old.typeName !== "Q4_1") {
      assert.equal(t.typeName, old.typeName);
      assert.deepEqual(to, from);
      continue;
    }
    assert.equal(t.typeName, "Q5_1");
    assert.equal(t.bytes, (old.bytes / 20) * 24);
    for (let b = 0; b < old.bytes / 20; b += 1) {
      const q41 = from.subarray(b * 20, b * 20 + 20);
      const q51 = to.subarray(b * 24, b * 24 + 24);
      assert.deepEqual(q51.subarray(0, 4), q41.subarray(0, 4), "d and m");
      assert.deepEqual(q51.subarray(4, 8), new Uint8Array(4), "no fifth bits");
      assert.deepEqual(q51.subarray(8), q41.subarray(4), "the nibbles");
    }
  }
  // the header is the same bytes but for each tensor's type and offset fields
  const fields = before.tensors.map((t) => [t.infoAt, t.infoAt + 12]);
  const changed = [];
  for (let i = 0; i < before.dataStart; i += 1) if (out[i] !== src[i]) changed.push(i);
  assert.ok(changed.length > 0 && changed.every((i) => fields.some(([a, b]) => i >= a && i < b)), String(changed));
});

test("a file without Q4_1 is handed back as it is", () => {
  const { buffer } = buildGguf({ tensors: TENSORS.filter((t) => t.type !== 3) });
  assert.equal(widenQ4_1(buffer), buffer);
});

test("the header alone is read when the whole file's length is given", () => {
  const { buffer, dataStart } = buildGguf({ tensors: TENSORS });
  const layout = readLayout(buffer.slice(0, dataStart), { fileBytes: buffer.byteLength });
  assert.equal(layout.tensors.length, TENSORS.length);
  const cut = (() => { try { readLayout(buffer.slice(0, dataStart - 40)); } catch (e) { return e; } })();
  assert.ok(cut instanceof GgufError && cut.truncated, "a header cut short says so, so a longer read can follow");
});

test("files it refuses: no magic, an unknown version, a cut header, data outside the file, a tensor it cannot size", () => {
  const { buffer } = buildGguf({ tensors: TENSORS });
  const bytes = () => new Uint8Array(buffer.slice(0));
  const refuse = (buf, pattern, truncated = false) => {
    assert.throws(() => widenQ4_1(buf), (e) => e instanceof GgufError && pattern.test(e.message) && e.truncated === truncated);
  };
  const noMagic = bytes(); noMagic[0] = 0x47 + 1;
  refuse(noMagic.buffer, /not a GGUF file/);
  const v9 = bytes(); new DataView(v9.buffer).setUint32(4, 9, true);
  refuse(v9.buffer, /version 9/);
  refuse(buffer.slice(0, 100), /ends inside/, true);
  refuse(buffer.slice(0, buffer.byteLength - 1), /outside the file/);
  const hugeString = bytes(); new DataView(hugeString.buffer).setBigUint64(24, 2n ** 60n, true);
  refuse(hugeString.buffer, /too large|ends inside/, false);
  const layout = readLayout(buffer);
  const misaligned = bytes();
  new DataView(misaligned.buffer).setBigUint64(layout.tensors[1].infoAt + 4, BigInt(layout.tensors[1].offset + 4), true);
  refuse(misaligned.buffer, /blk.0.attn_q.weight's data .* off its 32-byte alignment/);
  const odd = buildGguf({ tensors: [...TENSORS, { name: "odd", dims: [8], type: 39, bytesPerElement: 1 }] });
  assert.equal(readLayout(odd.buffer).tensors.at(-1).bytes, null, "read: its size is unknown");
  refuse(odd.buffer, /odd has a block type \(39\)/);
  const badRows = buildGguf({ tensors: [{ name: "rows", dims: [48, 1], type: 3 }] });
  refuse(badRows.buffer, /not whole Q4_1 blocks/);
});
