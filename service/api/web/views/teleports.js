// The job page's teleport table: one row per teleport epoch (its batches summarised as min · median · max),
// a click on the row shows that epoch's batch rows. A 20-epoch run with 8 batches each is 20 rows, not 160.

import { clip, html, num } from "../dom.js";

export const EPOCH_ROWS = 100; // the table shows the latest teleport epochs

// The middle value (the mean of the two middle ones for an even count) of the finite numbers in xs.
export function median(xs) {
  const s = xs.filter(Number.isFinite).sort((a, b) => a - b);
  if (!s.length) return null;
  const m = Math.floor(s.length / 2);
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

function spread(xs) {
  const s = xs.filter(Number.isFinite);
  return s.length ? { min: Math.min(...s), median: median(s), max: Math.max(...s) } : null;
}

const given = (x) => x !== null && x !== undefined;
const ratio = (t) => t.grad_norm_sq_after / t.grad_norm_sq_before; // ‖∇L‖² after / before
const drift = (a, b) => (given(a) && given(b) && a !== 0 ? (b - a) / Math.abs(a) : null); // relative change
const pct = (x) => (given(x) ? `${num(100 * x, 3)} %` : "–");
const times = (x) => (given(x) && Number.isFinite(x) ? `×${num(x, 6)}` : "–");
const sum = (xs) => xs.reduce((a, b) => a + (b || 0), 0);

// Teleport events -> [{epoch, batches (by batch index)}], the latest epoch first.
export function groupByEpoch(teleports) {
  const byEpoch = new Map();
  for (const t of teleports) {
    if (!byEpoch.has(t.epoch)) byEpoch.set(t.epoch, []);
    byEpoch.get(t.epoch).push(t);
  }
  return [...byEpoch.entries()].sort((a, b) => b[0] - a[0])
    .map(([epoch, batches]) => ({ epoch, batches: batches.sort((a, b) => (a.batch ?? 0) - (b.batch ?? 0)) }));
}

// One epoch's figures: the spread of the per-batch ratio and drift, the held-out drift across the whole epoch
// (its batches run back to back: the first batch's loss before to the last batch's after), counts and sums.
export function summarise({ epoch, batches }) {
  const first = batches[0];
  const last = batches.at(-1);
  const stops = {};
  for (const t of batches) stops[t.stop_reason || "?"] = (stops[t.stop_reason || "?"] || 0) + 1;
  const free = new Map(); // layer -> the fewest free directions it had in any batch
  for (const l of batches.flatMap((t) => t.layers || [])) {
    const seen = free.get(l.name);
    if (!seen || l.free < seen.free) free.set(l.name, l);
  }
  return {
    epoch, batches: batches.length, steps: sum(batches.map((t) => t.steps)),
    backoffs: sum(batches.map((t) => t.backoffs)), seconds: sum(batches.map((t) => t.seconds)),
    before: median(batches.map((t) => t.grad_norm_sq_before)), after: median(batches.map((t) => t.grad_norm_sq_after)),
    ratio: spread(batches.map(ratio)), drift: spread(batches.map((t) => drift(t.loss_before, t.loss_after))),
    heldout: drift(first.heldout_loss_before, last.heldout_loss_after), stops, layers: [...free.values()],
  };
}

// A min · median · max cell; the raw numbers ride along in data-* for tests and the console.
function spreadCell(s, fmt) {
  if (!s) return html`<td class="mono">–</td>`;
  return html`<td class="mono spread" data-min="${s.min}" data-median="${s.median}" data-max="${s.max}">${fmt(s.min)}
    · <b>${fmt(s.median)}</b> · ${fmt(s.max)}</td>`;
}

const layerText = (layers) => layers.map((l) => `${l.name} ${l.free}/${l.input_dim}`).join("  ");
const layerSpans = (layers) => (layers.length ? layers.map((l) => html`<span class="layer"
  title="${l.kind}: input dim ${l.input_dim}, rank ${l.rank}, captured variance ${num(l.captured_variance)}">${l.name}
  <b>${l.free}</b>/${l.input_dim}</span>`) : html`<span class="muted">–</span>`);

function epochRow(s, open) {
  const stops = Object.entries(s.stops).sort((a, b) => b[1] - a[1])
    .map(([k, n], i) => html`${i ? ", " : ""}<span class="stop">${k} ×${n}</span>`);
  return html`<tr class="epoch-row" data-epoch="${s.epoch}">
    <td><button type="button" class="expand" aria-expanded="${String(open)}" data-epoch="${s.epoch}"
      title="show this epoch's batches">${open ? "▾" : "▸"} ${s.epoch}</button></td>
    <td class="n-batches">${s.batches}</td><td class="nowrap">${s.steps}${s.backoffs ? ` (${s.backoffs} backoffs)` : ""}</td>
    <td class="mono">${num(s.before, 6)} → ${num(s.after, 6)}</td>
    ${spreadCell(s.ratio, times)}${spreadCell(s.drift, pct)}
    <td class="mono heldout" data-value="${s.heldout ?? ""}">${pct(s.heldout)}</td>
    <td class="stops">${stops}</td><td class="mono">${num(s.seconds, 3)}</td>
    <td class="layers">${clip(layerText(s.layers))}</td></tr>`;
}

function batchRow(t, open) {
  const held = drift(t.heldout_loss_before, t.heldout_loss_after);
  return html`<tr class="batch-row" data-epoch="${t.epoch}" ${open ? "" : html`hidden`}><td></td>
    <td class="batch nowrap">batch ${t.batch ?? ""}</td><td class="nowrap">${t.steps}${t.backoffs ? ` (${t.backoffs} backoffs)` : ""}</td>
    <td class="mono">${num(t.grad_norm_sq_before, 6)} → ${num(t.grad_norm_sq_after, 6)}</td>
    <td class="mono ratio">${times(ratio(t))}</td><td class="mono drift">${pct(drift(t.loss_before, t.loss_after))}</td>
    <td class="mono">${pct(held)}</td><td>${clip(t.stop_reason)}</td><td class="mono">${num(t.seconds, 3)}</td>
    <td class="layers">${layerSpans(t.layers || [])}</td></tr>`;
}

// The whole table; `expanded` holds the epochs whose batch rows are shown.
export function teleportTable(groups, expanded) {
  const head = (label, sub = "") => html`<th>${label}${sub ? html`<br><span class="sub">${sub}</span>` : ""}</th>`;
  return html`<table class="teleports"><thead><tr>${head("epoch")}${head("batches")}${head("steps")}
    ${head("‖∇L‖² before → after", "median over batches")}${head("ratio after/before", "min · median · max")}
    ${head("loss drift (batch)", "min · median · max")}${head("held-out drift", "over the epoch")}${head("stopped by")}
    ${head("seconds")}${head("free directions per layer", "fewest in any batch")}</tr></thead>
    ${groups.map((g) => {
      const open = expanded.has(g.epoch);
      return html`<tbody class="tele-epoch" data-epoch="${g.epoch}">${epochRow(summarise(g), open)}
        ${g.batches.map((t) => batchRow(t, open))}</tbody>`;
    })}</table>`;
}

// Clicking an epoch row shows or hides its batch rows (and remembers it across redraws).
export function toggleOnClick(container, expanded) {
  container.addEventListener("click", (ev) => {
    const row = ev.target.closest("tr.epoch-row");
    if (!row) return;
    const epoch = Number(row.dataset.epoch);
    const open = !expanded.has(epoch);
    if (open) expanded.add(epoch); else expanded.delete(epoch);
    const btn = row.querySelector("button.expand");
    btn.setAttribute("aria-expanded", String(open));
    btn.textContent = `${open ? "▾" : "▸"} ${epoch}`;
    for (const tr of row.parentElement.querySelectorAll("tr.batch-row")) tr.hidden = !open;
  });
}
