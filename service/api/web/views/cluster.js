// #/cluster: nodes with their free CPUs/GPUs/memory and each running job's share, what Ray holds beyond our jobs, and what is
// running (polled).

import { api } from "../api.js";
import { $, html, num, POLL_MS, put } from "../dom.js";

const meter = (free, total) => html`<div class="bar" title="${num(total - free)} of ${num(total)} in use">
  <div class="fill running" style="width:${total ? ((100 * (total - free)) / total).toFixed(1) : 0}%"></div></div>`;

const alive = (ok) => (ok ? html`<span class="badge state-succeeded">alive</span>` : html`<span class="badge state-failed">not reporting</span>`);

const summary = (c) => html`${c.nodes.length} node(s) · CPUs <b>${num(c.cpus_free)}</b> free of ${num(c.cpus_total)} ·
  GPUs <b>${num(c.gpus_free)}</b> free of ${num(c.gpus_total)} ·
  ${c.memory_gb_total != null ? html`memory <b>${c.memory_gb_free.toFixed(1)}</b> GiB free of ${c.memory_gb_total.toFixed(1)} · ` : ""}
  ${c.cpus_outside || c.gpus_outside || c.memory_gb_outside ? html`<span id="outside" title="other Ray work on the cluster, or a finished job's workers still being released">Ray holds ${num(c.cpus_outside)} CPUs, ${num(c.gpus_outside)} GPUs${c.memory_gb_outside ? `, ${c.memory_gb_outside.toFixed(1)} GiB` : ""} beyond Teleport Lab's jobs</span> · ` : ""}
  scheduler ${alive(c.scheduler_alive)}`;

// a running job's share of the node: its workers there, their CPUs and GPUs (below 1: a share of a card), and the
// GPU memory its ranks on this node reported with its last epoch, summed
const held = (s) => html`${num(s.cpus)} CPU${s.gpus ? html` · ${num(s.gpus)} GPU` : ""}${
  s.memory_gb != null ? html` · ${num(s.memory_gb)} GiB` : ""}${
  s.gpu_memory_mb != null ? html` · <span class="gpu-memory">${num(s.gpu_memory_mb)} MiB</span>` : ""}`;
const share = (s) => s.job === null // another user's job: its share, without its id
  ? html`<span class="chip share muted" title="${s.workers} worker(s) here">another user's job ${held(s)}</span> `
  : html`<a class="chip share" href="#/job/${s.job}" title="${s.workers} worker(s) here">${s.job} ${held(s)}</a> `;

const nodeName = (n) => (n.hostname && n.address ? `${n.hostname} (${n.address})` : n.hostname || n.address || n.id.slice(0, 12));
const nodeRow = (n) => html`<tr><td class="mono" title="${n.id}">${nodeName(n)}${n.gpu_type ? html` <span class="muted">${n.gpu_type}</span>` : ""}</td>
  <td>${!n.alive ? html`<span class="badge state-failed">dead</span>`
    : n.leaving ? html`<span class="badge state-queued" title="tlab leave: nothing new starts here; its jobs move">leaving</span>` : "yes"}</td>
  <td>${num(n.cpus_free)} / ${num(n.cpus_total)}</td><td>${meter(n.cpus_free, n.cpus_total)}</td>
  <td>${num(n.gpus_free)} / ${num(n.gpus_total)}</td><td>${n.gpus_total ? meter(n.gpus_free, n.gpus_total) : ""}</td>
  ${n.memory_gb_total == null ? html`<td class="muted">not known</td><td></td>`
    : html`<td class="memory">${n.memory_gb_free.toFixed(1)} / ${n.memory_gb_total.toFixed(1)}</td><td>${meter(n.memory_gb_free, n.memory_gb_total)}</td>`}
  <td>${(n.jobs || []).map(share)}</td></tr>`;

export async function clusterPage(page) {
  put(page.el, html`<section class="card"><h2>Cluster</h2><p id="cluster-summary"></p>
    <table class="cluster"><thead><tr><th>node</th><th>alive</th><th>CPUs free / total</th><th></th><th>GPUs free / total</th><th></th>
      <th title="Ray's memory resource: what resources.memory_gb reserves">memory GiB free / total</th><th></th><th>running jobs' shares</th></tr></thead><tbody id="nodes-body"></tbody></table>
    <h3>Running</h3><p id="running"></p></section>`);
  await page.every(POLL_MS, async () => {
    const c = await api("GET", "/v1/cluster");
    if (page.dead) return;
    put($("#cluster-summary"), summary(c));
    put($("#nodes-body"), c.nodes.length ? c.nodes.map(nodeRow)
      : html`<tr><td colspan="9" class="muted">no nodes known yet: has the scheduler started?</td></tr>`);
    put($("#running"), c.running_jobs.length ? c.running_jobs.map((j) => html`<a class="chip" href="#/job/${j}">${j}</a> `)
      : html`<span class="muted">nothing is running</span>`);
  });
}
