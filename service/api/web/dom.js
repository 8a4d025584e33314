// Tiny HTML templating (interpolations are escaped unless wrapped in raw()) and the formatting every view shares.

class Raw {
  constructor(s) { this.s = s; }
}
export const raw = (s) => new Raw(s);
const esc = (s) => s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const piece = (v) => (v instanceof Raw ? v.s : Array.isArray(v) ? v.map(piece).join("")
  : v === null || v === undefined || v === false ? "" : esc(String(v)));
export const html = (strings, ...vals) => raw(strings.reduce((out, s, i) => out + s + (i < vals.length ? piece(vals[i]) : ""), ""));
export const put = (el, content) => { el.innerHTML = piece(content); };
export const $ = (sel, root = document) => root.querySelector(sel);

export const POLL_MS = 2000;
export const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

export function num(x, digits = 4) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  const a = Math.abs(x);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? x.toExponential(digits - 1) : String(Number(x.toPrecision(digits)));
}

export function ago(t) {
  if (!t) return "–";
  const s = Date.now() / 1000 - t;
  if (s < 60) return `${Math.max(0, Math.round(s))} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return new Date(t * 1000).toLocaleString();
}

export function duration(a, b) {
  if (!a) return "–";
  const s = (b || Date.now() / 1000) - a;
  return s < 120 ? `${s.toFixed(1)} s` : s < 7200 ? `${(s / 60).toFixed(1)} min` : `${(s / 3600).toFixed(1)} h`;
}

export const badge = (state) => html`<span class="badge state-${state}">${state}</span>`;
export const jobLink = (j) => html`<a href="#/${j.kind === "sweep" ? "sweep" : "job"}/${encodeURIComponent(j.id)}">${j.name || j.id}</a>`;
export const demandText = (d) => d ? `${d.workers} × (${num(d.cpus_per_worker)} CPU${d.gpus_per_worker ? `, ${num(d.gpus_per_worker)} GPU` : ""}${
  d.memory_gb ? `, ${num(d.memory_gb)} GiB` : ""})` : "–";

// A long table cell (a failure reason, a config): one line cut with an ellipsis, the whole text in its tooltip.
export const clip = (text) => (text ? html`<span class="clip" title="${text}">${text}</span>` : "");

export function progressCell(p, state) {
  if (!p || p.epoch === null || p.epoch === undefined) return html`<span class="muted">–</span>`;
  const frac = p.epochs ? Math.min(1, p.epoch / p.epochs) : 0;
  return html`<div class="bar" title="${p.epoch} of ${p.epochs ?? "?"} epochs"><div class="fill ${state}" style="width:${(100 * frac).toFixed(1)}%"></div></div>
    <span class="small">${p.epoch}/${p.epochs ?? "?"}</span>`;
}

// A run summary's time to its target loss, epochs beside wall-clock seconds: "7 epochs · 12.3 s".
export function toTarget(s) {
  if (!s || s.target_loss === null || s.target_loss === undefined) return "–";
  if (s.epochs_to_target === null || s.epochs_to_target === undefined) return `< ${num(s.target_loss)}: not reached`;
  return `< ${num(s.target_loss)}: ${s.epochs_to_target} epochs · ${num(s.seconds_to_target, 3)} s`;
}
