// #/compare?ids=a,b: several experiments' curves on one chart (from /metrics), refreshed while any still runs.

import { api } from "../api.js";
import { aligned, destroy, lineChart, PALETTE } from "../charts.js";
import { $, badge, html, jobLink, num, POLL_MS, put, raw, TERMINAL } from "../dom.js";
import { showError } from "../page.js";

const layout = (list, ids) => html`
  <section class="card">
    <div class="row"><h2>Compare</h2>
      <label class="small">metric <select id="metric"><option>test_loss</option><option>train_loss</option>
        <option>test_acc</option></select></label></div>
    <div id="compare-chart" class="chart"></div>
    <table><thead><tr><th>job</th><th>state</th><th>epochs</th><th>last train loss</th><th>last test loss</th>
      <th>best test acc</th><th>teleports</th></tr></thead><tbody id="compare-body"></tbody></table>
  </section>
  <section class="card"><h3>Pick experiments</h3><div id="pick" class="pick">
    ${list.items.map((j) => html`<label><input type="checkbox" value="${j.id}" ${ids.has(j.id) ? raw("checked") : ""}>
      ${j.name || j.id} <span class="muted small">${j.id} · ${j.state}</span></label>`)}</div></section>`;

function summaryRow(j, m, colour) {
  const last = m.points.at(-1) || {};
  const accs = m.points.map((p) => p.test_acc).filter((a) => a !== undefined);
  return html`<tr><td><span class="swatch" style="background:${colour}"></span>${jobLink(j)}</td>
    <td>${badge(j.state || "?")}</td><td>${m.total_points}</td><td class="mono">${num(last.train_loss)}</td>
    <td class="mono">${num(last.test_loss)}</td><td class="mono">${accs.length ? num(Math.max(...accs)) : "–"}</td>
    <td>${m.teleports.length}</td></tr>`;
}

export async function comparePage(page, _parts, query) {
  const ids = new Set((query.get("ids") || "").split(",").map((s) => s.trim()).filter(Boolean));
  const list = await api("GET", "/v1/experiments", { params: { limit: 100 } });
  if (page.dead) return;
  put(page.el, layout(list, ids));
  const names = new Map(list.items.map((j) => [j.id, j]));
  let chart = null;
  let data = new Map(); // id -> metrics view
  const draw = () => {
    const metric = $("#metric").value;
    const chosen = [...ids].filter((id) => data.has(id));
    destroy(chart);
    $("#compare-chart").innerHTML = "";
    chart = lineChart($("#compare-chart"), {
      yLabel: metric, height: 320,
      series: chosen.map((id, i) => ({ label: names.get(id)?.name || id, color: PALETTE[i % PALETTE.length] })),
    });
    window.tlab.charts.compare = chart;
    chart.setData(aligned(chosen.map((id) => new Map(data.get(id).points.filter((p) => p[metric] !== undefined)
      .map((p) => [p.epoch, p[metric]])))));
    put($("#compare-body"), chosen.map((id, i) => summaryRow(names.get(id) || { id, kind: "experiment" }, data.get(id),
      PALETTE[i % PALETTE.length])));
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
  $("#pick").addEventListener("change", (ev) => {
    if (ev.target.checked) ids.add(ev.target.value); else ids.delete(ev.target.value);
    history.replaceState(null, "", `#/compare?ids=${[...ids].join(",")}`);
    load().catch(showError);
  });
  await page.every(3 * POLL_MS, load);
}
