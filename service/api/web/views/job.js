// #/job/ID: one experiment — live loss curves, teleport diagnostics grouped by epoch, artifacts, logs, spec, cancel.

import { api } from "../api.js";
import { PALETTE, TEST, throttle, TRAIN } from "../charts.js";
import { $, ago, badge, demandText, duration, html, num, POLL_MS, put, TERMINAL } from "../dom.js";
import { cancelButton, deleteButton, liveEnded, liveState, showError } from "../page.js";
import { artifactsCard, showArtifacts } from "./artifacts.js";
import { baselineOf, summaryTable } from "./summary.js";
import { EPOCH_ROWS, groupByEpoch, teleportTable, toggleOnClick } from "./teleports.js";

const layout = (id) => html`
  <section class="card">
    <div class="row"><h2 id="job-title">${id}</h2><span id="job-state"></span><span id="live" class="small muted"></span>
      <span class="grow"></span><button id="cancel" type="button" class="danger" hidden>Cancel job</button>
      <button id="delete" type="button" class="danger" hidden>Delete job</button></div>
    <dl id="job-facts" class="facts"></dl>
  </section>
  <section class="card"><h3>Summary</h3><div id="job-summary"></div></section>
  <section class="card"><div class="row"><h3>Loss</h3><span class="small muted"><span class="swatch"
    style="background:${TRAIN}"></span>train <span class="swatch" style="background:${TEST}"></span>test
    <span class="swatch mark"></span>teleport epochs</span></div>
    <div id="loss-chart" class="chart"></div><p id="no-points" class="muted small">waiting for the first epoch…</p>
    <div id="acc-wrap" hidden><h3>Test accuracy</h3><div id="acc-chart" class="chart"></div></div>
    <div id="lr-wrap" hidden><h3>Learning rate</h3><div id="lr-chart" class="chart"></div></div>
    <div id="grad-wrap" hidden><h3>Gradient norm before clipping <span id="clipped" class="small muted"></span></h3>
      <div id="grad-chart" class="chart"></div></div></section>
  <section class="card"><div class="row"><h3>Teleport diagnostics</h3><span id="tele-method" class="badge"></span>
    <span id="tele-count" class="small muted"></span></div>
    <p class="muted small">Each teleport climbs ‖∇L‖² at (nearly) unchanged loss on its batch; free directions per
      layer = input dim − kept rank (0 = that layer cannot move). One row per teleport epoch: click it for its batches.</p>
    <div id="tele-none" class="muted">no teleports yet</div>
    <div id="tele-wrap" hidden><div id="tele-chart" class="chart"></div><div id="tele-table"></div>
      <p id="tele-more" class="muted small"></p></div></section>
  ${artifactsCard(id, "weights (safetensors), last checkpoint, metrics.csv, summary.json and the run's own files")}
  <section class="card"><div class="row"><h3>Logs</h3><span class="grow"></span>
    <button id="load-logs" type="button">Reload driver log</button></div>
    <pre id="events-log" class="log"></pre><pre id="logs" class="log"></pre></section>
  <section class="card"><details><summary>Spec</summary><pre id="spec" class="log"></pre></details></section>`;

const jobHref = (id) => html`<a href="#/job/${encodeURIComponent(id)}">${id}</a>`;

// A continued or forked job: its parent (and the epoch it started from) and its own children, as links.
function lineageFacts(j) {
  const facts = [];
  if (j.parent) facts.push(["parent", html`${jobHref(j.parent)} <span class="muted">from its checkpoint after epoch ${j.parent_epoch}</span>`]);
  if (j.children?.length) facts.push(["children", j.children.map((c) => html`${jobHref(c)} `)]);
  return facts;
}

// A job that runs the user's code: its preflight (one CPU, before the gang): the verdict, then what it measured.
function preflightFacts(pf) {
  if (!pf) return [];
  const took = pf.seconds !== null && pf.seconds !== undefined ? ` in ${num(pf.seconds)} s` : "";
  const facts = [["preflight", `${pf.state}${took}${pf.error ? `: ${pf.error}` : ""}`]];
  if (pf.entrypoint) facts.push(["entrypoint", `${pf.entrypoint} imported, takes one argument`]);
  if (pf.params !== null && pf.params !== undefined) {
    facts.push(["model / data", `${pf.params.toLocaleString()} parameters; ${pf.train_size} train, ${pf.test_size} test, `
      + `x [${(pf.sample_shape || []).join(", ")}] (${pf.task})`]);
  }
  if (pf.teleport) {
    facts.push(["teleportable", `${pf.teleport} at τ=${num(pf.tau)}: ${pf.free_directions} free directions; `
      + (pf.layers || []).map((l) => `${l.name} ${l.free}/${l.input_dim}`).join(", ")]);
    const untouched = Object.entries(pf.untouched || {});
    if (untouched.length) facts.push(["untouched", untouched.map(([k, v]) => `${k}: ${v}`).join("; ")]);
    if (pf.step_advice) facts.push(["teleport step", pf.step_advice]);
  }
  return facts;
}

