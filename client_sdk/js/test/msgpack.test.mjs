// The msgpack codec against byte vectors written by Python's msgpack (what the gateway uses),
// round trips and the refusals. No gateway needed: node --test client_sdk/js/test/msgpack.test.mjs
import assert from "node:assert/strict";
import { test } from "node:test";

import { decode, encode, MsgpackError } from "../msgpack.js";

const hex = (bytes) => Buffer.from(bytes).toString("hex");
const bytes = (h) => new Uint8Array(Buffer.from(h, "hex"));

// msgpack.packb(value, use_bin_type=True).hex()
const VECTORS = [
  ["an event", { type: "response.output_text.delta", delta: "héllo ✓", response_id: "resp_1", n: 3 },
    "84a474797065ba726573706f6e73652e6f75747075745f746578742e64656c7461a564656c7461aa68c3a96c6c6f20e29c93"
    + "ab726573706f6e73655f6964a6726573705f31a16e03"],
  ["ints at every boundary",
    [0, 127, 128, 255, 256, 65535, 65536, 2 ** 32 - 1, 2 ** 32, 2 ** 53 - 1, -1, -32, -33, -128, -129, -32768,
      -32769, -(2 ** 31), -(2 ** 31) - 1, -(2 ** 53 - 1)],
    "dc0014007fcc80ccffcd0100cdffffce00010000ceffffffffcf0000000100000000cf001fffffffffffffffe0d0dfd080d1ff7f"
    + "d18000d2ffff7fffd280000000d3ffffffff7fffffffd3ffe0000000000001"],
  ["nil, bools, floats, str8/16, empty array",
    [null, true, false, 1.5, -0.25, "x".repeat(31), "y".repeat(32), "z".repeat(300), []],
    "99c0c3c2cb3ff8000000000000cbbfd0000000000000bf" + "78".repeat(31) + "d920" + "79".repeat(32) + "da012c"
    + "7a".repeat(300) + "90"],
  ["nested maps", { a: { b: [1, { c: null }] }, usage: { input_token_details: { cached_tokens: 64 } } },
    "82a16181a162920181a163c0a5757361676581b3696e7075745f746f6b656e5f64657461696c7381ad6361636865645f746f6b"
    + "656e7340"],
  ["bin", new Uint8Array([0, 1, 255]), "c4030001ff"],
];

for (const [name, value, expected] of VECTORS) {
  test(`encodes ${name} as Python's msgpack does`, () => {
    assert.equal(hex(encode(value)), expected);
  });
  test(`decodes ${name}`, () => {
    assert.deepEqual(decode(bytes(expected)), value);
  });
}

test("decodes float32, 64-bit extremes as BigInt, and takes an ArrayBuffer", () => {
  assert.equal(decode(bytes("ca3fc00000")), 1.5);
  assert.equal(decode(bytes("cfffffffffffffffff")), 2n ** 64n - 1n);
  assert.equal(decode(bytes("d38000000000000000")), -(2n ** 63n));
  assert.equal(hex(encode(2n ** 64n - 1n)), "cfffffffffffffffff");
  assert.equal(decode(bytes("a3616263").buffer), "abc");
});

test("round-trips long strings, arrays and maps past their 16-bit headers", () => {
  const big = {
    text: "∑".repeat(70000),
    list: Array.from({ length: 70000 }, (_, i) => i % 3),
    map: Object.fromEntries(Array.from({ length: 70000 }, (_, i) => [`k${i}`, i])),
  };
  const encoded = encode(big);
  assert.equal(encoded[0], 0x83);
  assert.deepEqual(decode(encoded), big);
  assert.deepEqual(decode(encode({ arr: Array(20).fill("a") })), { arr: Array(20).fill("a") });
});

test("skips undefined values and keeps __proto__ as a plain key", () => {
  assert.deepEqual(decode(encode({ a: 1, b: undefined })), { a: 1 });
  const decoded = decode(bytes("81a95f5f70726f746f5f5f01")); // {"__proto__": 1}
  assert.equal(Object.getPrototypeOf(decoded), Object.prototype);
  assert.deepEqual(Object.keys(decoded), ["__proto__"]);
});

test("non-integer and unsafe numbers are written as float64", () => {
  assert.equal(hex(encode(0.1)), "cb3fb999999999999a");
  assert.equal(decode(encode(2 ** 60)), 2 ** 60);
  assert.ok(Number.isNaN(decode(encode(NaN))));
});

const REFUSED = [
  ["truncated data", "a5616263"],
  ["a truncated header", "cd01"],
  ["an array count past the end", "ddffffffff"],
  ["a map count past the end", "dfffffffff01"],
  ["trailing bytes", "c0c0"],
  ["an ext type", "d40100"],
  ["the timestamp ext", "d6ff00000000"],
  ["the never-used byte", "c1"],
  ["invalid UTF-8", "a2c328"],
  ["a non-string map key", "81c0c0"],
  ["nesting past 64 levels", "91".repeat(70) + "c0"],
  ["empty input", ""],
];

for (const [name, data] of REFUSED) {
  test(`refuses ${name}`, () => {
    assert.throws(() => decode(bytes(data)), MsgpackError);
  });
}

test("refuses to encode functions, symbols, cycles and integers past 64 bits", () => {
  assert.throws(() => encode({ f() {} }), MsgpackError);
  assert.throws(() => encode(Symbol("s")), MsgpackError);
  const cycle = {};
  cycle.self = cycle;
  assert.throws(() => encode(cycle), MsgpackError);
  assert.throws(() => encode(2n ** 64n), MsgpackError);
  assert.throws(() => decode("not bytes"), MsgpackError);
});
