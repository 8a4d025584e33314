// #/sweeps: the sweeps table (polled). #/sweep/ID: one sweep — every trial's curve live, the trials table, the best
// and, once it ended, the best trial's artifacts.

import { api } from "../api.js";
import { aligned, destroy, lineChart, PALETTE, throttle } from "../charts.js";
import { $, ago, badge, clip, html, jobLink, num, POLL_MS, put, TERMINAL, toTarget } from "../dom.js";
import { cancelButton, deleteButton, liveEnded, liveState, showError } from "../page.js";
import { artifactsCard, showArtifacts } from "./artifacts.js";

const sweepRow = (j) => html`<tr><td>${jobLink(j)}</td>
  <td class="mono small">${j.id}</td><td>${j.owner}</td><td>${badge(j.state)}</td><td>${j.queue_position ?? ""}</td>
  <td class="reason">${clip(j.state === "queued" ? j.pending_reason : j.failure_reason)}</td>
  <td class="small">${ago(j.created_at)}</td></tr>`;

export async function sweepsPage(page) {
  put(page.el, html`<section class="card"><h2>Sweeps</h2>
    <p class="muted small">Submit one with <code>tlab sweep SPEC --space SPACE.yaml</code> or <code>POST /v1/sweeps</code>.</p>
    <table><thead><tr><th>name</th><th>id</th><th>owner</th><th>state</th><th>pos</th><th>why pending / outcome</th>
      <th>created</th></tr></thead><tbody id="sweeps-body"></tbody></table></section>`);
  await page.every(POLL_MS, async () => {
    const list = await api("GET", "/v1/sweeps", { params: { limit: 100 } });
    if (page.dead) return;
    put($("#sweeps-body"), list.items.length ? list.items.map(sweepRow)
      : html`<tr><td colspan="7" class="muted">no sweeps yet</td></tr>`);
  });
}

const layout = (id) => html`
  <section class="card">
    <div class="row"><h2 id="sweep-title">${id}</h2><span id="sweep-state"></span><span id="live" class="small muted"></span>
      <span class="grow"></span><button id="cancel" type="button" class="danger" hidden>Cancel sweep</button>
      <button id="delete" type="button" class="danger" hidden>Delete sweep</button></div>
    <p id="sweep-best" class="small"></p>
  </section>
  <section class="card"><h3 id="sweep-metric">Trials</h3><div id="sweep-chart" class="chart"></div>
    <p id="no-curves" class="muted small">no trial has reported an epoch yet</p>
    <table><thead><tr><th>trial</th><th>config</th><th>state</th><th>epochs</th><th>last</th><th>best</th>
      <th>to target loss</th><th>scheduler</th></tr></thead><tbody id="trials-body"></tbody></table></section>
  ${artifactsCard(id, "the best trial's weights (safetensors), last checkpoint, metrics.csv and summary.json (which names the trial)")}`;

const config = (c) => Object.entries(c).map(([k, x]) => `${k}=${num(x)}`).join("  ");

function bestLine(v) {
  if (v.best) {
    return html`${TERMINAL.has(v.job.state) ? "best" : "best so far"}: <b>${v.best.trial}</b> ${v.metric}=${num(v.best.best)} with ${config(v.best.config)}`;
  }
  return v.job.state === "queued" ? html`queued: ${v.job.pending_reason || ""}` : v.job.failure_reason || "";
}

const trialRow = (v, t) => html`<tr class="${v.best?.trial === t.trial ? "best" : ""}">
  <td class="mono">${t.trial}</td><td class="small mono">${clip(config(t.config))}</td><td>${t.state}</td><td>${t.epochs}</td>
  <td class="mono">${num(t.last)}</td><td class="mono">${num(t.best)}</td><td class="to-target">${toTarget(t.summary)}</td>
  <td>${t.stopped_early ? "stopped early" : t.perturbed ? `PBT moves: ${t.perturbed}` : ""}</td></tr>`;

// One series per trial; the chart is rebuilt when a trial appears, otherwise only its data changes.
function trialCurves(page, metricOf) {
  const curves = new Map(); // trial -> Map(epoch -> record)
  let chart = null;
  let drawnTrials = "";
  page.on(() => { destroy(chart); delete window.tlab.charts.sweep; });
  const redraw = throttle(() => {
    if (page.dead || !curves.size) return;
    $("#no-curves").hidden = true;
    const trials = [...curves.keys()].sort();
    const metric = metricOf();
    if (trials.join() !== drawnTrials) {
      destroy(chart);
      $("#sweep-chart").innerHTML = "";
      chart = lineChart($("#sweep-chart"), {
        yLabel: metric, height: 300, series: trials.map((t, i) => ({ label: t, color: PALETTE[i % PALETTE.length] })),
      });
      window.tlab.charts.sweep = chart;
      drawnTrials = trials.join();
    }
    chart.setData(aligned(trials.map((t) => new Map([...curves.get(t).values()]
      .filter((r) => r[metric] !== undefined).map((r) => [r.epoch, r[metric]])))));
  });
  return (m) => {
    const t = m.trial || "(driver)";
    if (!curves.has(t)) curves.set(t, new Map());
    curves.get(t).set(m.epoch, m);
    redraw();
  };
}

export async function sweepPage(page, [id]) {
  put(page.el, layout(id));
  let sweep = null;
  const metric = trialCurves(page, () => sweep?.metric || "test_loss");
  const refresh = async () => {
    const v = await api("GET", `/v1/sweeps/${id}`);
    if (page.dead) return false;
    sweep = v;
    $("#sweep-title").textContent = v.job.name || id;
    put($("#sweep-state"), badge(v.job.state));
    $("#cancel").hidden = TERMINAL.has(v.job.state);
    $("#delete").hidden = !TERMINAL.has(v.job.state);
    $("#sweep-metric").textContent = `Trials: ${v.metric} (${v.mode})`;
    put($("#sweep-best"), bestLine(v));
    put($("#trials-body"), v.trials.length ? v.trials.map((t) => trialRow(v, t))
      : html`<tr><td colspan="8" class="muted">no trial has reported yet</td></tr>`);
    return !TERMINAL.has(v.job.state);
  };
  cancelButton(page, `/v1/sweeps/${id}`, "Cancel sweep", refresh);
  deleteButton(page, `/v1/sweeps/${id}`, "Delete sweep", () => { location.hash = "#/sweeps"; });
  await refresh().catch(showError);
  if (page.dead || !sweep) return;
  if (TERMINAL.has(sweep.job.state)) showArtifacts(`/v1/sweeps/${id}`).catch(showError);
  page.every(POLL_MS, refresh);
  page.stream(`/v1/sweeps/${id}/events`, {
    metric,
    end: (e) => {
      liveEnded(e.state);
      refresh().catch(showError);
      showArtifacts(`/v1/sweeps/${id}`).catch(showError);
    },
    state: liveState,
  });
}