// a running GPU job's peak GPU memory so far: rank 0's, or each rank's when it has several
const gpuMemoryText = (p) => (p.gpu_memory_mb_ranks?.length > 1
  ? `${p.gpu_memory_mb_ranks.map((m, r) => `rank ${r} ${num(m)}`).join(" · ")} MiB at most so far`
  : `${num(p.gpu_memory_mb)} MiB at most so far`);

// where the job trained: its device, the GPUs Ray let it see, its process's peak host memory and its tensors' peak
// GPU memory (rank 0's)
const deviceText = (s) => [s.device, s.cuda_visible_devices === null || s.cuda_visible_devices === undefined ? ""
  : `CUDA_VISIBLE_DEVICES="${s.cuda_visible_devices}"`,
  s.host_memory_peak_mb === undefined ? "" : `peak host memory ${num(s.host_memory_peak_mb)} MiB`,
  s.gpu_memory_peak_mb === undefined ? "" : `peak GPU memory ${num(s.gpu_memory_peak_mb)} MiB`].filter(Boolean).join(" · ");

function jobFacts(j) {
  const facts = [
    ["id", j.id], ["owner", j.owner], ["created", ago(j.created_at)],
    ["ran for", j.started_at ? duration(j.started_at, j.finished_at) : "–"],
    ["needs", demandText(j.demand)], ["priority", j.priority], ["attempts", j.attempts],
    ["progress", j.progress?.epoch !== null && j.progress?.epoch !== undefined ? `${j.progress.epoch}/${j.progress.epochs ?? "?"} epochs` : "–"],
  ];
  if (j.progress?.gpu_memory_mb != null) facts.push(["GPU memory", gpuMemoryText(j.progress)]);
  if (j.state === "queued") facts.push(["queue position", j.queue_position ?? "–"], ["why pending", j.pending_reason || "–"]);
  if (j.failure_reason) facts.push(["failure", j.failure_reason]);
  facts.push(...preflightFacts(j.preflight));
  if (j.preemptions) facts.push(["preempted", `${j.preemptions} time(s); last: ${j.last_preemption || "–"}`]);
  facts.push(...lineageFacts(j));
  if (j.summary?.device) facts.push(["device", deviceText(j.summary)]);
  return facts.map(([k, v]) => html`<dt>${k}</dt><dd>${v}</dd>`);
}

// The charts and the teleport table, redrawn at most every 150 ms from what the stream has delivered so far.
function diagnostics(page) {
  const epochs = new Map(); // epoch -> metric record (a resumed job may resend an epoch: the last one wins)
  const teleports = new Map(); // "epoch:batch" -> teleport record (the same, per teleport batch)
  const expanded = new Set(); // teleport epochs whose batch rows are open
  toggleOnClick($("#tele-table"), expanded);
  const lossChart = page.chart("loss", $("#loss-chart"), {
    yLabel: "loss", series: [{ label: "train loss", color: TRAIN }, { label: "test loss", color: TEST }],
    marks: () => [...new Set([...teleports.values()].map((t) => t.epoch))],
  });
  let teleChart = null;
  // a chart of one more epoch metric, shown once a record has it: accuracy (classification), the learning rate
  // (optimizer.schedule), the gradient norm (training.grad_clip_norm)
  const optional = (key, name, label, color) => {
    let chart = null;
    return (rows) => {
      if (!rows.some((r) => r[key] !== undefined)) return;
      $(`#${name}-wrap`).hidden = false;
      chart ||= page.chart(name, $(`#${name}-chart`), { yLabel: label, height: 180, series: [{ label, color }] });
      chart.setData([rows.map((r) => r.epoch), rows.map((r) => r[key] ?? null)]);
    };
  };
  const extras = [optional("test_acc", "acc", "test acc", PALETTE[2]), optional("lr", "lr", "learning rate", PALETTE[5]),
    optional("grad_norm", "grad", "gradient norm", PALETTE[6])];
  const clippedText = (rows) => {
    const last = rows.findLast((r) => r.clipped !== undefined);
    if (last) $("#clipped").textContent = `(epoch ${last.epoch}: ${Math.round(100 * last.clipped)} % of steps clipped)`;
  };
  const drawTeleports = () => {
    const all = [...teleports.values()];
    $("#tele-none").hidden = true;
    $("#tele-wrap").hidden = false;
    teleChart ||= page.chart("teleport", $("#tele-chart"), {
      xLabel: "teleport #", yLabel: "‖∇L‖²", log: true, height: 200,
      series: [{ label: "‖∇L‖² before", color: PALETTE[7], dash: [6, 4] }, { label: "‖∇L‖² after", color: PALETTE[4] }],
    });
    const pos = (x) => (x > 0 ? x : null); // a log scale has no zero
    teleChart.setData([all.map((_, i) => i + 1), all.map((t) => pos(t.grad_norm_sq_before)), all.map((t) => pos(t.grad_norm_sq_after))]);
    const groups = groupByEpoch(all);
    $("#tele-method").textContent = [...new Set(all.map((t) => t.method || "nullspace"))].join(", ");
    $("#tele-count").textContent = `${all.length} teleport batches in ${groups.length} epochs`;
    put($("#tele-table"), teleportTable(groups.slice(0, EPOCH_ROWS), expanded));
    $("#tele-more").textContent = groups.length > EPOCH_ROWS ? `showing the latest ${EPOCH_ROWS} of ${groups.length} teleport epochs` : "";
  };
  const redraw = throttle(() => {
    if (page.dead) return;
    const rows = [...epochs.values()].sort((a, b) => a.epoch - b.epoch);
    lossChart.setData([rows.map((r) => r.epoch), rows.map((r) => r.train_loss ?? null), rows.map((r) => r.test_loss ?? null)]);
    $("#no-points").hidden = rows.length > 0;
    extras.forEach((draw) => draw(rows));
    clippedText(rows);
    if (teleports.size) drawTeleports();
  });
  return {
    metric: (m) => { epochs.set(m.epoch, m); redraw(); },
    teleport: (t) => { teleports.set(`${t.epoch}:${t.batch ?? teleports.size}`, t); redraw(); },
  };
}

