// model-store: the on-device model file in the browser's Cache Storage (rtgw-device.js's store),
// fetched once from the gateway (`/v1/models/{id}/file`, behind the API key), resumed with Range
// when a transfer breaks, checked against the SHA-256 the gateway publishes, and kept in the form
// the engine asks for (`storedForm`). DeviceModelError is the fallback's error, here so that the
// store and the engine can raise it without importing the fallback.

import { GgufError } from "./gguf.js";
import { GatewayError } from "./rtgw.js";

/** The device cannot answer: the model is missing, damaged, too large for the storage, or failed. */
export class DeviceModelError extends GatewayError {}

const CACHE_NAME = "rtgw-device-models-v1";
const RECORD_PATH = "/.rtgw-device/model.json"; // the stored model's description, a key in the cache

async function sha256Hex(bytes) {
  const digest = await globalThis.crypto.subtle.digest("SHA-256", bytes);
  return Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join("");
}

function isQuotaError(error) {
  return error?.name === "QuotaExceededError" || error?.code === 22 || /quota/i.test(error?.message ?? "");
}

/** The model file in Cache Storage: one model at a time (a newer version replaces it). */
export class ModelStore {
  /** @param {object} options  caches (a CacheStorage; default globalThis.caches), fetch, base (the
   *   gateway's http(s) origin and path prefix), maxAttempts (download tries, resuming with Range) */
  constructor({ caches = globalThis.caches, fetch = globalThis.fetch?.bind(globalThis), base = "",
    maxAttempts = 4 } = {}) {
    this._caches = caches;
    this._fetch = fetch;
    this.base = base.replace(/\/+$/, "");
    this.maxAttempts = maxAttempts;
  }

  _recordUrl() { return new URL(RECORD_PATH, this.base + "/").toString(); }
  _fileUrl(card) { return this.base + card.url; }

  async _cache() {
    if (!this._caches) throw new DeviceModelError("this runtime has no Cache Storage to keep the model in", "no_storage");
    return this._caches.open(CACHE_NAME);
  }

  /** The stored model's card ({model, url, bytes, sha256, family, ...}, and `storedBytes`: the
   * length of the file as kept, which an engine's `storedForm` may have rewritten), or null. */
  async stored() {
    if (!this._caches) return null;
    const cache = await this._cache();
    const response = await cache.match(this._recordUrl());
    if (!response) return null;
    try { return await response.json(); } catch { return null; }
  }

  /** The stored file as a Blob, or null (none, or not whole: then it is dropped). */
  async load(card) {
    const cache = await this._cache();
    const response = await cache.match(this._fileUrl(card));
    if (!response) return null;
    const blob = await response.blob();
    const record = await this.stored();
    if (blob.size !== (record?.sha256 === card.sha256 ? record.storedBytes ?? card.bytes : card.bytes)) {
      await this.clear();
      return null;
    }
    return blob;
  }

  /** Downloads `card`'s file (headers: the API key), resuming a broken transfer with Range and
   * If-Range; checks its length and SHA-256; stores it, as `storedForm(ArrayBuffer)` rewrites it
   * when given (the engine's form of the same model). `onProgress({loaded, total})`. Resolves with the
   * stored Blob; a file that fails its checks is discarded (DeviceModelError). */
  async download(card, { headers = {}, onProgress = () => {}, signal, storedForm = null } = {}) {
    if (!this._fetch) throw new DeviceModelError("this runtime has no fetch to download the model with", "no_fetch");
    const url = this._fileUrl(card);
    const total = card.bytes;
    let chunks = [];
    let loaded = 0;
    let etag = null;
    let failures = 0;
    let lastError = null;
    onProgress({ loaded, total });
    while (loaded < total) {
      if (failures >= this.maxAttempts) {
        throw new DeviceModelError(`the model download broke off at ${loaded} of ${total} bytes ` +
          `(${failures} tries${lastError ? `: ${lastError.message}` : ""}); it was discarded`, "download_truncated");
      }
      const ask = { ...headers };
      if (loaded > 0) {
        ask.Range = `bytes=${loaded}-`;
        if (etag) ask["If-Range"] = etag;
      }
      let response;
      try {
        response = await this._fetch(url, { headers: ask, signal, cache: "no-store" });
      } catch (e) {
        if (signal?.aborted) throw e;
        failures += 1;
        lastError = e;
        continue;
      }
      if (!response.ok) {
        let message = `HTTP ${response.status}`;
        try { message = (await response.json()).error?.message ?? message; } catch { /* not our JSON */ }
        throw new DeviceModelError(`the gateway refused the model file: ${message}`, "download_refused");
      }
      if (loaded > 0 && response.status !== 206) { // the file changed (If-Range): start again
        chunks = [];
        loaded = 0;
      }
      etag = response.headers.get("ETag") ?? etag;
      const before = loaded;
      try {
        const reader = response.body.getReader();
        for (;;) {
          const { done, value } = await reader.read();
          if (done) break;
          loaded += value.length;
          if (loaded > total) {
            throw new DeviceModelError(`the model file is longer than the ${total} bytes announced; it was discarded`,
              "model_size_mismatch");
          }
          chunks.push(value);
          onProgress({ loaded, total });
        }
      } catch (e) {
        if (signal?.aborted || e instanceof DeviceModelError) throw e;
        lastError = e;
      }
      if (loaded < total) failures += loaded > before ? 0.5 : 1; // a try that moved on costs half
    }
    const whole = new Uint8Array(total);
    let at = 0;
    for (const chunk of chunks) {
      whole.set(chunk, at);
      at += chunk.length;
    }
    chunks = null;
    const digest = await sha256Hex(whole);
    if (digest !== card.sha256) {
      throw new DeviceModelError(`the model file's SHA-256 is ${digest}, not the ${card.sha256} the gateway ` +
        "published; it was discarded", "model_hash_mismatch");
    }
    let kept = whole.buffer;
    if (storedForm) {
      try {
        kept = storedForm(kept);
      } catch (e) {
        if (!(e instanceof GgufError)) throw e;
        throw new DeviceModelError(`the model file cannot be read: ${e.message}; it was discarded`, "model_unreadable");
      }
    }
    const blob = new Blob([kept], { type: "application/octet-stream" });
    await this._save(card, blob);
    return blob;
  }

  async _save(card, blob) {
    try {
      await this.clear(); // one model at a time: a new version replaces the old
      const cache = await this._cache();
      await cache.put(this._fileUrl(card), new Response(blob, { headers: {
        "Content-Type": "application/octet-stream", "Content-Length": String(blob.size) } }));
      await cache.put(this._recordUrl(), new Response(JSON.stringify({ ...card, storedBytes: blob.size,
        storedAt: Date.now() }),
        { headers: { "Content-Type": "application/json" } }));
    } catch (e) {
      await this.clear().catch(() => {});
      if (isQuotaError(e)) {
        throw new DeviceModelError(`the browser's storage quota is too small for the model (${blob.size} bytes); ` +
          "the on-device fallback is off, the gateway still answers", "storage_quota_exceeded");
      }
      throw e instanceof DeviceModelError ? e : new DeviceModelError(`the model could not be stored: ${e.message}`,
        "storage_failed");
    }
  }

  async clear() {
    if (this._caches) await this._caches.delete(CACHE_NAME);
  }
}
