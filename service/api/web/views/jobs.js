// #/jobs: the experiments table (polled) with boxes to tick for #/compare, and the queue in start order.

import { api } from "../api.js";
import { $, ago, badge, clip, demandText, html, jobLink, num, POLL_MS, progressCell, put, raw, TERMINAL } from "../dom.js";
import { showError } from "../page.js";

export const selected = new Set(); // experiments ticked for the compare view (kept across pages)

const STATES = ["queued", "starting", "running", "succeeded", "failed", "cancelled"];

// the last train / test loss: live from the progress of a running job, from the summary of an ended one
function lossCell(p, summary) {
  if (p.train_loss !== undefined && p.train_loss !== null) return `${num(p.train_loss)} / ${num(p.test_loss)}`;
  return summary ? `${num(summary.final_train_loss)} / ${num(summary.final_test_loss)}` : "";
}

function jobRow(j) {
  const outcome = j.state === "queued" ? j.pending_reason : j.failure_reason
    || (j.summary ? `final train ${num(j.summary.final_train_loss)}` : "");
  const p = j.progress || {};
  const done = TERMINAL.has(j.state) && j.summary;
  return html`<tr data-job="${j.id}" class="state-${j.state}">
    <td><input type="checkbox" data-id="${j.id}" ${selected.has(j.id) ? raw("checked") : ""} aria-label="select ${j.id}"></td>
    <td>${jobLink(j)}</td><td class="mono small">${j.id}</td><td>${j.owner}</td><td>${badge(j.state)}</td>
    <td>${j.queue_position ?? ""}</td><td class="reason">${clip(outcome)}</td>
    <td class="progress">${progressCell(done ? { epoch: j.summary.epochs, epochs: j.spec.training?.epochs } : p, j.state)}</td>
    <td class="mono small">${lossCell(p, done ? j.summary : null)}</td>
    <td class="small">${ago(j.created_at)}</td></tr>`;
}

const queueRow = (q) => html`<tr>
  <td>${q.position}</td><td>${q.id ? html`<a href="#/job/${q.id}">${q.name || q.id}</a>`
    : html`<span class="muted">another user's job</span>`}</td><td>${q.owner ?? ""}</td><td>${q.priority}</td>
  <td class="small">${demandText(q.demand)}</td><td class="reason">${clip(q.pending_reason)}</td>
  <td class="small">${ago(q.created_at)}</td></tr>`;

export async function jobsPage(page) {
  put(page.el, html`
    <section class="card">
      <div class="row"><h2>Experiments</h2>
        <label class="small">state <select id="state-filter"><option value="">any</option>
          ${STATES.map((s) => html`<option>${s}</option>`)}
        </select></label>
        <span class="grow"></span>
        <button id="compare-selected" type="button">Compare selected (<span id="n-selected">0</span>)</button>
        <a class="button" href="#/submit">New experiment</a></div>
      <table class="jobs"><thead><tr><th></th><th>name</th><th>id</th><th>owner</th><th>state</th><th>pos</th>
        <th>why pending / outcome</th><th>progress</th><th>train / test loss</th><th>created</th></tr></thead>
        <tbody id="jobs-body"><tr><td colspan="10" class="muted">loading…</td></tr></tbody></table>
    </section>
    <section class="card">
      <h2>Queue</h2>
      <p class="muted small">In the order the scheduler will start them (priority, then fair share on recent usage).</p>
      <table><thead><tr><th>pos</th><th>name</th><th>owner</th><th>priority</th><th>needs</th><th>why it waits</th>
        <th>queued</th></tr></thead><tbody id="queue-body"></tbody></table>
    </section>`);
  const filter = $("#state-filter");
  const nSel = () => { $("#n-selected").textContent = String(selected.size); };
  nSel();
  $("#compare-selected").addEventListener("click", () => {
    location.hash = `#/compare?ids=${[...selected].join(",")}`;
  });
  $("#jobs-body").addEventListener("change", (ev) => {
    const box = ev.target.closest("input[data-id]");
    if (!box) return;
    if (box.checked) selected.add(box.dataset.id); else selected.delete(box.dataset.id);
    nSel();
  });
  const refresh = async () => {
    const [list, queue] = await Promise.all([
      api("GET", "/v1/experiments", { params: { limit: 100, state: filter.value } }),
      api("GET", "/v1/queue"),
    ]);
    // the list leaves progress out (it is a stream look-up per job): ask for the active ones
    const active = list.items.filter((j) => j.state === "running" || j.state === "starting");
    const views = await Promise.all(active.map((j) => api("GET", `/v1/experiments/${j.id}`).catch(() => j)));
    const byId = new Map(views.map((v) => [v.id, v]));
    if (page.dead) return;
    const rows = list.items.map((j) => jobRow(byId.get(j.id) || j));
    put($("#jobs-body"), rows.length ? rows : html`<tr><td colspan="10" class="muted">no experiments yet:
      <a href="#/submit">submit one</a></td></tr>`);
    put($("#queue-body"), queue.items.length ? queue.items.map(queueRow)
      : html`<tr><td colspan="7" class="muted">the queue is empty</td></tr>`);
  };
  filter.addEventListener("change", () => refresh().catch(showError));
  await page.every(POLL_MS, refresh);
}