function eventsLog() {
  const box = $("#events-log");
  return (text, cls = "") => {
    const line = document.createElement("div");
    line.textContent = text;
    if (cls) line.className = cls;
    box.append(line);
    while (box.childElementCount > 500) box.firstElementChild.remove();
  };
}

export async function jobPage(page, [id]) {
  put(page.el, layout(id));
  const draw = diagnostics(page);
  const logLine = eventsLog();
  const loadLogs = async () => {
    try {
      const text = await api("GET", `/v1/experiments/${id}/logs`, { text: true });
      $("#logs").textContent = text.replace(/\x1b\[[0-9;]*[A-Za-z]/g, ""); // Ray colours its log lines
    } catch (err) {
      showError(err);
    }
  };
  $("#load-logs").addEventListener("click", loadLogs);

  let job = null;
  let baseline = null; // the job this one was started beside as its baseline (`tlab demo`), once it has ended
  const showJob = (j) => {
    job = j;
    $("#job-title").textContent = j.name || j.id;
    put($("#job-state"), badge(j.state));
    $("#cancel").hidden = TERMINAL.has(j.state);
    $("#delete").hidden = !TERMINAL.has(j.state);
    put($("#job-facts"), jobFacts(j));
    put($("#job-summary"), summaryTable(j.summary, baseline));
    $("#spec").textContent = JSON.stringify(j.spec, null, 2);
  };
  const refreshJob = async () => {
    const j = await api("GET", `/v1/experiments/${id}`);
    const bid = baselineOf(j);
    if (bid && !(baseline && TERMINAL.has(baseline.state))) baseline = await api("GET", `/v1/experiments/${bid}`).catch(() => null);
    if (page.dead) return false;
    if (j.kind === "sweep") { location.hash = `#/sweep/${id}`; return false; }
    showJob(j);
    return !TERMINAL.has(j.state);
  };
  cancelButton(page, `/v1/experiments/${id}`, "Cancel job", refreshJob);
  deleteButton(page, `/v1/experiments/${id}`, "Delete job", () => { location.hash = "#/jobs"; });

  await refreshJob().catch((err) => showError(err));
  if (page.dead || !job) return;
  if (TERMINAL.has(job.state)) showArtifacts(`/v1/experiments/${id}`).catch(showError);
  if (job.parent) { // the ancestors' epochs (the metrics route joins them) before this job's own stream
    api("GET", `/v1/experiments/${id}/metrics`).then((m) => m.points.filter((r) => r.job !== id).forEach(draw.metric))
      .catch(showError);
  }
  page.every(POLL_MS, refreshJob);
  page.every(5 * POLL_MS, async () => { // the driver log, while Ray is writing it
    await loadLogs();
    return !TERMINAL.has(job.state);
  });
  page.stream(`/v1/experiments/${id}/events`, {
    ...draw,
    log: (l) => logLine(`[${l.level || "info"}] ${l.message}`, l.level === "error" ? "err" : ""),
    status: (s) => {
      if (s.kind === "status" && s.at && job) showJob({ ...job, state: s.state });
      else if (s.kind === "error") logLine(`[error] epoch ${s.epoch}: ${s.message}`, "err");
      else if ((s.kind === "budget" || s.kind === "hint") && s.message) logLine(`[${s.kind}] ${s.message}`);
      else if (s.kind === "start") logLine(`started: ${s.dataset} (${s.train_size} train / ${s.test_size} test), ${s.model}, ${s.params} parameters`);
    },
    end: (e) => {
      liveEnded(e.state);
      refreshJob().catch(showError);
      showArtifacts(`/v1/experiments/${id}`).catch(showError);
      loadLogs();
    },
    state: (st) => {
      if (liveState(st) && st === "closed") api("GET", `/v1/experiments/${id}`).catch(showError); // say why (401/403/404)
    },
  });
}
