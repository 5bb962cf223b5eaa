// One answer on the demo page (app.js): its bubble, streamed or revealed at a speaking rate, the
// calls it made, and how it ended; answers render as markdown (marked, then DOMPurify: the model's
// raw HTML is shown as text, never injected; images are not fetched).

import { codePointLength, codePointSlice } from "../sdk/rtgw.js";
import { Marked } from "../vendor/marked.js";
import DOMPurify from "../vendor/purify.js";

export const SPEAK_RATE = 15; // characters per second, about a speaking voice

// --- markdown ---

const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;",
  '"': "&quot;", "'": "&#39;" })[c]);
const markdown = new Marked({ gfm: true, breaks: true, renderer: {
  html: ({ text }) => escapeHtml(text), // the model's HTML is text on the page
  image: ({ text, href }) => escapeHtml(`[${text}](${href})`), // nothing is fetched from elsewhere
} });
export const renderMarkdown = (text) => DOMPurify.sanitize(markdown.parse(text), { FORBID_TAGS: ["img", "style", "form"] });


// --- one answer on screen ---

export class TurnView {
  constructor(box, speaking) {
    this.box = box;
    this.textEl = box.querySelector(".text");
    this.metaEl = box.querySelector(".meta");
    this.speaking = speaking;
    this.turn = null;
    this.result = null;
    this.shown = 0; // characters (code points) on screen: what the user has "heard"
    this.firstAt = null;
    this.timer = null;
    this.revealed = new Promise((resolve) => { this._revealed = resolve; });
    box.dataset.status = "waiting";
  }

  attach(turn) {
    this.turn = turn;
    this.box.dataset.status = "streaming";
    turn.on("delta", () => this.render());
    turn.on("functionCall", (call) => this.showCall(call));
    if (this.speaking) this.timer = setInterval(() => this.render(), 1000 / SPEAK_RATE);
    else this._revealed();
  }

  render() {
    const text = this.turn.text;
    const length = codePointLength(text);
    if (!this.speaking) {
      this.shown = length;
      this.textEl.classList.add("md");
      this.textEl.innerHTML = renderMarkdown(text);
    } else if (this.timer !== null) {
      if (this.firstAt === null && length) this.firstAt = performance.now();
      const due = this.firstAt === null ? 0 : Math.floor(((performance.now() - this.firstAt) / 1000) * SPEAK_RATE);
      this.shown = Math.min(length, Math.max(this.shown, due));
      this.textEl.textContent = codePointSlice(text, this.shown);
      if (this.result && this.shown >= length) this.stopReveal();
    }
    this.box.scrollIntoView({ block: "end" });
  }

  /** A call, in the answer: the function and its arguments, pretty-printed. */
  showCall(call) {
    this.box.dataset.calls = "true";
    const box = document.createElement("div");
    box.className = "call";
    box.dataset.callId = call.callId;
    box.dataset.status = call.status;
    const head = document.createElement("div");
    head.className = "call-head";
    const name = Object.assign(document.createElement("code"), { className: "fn", textContent: call.name });
    head.append("called ", name, call.complete ? "" : " (cut short)");
    const args = Object.assign(document.createElement("pre"), { className: "args",
      textContent: call.parsed ? JSON.stringify(call.parsed, null, 2) : call.arguments });
    box.append(head, args);
    this.metaEl.before(box);
    this.box.scrollIntoView({ block: "end" });
  }

  showOutput(callId, output) {
    const box = [...this.box.querySelectorAll(".call")].find((c) => c.dataset.callId === callId);
    if (!box) return;
    const line = Object.assign(document.createElement("div"), { className: "call-output" });
    line.append("answered by this page: ", Object.assign(document.createElement("code"),
      { textContent: JSON.stringify(output) }));
    box.append(line);
  }

  stopReveal() {
    clearInterval(this.timer);
    this.timer = null;
    this._revealed();
  }

  finish(result) {
    this.result = result;
    this.render();
    this.box.dataset.status = result.status;
    if (result.tier) this.box.dataset.tier = result.tier;
    this.metaEl.replaceChildren(...describe(result).map(([cls, text]) => {
      const span = document.createElement("span");
      span.className = cls;
      span.textContent = text;
      return span;
    }));
  }

  interrupted(cut) {
    this.box.dataset.interrupted = "true";
    const kept = cut ? codePointLength(cut.text) : this.shown;
    this.textEl.textContent = cut ? cut.text : codePointSlice(this.turn?.text ?? "", kept);
    const note = document.createElement("span");
    note.className = "state state-cancelled interrupted";
    note.textContent = `interrupted: the conversation keeps ${kept} characters`;
    this.metaEl.append(note);
  }

  fail(message) {
    this.stopReveal();
    this.box.dataset.status = "failed";
    this.metaEl.replaceChildren(Object.assign(document.createElement("span"),
      { className: "state state-failed", textContent: message }));
  }
}

export function describe(result) {
  const meta = result.metadata ?? {};
  const out = [["state state-" + result.status,
    result.status === "incomplete" && result.reason === "max_output_tokens" ? "max tokens" : result.status]];
  if (result.tier) {
    let tier = `tier ${result.tier}`;
    if (meta.x_route) tier += ` · ${meta.x_route}`;
    if (meta.x_confidence) tier += ` · confidence ${Number(meta.x_confidence).toFixed(2)}`;
    out.push(["tier", tier]);
  }
  if (result.ttftMs !== null) out.push(["ttft", `TTFT ${Math.round(result.ttftMs)} ms`]);
  const tokens = result.usage?.output_tokens ?? 0;
  const streaming = (result.elapsedMs - (result.ttftMs ?? 0)) / 1000;
  if (tokens > 1 && streaming > 0) out.push(["rate", `${((tokens - 1) / streaming).toFixed(1)} tok/s`]);
  if (result.usage?.input_tokens) out.push(["cached", `cached ${result.cachedTokens}/${result.usage.input_tokens} tok`]);
  if (result.error) out.push(["state state-failed", result.error.message ?? result.error.code]);
  return out;
}
