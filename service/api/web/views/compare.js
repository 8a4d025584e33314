// #/compare?ids=a,b[&x=seconds]: several experiments' curves on one chart (from /metrics), refreshed while any still
// runs; x is epochs trained or wall-clock seconds (cumulative, teleport included), teleports marked on either.

import { api } from "../api.js";
import { aligned, destroy, lineChart, PALETTE } from "../charts.js";
import { $, badge, html, jobLink, num, POLL_MS, put, raw, TERMINAL, toTarget } from "../dom.js";
import { showError } from "../page.js";

const AXES = { epoch: "epochs trained", seconds: "wall-clock seconds" };

const layout = (list, ids, x) => html`
  <section class="card">
    <div class="row"><h2>Compare</h2>
      <label class="small">metric <select id="metric"><option>test_loss</option><option>train_loss</option>
        <option>test_acc</option></select></label>
      <label class="small">x axis <select id="x-axis">${Object.entries(AXES).map(([k, label]) => html`
        <option value="${k}" ${k === x ? raw("selected") : ""}>${label}</option>`)}</select></label>
      <span class="small muted">dashed lines: teleports, in the run's colour</span></div>
    <div id="compare-chart" class="chart"></div>
    <table><thead><tr><th>job</th><th>state</th><th>epochs</th><th>seconds</th><th>last train loss</th>
      <th>last test loss</th><th>best test acc</th><th>to target loss</th><th>teleports</th></tr></thead>
      <tbody id="compare-body"></tbody></table>
  </section>
  <section class="card"><h3>Pick experiments</h3><div id="pick" class="pick">
    ${list.items.map((j) => html`<label><input type="checkbox" value="${j.id}" ${ids.has(j.id) ? raw("checked") : ""}>
      ${j.name || j.id} <span class="muted small">${j.id} · ${j.state}</span></label>`)}</div></section>`;

function summaryRow(j, m, colour) {
  const last = m.points.at(-1) || {};
  const accs = m.points.map((p) => p.test_acc).filter((a) => a !== undefined);
  return html`<tr data-job="${j.id}"><td><span class="swatch" style="background:${colour}"></span>${jobLink(j)}</td>
    <td>${badge(j.state || "?")}</td><td>${m.total_points}</td><td class="mono">${num(last.seconds, 3)}</td>
    <td class="mono">${num(last.train_loss)}</td><td class="mono">${num(last.test_loss)}</td>
    <td class="mono">${accs.length ? num(Math.max(...accs)) : "–"}</td><td class="to-target">${toTarget(j.summary)}</td>
    <td>${m.teleports.length}</td></tr>`;
}

// x of an epoch record: epochs trained (epoch e ends at e + 1) or its cumulative seconds.
const xOf = (axis, p) => (axis === "seconds" ? p.seconds : p.epoch + 1);

// x of a teleport before epoch e: e epochs trained, or the seconds when epoch e - 1 ended (0 before the first).
function teleportXs(axis, m) {
  const epochs = [...new Set(m.teleports.map((t) => t.epoch))];
  if (axis !== "seconds") return epochs;
  return epochs.map((e) => m.points.filter((p) => p.epoch < e).reduce((s, p) => Math.max(s, p.seconds ?? 0), 0));
}

export async function comparePage(page, _parts, query) {
  const ids = new Set((query.get("ids") || "").split(",").map((s) => s.trim()).filter(Boolean));
  const list = await api("GET", "/v1/experiments", { params: { limit: 100 } });
  if (page.dead) return;
  put(page.el, layout(list, ids, query.get("x") in AXES ? query.get("x") : "epoch"));
  const names = new Map(list.items.map((j) => [j.id, j]));
  let chart = null;
  let data = new Map(); // id -> metrics view
  const address = () => {
    const x = $("#x-axis").value;
    history.replaceState(null, "", `#/compare?ids=${[...ids].join(",")}${x === "epoch" ? "" : `&x=${x}`}`);
  };
  const draw = () => {
    const metric = $("#metric").value;
    const axis = $("#x-axis").value; // read on every redraw: the choice outlives the refreshes
    const chosen = [...ids].filter((id) => data.has(id));
    const colour = (i) => PALETTE[i % PALETTE.length];
    destroy(chart);
    $("#compare-chart").innerHTML = "";
    chart = lineChart($("#compare-chart"), {
      yLabel: metric, xLabel: AXES[axis], height: 320, whole: axis === "epoch", origin: true,
      series: chosen.map((id, i) => ({ label: names.get(id)?.name || id, color: colour(i) })),
      marks: () => chosen.flatMap((id, i) => teleportXs(axis, data.get(id)).map((x) => ({ x, color: `${colour(i)}aa` }))),
    });
    window.tlab.charts.compare = chart;
    chart.setData(aligned(chosen.map((id) => new Map(data.get(id).points
      .filter((p) => p[metric] !== undefined && xOf(axis, p) !== undefined).map((p) => [xOf(axis, p), p[metric]])))));
    put($("#compare-body"), chosen.map((id, i) => summaryRow(names.get(id) || { id, kind: "experiment" }, data.get(id),
      colour(i))));
  };
  page.on(() => { destroy(chart); delete window.tlab.charts.compare; });
  const load = async () => {
    const got = await Promise.all([...ids].map(async (id) => [id, await api("GET", `/v1/experiments/${id}/metrics`,
      { params: { max_points: 2000 } })]));
    if (page.dead) return false;
    data = new Map(got);
    draw();
    return [...ids].some((id) => !TERMINAL.has(names.get(id)?.state)); // refresh while any still runs
  };
  $("#metric").addEventListener("change", draw);
  $("#x-axis").addEventListener("change", () => { address(); draw(); });
  $("#pick").addEventListener("change", (ev) => {
    if (ev.target.checked) ids.add(ev.target.value); else ids.delete(ev.target.value);
    address();
    load().catch(showError);
  });
  await page.every(3 * POLL_MS, load);
}
