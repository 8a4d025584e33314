// Teleport Lab dashboard: hash-routed pages over the REST API (no framework, no build step).
//
// #/signin  #/jobs  #/job/ID  #/submit  #/compare?ids=a,b  #/sweeps  #/sweep/ID  #/cluster
// Tables poll every 2 s; a job's curves and teleport diagnostics come live from its SSE stream.

import { api, ApiError, follow, token } from "./api.js";
import { aligned, destroy, lineChart, PALETTE, TEST, throttle, TRAIN } from "./charts.js";

const POLL_MS = 2000;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const TELEPORT_ROWS = 200; // the diagnostics table shows the latest teleports

// What the browser test (and a curious user's console) can look at.
window.tlab = { charts: {}, me: null };

// ---- tiny HTML templating: interpolations are escaped unless wrapped in raw() ----------------

class Raw {
  constructor(s) { this.s = s; }
}
const raw = (s) => new Raw(s);
const esc = (s) => s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const piece = (v) => (v instanceof Raw ? v.s : Array.isArray(v) ? v.map(piece).join("")
  : v === null || v === undefined || v === false ? "" : esc(String(v)));
const html = (strings, ...vals) => raw(strings.reduce((out, s, i) => out + s + (i < vals.length ? piece(vals[i]) : ""), ""));
const put = (el, content) => { el.innerHTML = piece(content); };
const $ = (sel, root = document) => root.querySelector(sel);

// ---- formatting ------------------------------------------------------------------------------

function num(x, digits = 4) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  const a = Math.abs(x);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? x.toExponential(digits - 1) : String(Number(x.toPrecision(digits)));
}
function ago(t) {
  if (!t) return "–";
  const s = Date.now() / 1000 - t;
  if (s < 60) return `${Math.max(0, Math.round(s))} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return new Date(t * 1000).toLocaleString();
}
function duration(a, b) {
  if (!a) return "–";
  const s = (b || Date.now() / 1000) - a;
  return s < 120 ? `${s.toFixed(1)} s` : s < 7200 ? `${(s / 60).toFixed(1)} min` : `${(s / 3600).toFixed(1)} h`;
}
const badge = (state) => html`<span class="badge state-${state}">${state}</span>`;
const jobLink = (j) => html`<a href="#/${j.kind === "sweep" ? "sweep" : "job"}/${encodeURIComponent(j.id)}">${j.name || j.id}</a>`;
const demandText = (d) => d ? `${d.workers} × (${num(d.cpus_per_worker)} CPU${d.gpus_per_worker ? `, ${num(d.gpus_per_worker)} GPU` : ""})` : "–";
function progressCell(p, state) {
  if (!p || p.epoch === null || p.epoch === undefined) return html`<span class="muted">–</span>`;
  const frac = p.epochs ? Math.min(1, p.epoch / p.epochs) : 0;
  return html`<div class="bar" title="${p.epoch} of ${p.epochs ?? "?"} epochs"><div class="fill ${state}" style="width:${(100 * frac).toFixed(1)}%"></div></div>
    <span class="small">${p.epoch}/${p.epochs ?? "?"}</span>`;
}

// ---- the one-line error bar ------------------------------------------------------------------

let errorOwner = null;
function showError(err, owner = null) {
  const box = $("#error");
  box.textContent = err instanceof Error ? err.message : String(err);
  box.hidden = false;
  errorOwner = owner;
  if (err instanceof ApiError && err.status === 401 && location.hash !== "#/signin") {
    token.clear();
    sessionStorage.setItem("tlab.next", location.hash);
    location.hash = "#/signin";
    box.textContent = `${err.message} (sign in again)`;
  }
}
function clearError(owner = undefined) {
  if (owner !== undefined && owner !== errorOwner) return;
  $("#error").hidden = true;
  errorOwner = null;
}

// ---- a page's lifetime: timers, streams and charts end when the route changes ------------------

class Page {
  constructor(el) {
    this.el = el;
    this.dead = false;
    this.cleanups = [];
  }
  on(fn) { this.cleanups.push(fn); }
  close() {
    this.dead = true;
    for (const fn of this.cleanups.splice(0)) {
      try { fn(); } catch (err) { console.error(err); }
    }
  }
  // Runs fn now and every `ms` after it finishes; an error shows once and clears when fn succeeds again.
  every(ms, fn) {
    const owner = {};
    let timer = null;
    const tick = async () => {
      if (this.dead) return;
      try {
        const again = await fn();
        clearError(owner);
        if (again === false) return; // the page has nothing more to wait for
      } catch (err) {
        if (!this.dead) showError(err, owner);
      }
      if (!this.dead) timer = setTimeout(tick, ms);
    };
    this.on(() => clearTimeout(timer));
    return tick();
  }
  chart(name, el, opts) {
    const u = lineChart(el, opts);
    window.tlab.charts[name] = u;
    this.on(() => { destroy(u); if (window.tlab.charts[name] === u) delete window.tlab.charts[name]; });
    return u;
  }
  stream(path, handlers) {
    const es = follow(path, handlers);
    this.on(() => es.close());
    return es;
  }
}

// ---- sign in / out ---------------------------------------------------------------------------

async function whoami() {
  window.tlab.me = await api("GET", "/v1/me");
  const me = window.tlab.me;
  $("#who").textContent = `${me.name} (${me.role})`;
  $("#signout").hidden = false;
  return me;
}

function signedOut() {
  window.tlab.me = null;
  $("#who").textContent = "";
  $("#signout").hidden = true;
}

function signinPage(page) {
  signedOut();
  put(page.el, html`
    <section class="card narrow">
      <h2>Sign in</h2>
      <p class="muted">Paste your Teleport Lab token. The admin's is in <code>$TLAB_HOME/admin.token</code>
        (<code>tlab up</code> writes it); an admin creates users' tokens with <code>tlab users create</code>.</p>
      <form id="signin-form">
        <label>Token <input id="token" type="password" autocomplete="current-password" required autofocus></label>
        <button type="submit">Sign in</button>
      </form>
    </section>`);
  $("#signin-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    token.set($("#token").value.trim());
    try {
      await whoami();
      clearError();
      location.hash = sessionStorage.getItem("tlab.next") || "#/jobs";
      sessionStorage.removeItem("tlab.next");
    } catch (err) {
      token.clear();
      signedOut();
      showError(err instanceof ApiError && err.status === 401 ? new Error("401: that token was refused") : err);
    }
  });
}

// ---- jobs and queue --------------------------------------------------------------------------

const selected = new Set(); // experiments ticked for the compare view (kept across pages)

async function jobsPage(page) {
  put(page.el, html`
    <section class="card">
      <div class="row"><h2>Experiments</h2>
        <label class="small">state <select id="state-filter"><option value="">any</option>
          ${["queued", "starting", "running", "succeeded", "failed", "cancelled"].map((s) => html`<option>${s}</option>`)}
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
  let refresh = null;
  filter.addEventListener("change", () => refresh?.());
  refresh = async () => {
    const [list, queue] = await Promise.all([
      api("GET", "/v1/experiments", { params: { limit: 100, state: filter.value } }),
      api("GET", "/v1/queue"),
    ]);
    // the list leaves progress out (it is a stream look-up per job): ask for the active ones
    const active = list.items.filter((j) => j.state === "running" || j.state === "starting");
    const views = await Promise.all(active.map((j) => api("GET", `/v1/experiments/${j.id}`).catch(() => j)));
    const byId = new Map(views.map((v) => [v.id, v]));
    if (page.dead) return;
    const rows = list.items.map((j0) => {
      const j = byId.get(j0.id) || j0;
      const outcome = j.state === "queued" ? j.pending_reason : j.failure_reason
        || (j.summary ? `final train ${num(j.summary.final_train_loss)}` : "");
      const p = j.progress || {};
      return html`<tr data-job="${j.id}" class="state-${j.state}">
        <td><input type="checkbox" data-id="${j.id}" ${selected.has(j.id) ? raw("checked") : ""} aria-label="select ${j.id}"></td>
        <td>${jobLink(j)}</td><td class="mono small">${j.id}</td><td>${j.owner}</td><td>${badge(j.state)}</td>
        <td>${j.queue_position ?? ""}</td><td class="reason">${outcome || ""}</td>
        <td class="progress">${progressCell(TERMINAL.has(j.state) && j.summary ? { epoch: j.summary.epochs, epochs: j.spec.training?.epochs } : p, j.state)}</td>
        <td class="mono small">${p.train_loss !== undefined && p.train_loss !== null ? `${num(p.train_loss)} / ${num(p.test_loss)}` : ""}</td>
        <td class="small">${ago(j.created_at)}</td></tr>`;
    });
    put($("#jobs-body"), rows.length ? rows : html`<tr><td colspan="10" class="muted">no experiments yet:
      <a href="#/submit">submit one</a></td></tr>`);
    put($("#queue-body"), queue.items.length ? queue.items.map((q) => html`<tr>
      <td>${q.position}</td><td><a href="#/job/${q.id}">${q.name || q.id}</a></td><td>${q.owner}</td><td>${q.priority}</td>
      <td class="small">${demandText(q.demand)}</td><td class="reason">${q.pending_reason || ""}</td>
      <td class="small">${ago(q.created_at)}</td></tr>`) : html`<tr><td colspan="7" class="muted">the queue is empty</td></tr>`);
  };
  await page.every(POLL_MS, refresh);
}

// ---- one experiment: live curves, teleport diagnostics, logs, cancel ----------------------------

function cancelButton(page, path, label, after) {
  const btn = $("#cancel", page.el);
  let armed = null;
  btn.addEventListener("click", async () => {
    if (!armed) { // two clicks: a stray click never cancels a day of training
      btn.textContent = "Click again to cancel";
      btn.classList.add("armed");
      armed = setTimeout(() => { armed = null; btn.textContent = label; btn.classList.remove("armed"); }, 5000);
      return;
    }
    clearTimeout(armed);
    armed = null;
    btn.disabled = true;
    btn.textContent = "Cancelling…";
    try {
      await api("DELETE", path);
      await after();
    } catch (err) {
      showError(err);
      btn.disabled = false;
      btn.textContent = label;
      btn.classList.remove("armed");
    }
  });
  page.on(() => clearTimeout(armed));
}

function teleportRow(t) {
  const rel = (a, b) => (a ? `${num((100 * (b - a)) / Math.abs(a), 3)} %` : "–");
  const layers = (t.layers || []).map((l) => html`<span class="layer" title="${l.kind}: input dim ${l.input_dim}, rank ${l.rank}, captured variance ${num(l.captured_variance)}">${l.name} <b>${l.free}</b>/${l.input_dim}</span>`);
  return html`<tr><td>${t.epoch}</td><td>${t.batch ?? ""}</td><td>${t.method || ""}</td>
    <td class="mono">${num(t.grad_norm_sq_before, 6)}</td><td class="mono">${num(t.grad_norm_sq_after, 6)}</td>
    <td class="mono">×${num(t.grad_norm_sq_after / t.grad_norm_sq_before, 6)}</td>
    <td class="mono">${rel(t.loss_before, t.loss_after)}</td>
    <td class="mono">${t.heldout_loss_before !== null && t.heldout_loss_before !== undefined ? rel(t.heldout_loss_before, t.heldout_loss_after) : "–"}</td>
    <td>${t.steps}${t.backoffs ? ` (${t.backoffs} backoffs)` : ""}</td><td>${t.stop_reason || ""}</td>
    <td class="layers">${layers.length ? layers : html`<span class="muted">–</span>`}</td></tr>`;
}

async function jobPage(page, [id]) {
  put(page.el, html`
    <section class="card">
      <div class="row"><h2 id="job-title">${id}</h2><span id="job-state"></span><span id="live" class="small muted"></span>
        <span class="grow"></span><button id="cancel" type="button" class="danger" hidden>Cancel job</button></div>
      <dl id="job-facts" class="facts"></dl>
    </section>
    <section class="card"><div class="row"><h3>Loss</h3><span class="small muted"><span class="swatch"
      style="background:${TRAIN}"></span>train <span class="swatch" style="background:${TEST}"></span>test
      <span class="swatch mark"></span>teleport epochs</span></div>
      <div id="loss-chart" class="chart"></div><p id="no-points" class="muted small">waiting for the first epoch…</p>
      <div id="acc-wrap" hidden><h3>Test accuracy</h3><div id="acc-chart" class="chart"></div></div></section>
    <section class="card"><h3>Teleport diagnostics</h3>
      <p class="muted small">Each teleport climbs ‖∇L‖² at (nearly) unchanged loss on its batch; free directions per
        layer = input dim − kept rank (0 = that layer cannot move).</p>
      <div id="tele-none" class="muted">no teleports yet</div>
      <div id="tele-wrap" hidden><div id="tele-chart" class="chart"></div>
      <table><thead><tr><th>epoch</th><th>batch</th><th>method</th><th>‖∇L‖² before</th><th>after</th><th>ratio</th>
        <th>loss drift (batch)</th><th>held-out drift</th><th>steps</th><th>stopped by</th><th>free directions per layer</th>
        </tr></thead><tbody id="tele-body"></tbody></table><p id="tele-more" class="muted small"></p></div></section>
    <section class="card"><div class="row"><h3>Logs</h3><span class="grow"></span>
      <button id="load-logs" type="button">Reload driver log</button></div>
      <pre id="events-log" class="log"></pre><pre id="logs" class="log"></pre></section>
    <section class="card"><details><summary>Spec</summary><pre id="spec" class="log"></pre></details></section>`);

  const epochs = new Map(); // epoch -> metric record (a resumed job may resend an epoch: the last one wins)
  const teleports = [];
  const lossChart = page.chart("loss", $("#loss-chart"), {
    yLabel: "loss", series: [{ label: "train loss", color: TRAIN }, { label: "test loss", color: TEST }],
    marks: () => [...new Set(teleports.map((t) => t.epoch))],
  });
  let accChart = null;
  let teleChart = null;
  const redraw = throttle(() => {
    if (page.dead) return;
    const rows = [...epochs.values()].sort((a, b) => a.epoch - b.epoch);
    lossChart.setData([rows.map((r) => r.epoch), rows.map((r) => r.train_loss ?? null), rows.map((r) => r.test_loss ?? null)]);
    $("#no-points").hidden = rows.length > 0;
    if (rows.some((r) => r.test_acc !== undefined)) {
      $("#acc-wrap").hidden = false;
      accChart ||= page.chart("acc", $("#acc-chart"), { yLabel: "accuracy", height: 180, series: [{ label: "test acc", color: PALETTE[2] }] });
      accChart.setData([rows.map((r) => r.epoch), rows.map((r) => r.test_acc ?? null)]);
    }
    if (teleports.length) {
      $("#tele-none").hidden = true;
      $("#tele-wrap").hidden = false;
      teleChart ||= page.chart("teleport", $("#tele-chart"), {
        xLabel: "teleport #", yLabel: "‖∇L‖²", log: true, height: 200,
        series: [{ label: "‖∇L‖² before", color: PALETTE[7], dash: [6, 4] }, { label: "‖∇L‖² after", color: PALETTE[4] }],
      });
      const pos = (x) => (x > 0 ? x : null); // a log scale has no zero
      teleChart.setData([teleports.map((_, i) => i + 1), teleports.map((t) => pos(t.grad_norm_sq_before)),
        teleports.map((t) => pos(t.grad_norm_sq_after))]);
      put($("#tele-body"), teleports.slice(-TELEPORT_ROWS).reverse().map(teleportRow));
      $("#tele-more").textContent = teleports.length > TELEPORT_ROWS
        ? `showing the latest ${TELEPORT_ROWS} of ${teleports.length} teleports` : "";
    }
  });

  const eventsLog = $("#events-log");
  const logLine = (text, cls = "") => {
    const line = document.createElement("div");
    line.textContent = text;
    if (cls) line.className = cls;
    eventsLog.append(line);
    while (eventsLog.childElementCount > 500) eventsLog.firstElementChild.remove();
  };
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
  const showJob = (j) => {
    job = j;
    $("#job-title").textContent = j.name || j.id;
    put($("#job-state"), badge(j.state));
    $("#cancel").hidden = TERMINAL.has(j.state);
    const facts = [
      ["id", j.id], ["owner", j.owner], ["created", ago(j.created_at)],
      ["ran for", j.started_at ? duration(j.started_at, j.finished_at) : "–"],
      ["needs", demandText(j.demand)], ["priority", j.priority], ["attempts", j.attempts],
      ["progress", j.progress?.epoch !== null && j.progress?.epoch !== undefined ? `${j.progress.epoch}/${j.progress.epochs ?? "?"} epochs` : "–"],
    ];
    if (j.state === "queued") facts.push(["queue position", j.queue_position ?? "–"], ["why pending", j.pending_reason || "–"]);
    if (j.failure_reason) facts.push(["failure", j.failure_reason]);
    if (j.summary) facts.push(["summary", Object.entries(j.summary).filter(([, v]) => typeof v !== "object")
      .map(([k, v]) => `${k}=${num(v)}`).join("  ")]);
    put($("#job-facts"), facts.map(([k, v]) => html`<dt>${k}</dt><dd>${v}</dd>`));
    $("#spec").textContent = JSON.stringify(j.spec, null, 2);
  };
  const refreshJob = async () => {
    const j = await api("GET", `/v1/experiments/${id}`);
    if (page.dead) return false;
    if (j.kind === "sweep") { location.hash = `#/sweep/${id}`; return false; }
    showJob(j);
    return !TERMINAL.has(j.state);
  };
  cancelButton(page, `/v1/experiments/${id}`, "Cancel job", refreshJob);

  await refreshJob().catch((err) => showError(err));
  if (page.dead || !job) return;
  page.every(POLL_MS, refreshJob);
  page.every(5 * POLL_MS, async () => { // the driver log, while Ray is writing it
    await loadLogs();
    return !TERMINAL.has(job.state);
  });
  page.stream(`/v1/experiments/${id}/events`, {
    metric: (m) => { epochs.set(m.epoch, m); redraw(); },
    teleport: (t) => { teleports.push(t); redraw(); },
    log: (l) => logLine(`[${l.level || "info"}] ${l.message}`, l.level === "error" ? "err" : ""),
    status: (s) => {
      if (s.kind === "status" && s.at && job) showJob({ ...job, state: s.state });
      else if (s.kind === "error") logLine(`[error] epoch ${s.epoch}: ${s.message}`, "err");
      else if (s.kind === "start") logLine(`started: ${s.dataset} (${s.train_size} train / ${s.test_size} test), ${s.model}, ${s.params} parameters`);
    },
    end: (e) => {
      $("#live").textContent = `ended: ${e.state}`;
      $("#live").classList.remove("on");
      refreshJob().catch(showError);
      loadLogs();
    },
    state: (st) => {
      if ($("#live").textContent.startsWith("ended")) return;
      $("#live").textContent = st === "live" ? "● live" : st === "reconnecting" ? "reconnecting…" : "stream closed";
      $("#live").classList.toggle("on", st === "live");
      if (st === "closed") api("GET", `/v1/experiments/${id}`).catch(showError); // say why (401/403/404)
    },
  });
}

// ---- submit ----------------------------------------------------------------------------------

// "training.epochs=5" lines on top of the spec: values are JSON when they parse, text otherwise.
function applyOverrides(spec, text) {
  for (const [n, line0] of text.split("\n").entries()) {
    const line = line0.trim();
    if (!line || line.startsWith("#")) continue;
    const eq = line.indexOf("=");
    if (eq < 1) throw new Error(`overrides line ${n + 1}: write path=value, e.g. training.epochs=5`);
    const path = line.slice(0, eq).trim().split(".");
    const rawValue = line.slice(eq + 1).trim();
    let value;
    try { value = JSON.parse(rawValue); } catch { value = rawValue; }
    let node = spec;
    for (const key of path.slice(0, -1)) {
      if (typeof node[key] !== "object" || node[key] === null) node[key] = {};
      node = node[key];
    }
    node[path.at(-1)] = value;
  }
  return spec;
}

async function submitPage(page) {
  const presets = await api("GET", "/v1/presets");
  if (page.dead) return;
  put(page.el, html`
    <section class="card">
      <h2>New experiment</h2>
      <form id="submit-form" class="grid">
        <label>Preset <select id="preset"><option value="">(blank: all defaults)</option>
          ${Object.keys(presets).map((p) => html`<option>${p}</option>`)}</select></label>
        <p id="preset-note" class="muted small"></p>
        <label>Name <input id="name" placeholder="defaults to the job id"></label>
        <label>Priority <input id="priority" type="number" value="0" min="-100" max="100"></label>
        <label>Tags <input id="tags" placeholder="comma,separated"></label>
        <label class="wide">Spec (JSON: ExperimentSpec)<textarea id="spec" rows="16" spellcheck="false">{}</textarea></label>
        <label class="wide"><span>Overrides (one <code>path=value</code> a line, applied on top)</span>
          <textarea id="overrides" rows="3" spellcheck="false" placeholder="training.epochs=5&#10;teleport.tau=0.9"></textarea></label>
        <div class="wide row"><button id="dry-run" type="button">Check fit</button>
          <button id="submit" type="submit" class="primary">Submit</button><span id="submit-result" class="small"></span></div>
      </form>
    </section>`);
  $("#preset").addEventListener("change", () => {
    const p = presets[$("#preset").value];
    $("#spec").value = JSON.stringify(p ? p.spec : {}, null, 2);
    $("#preset-note").textContent = p ? p.note : "";
    if (p && !$("#name").value) $("#name").placeholder = $("#preset").value;
  });
  const body = () => {
    let spec;
    try {
      spec = JSON.parse($("#spec").value || "{}");
    } catch (err) {
      throw new Error(`spec: not valid JSON (${err.message})`);
    }
    const tags = $("#tags").value.split(",").map((t) => t.trim()).filter(Boolean);
    return { spec: applyOverrides(spec, $("#overrides").value), name: $("#name").value.trim()
      || ($("#preset").value ? $("#preset").value : ""), priority: Number($("#priority").value || 0), tags };
  };
  $("#dry-run").addEventListener("click", async () => {
    try {
      const d = await api("POST", "/v1/experiments", { body: body(), params: { dry_run: "true" } });
      clearError();
      $("#submit-result").textContent = d.fits_now ? `fits now on ${d.placement.join(", ")}`
        : d.fits_ever ? `valid; it would wait: ${d.reason}` : `never fits: ${d.reason}`;
    } catch (err) {
      showError(err);
    }
  });
  $("#submit-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    $("#submit").disabled = true;
    try {
      const job = await api("POST", "/v1/experiments", { body: body() });
      clearError();
      location.hash = `#/job/${job.id}`;
    } catch (err) {
      showError(err);
    } finally {
      $("#submit").disabled = false;
    }
  });
}

// ---- compare: several experiments' curves on one chart -------------------------------------------

async function comparePage(page, _parts, query) {
  const ids = new Set((query.get("ids") || "").split(",").map((s) => s.trim()).filter(Boolean));
  const list = await api("GET", "/v1/experiments", { params: { limit: 100 } });
  if (page.dead) return;
  put(page.el, html`
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
        ${j.name || j.id} <span class="muted small">${j.id} · ${j.state}</span></label>`)}</div></section>`);
  const names = new Map(list.items.map((j) => [j.id, j]));
  let chart = null;
  let data = new Map(); // id -> metrics view
  const draw = () => {
    const metric = $("#metric").value;
    const chosen = [...ids].filter((id) => data.has(id));
    destroy(chart);
    delete window.tlab.charts.compare;
    $("#compare-chart").innerHTML = "";
    chart = lineChart($("#compare-chart"), {
      yLabel: metric, height: 320,
      series: chosen.map((id, i) => ({ label: names.get(id)?.name || id, color: PALETTE[i % PALETTE.length] })),
    });
    window.tlab.charts.compare = chart;
    chart.setData(aligned(chosen.map((id) => new Map(data.get(id).points.filter((p) => p[metric] !== undefined)
      .map((p) => [p.epoch, p[metric]])))));
    put($("#compare-body"), chosen.map((id, i) => {
      const m = data.get(id);
      const last = m.points.at(-1) || {};
      const accs = m.points.map((p) => p.test_acc).filter((a) => a !== undefined);
      const j = names.get(id) || { id, kind: "experiment" };
      return html`<tr><td><span class="swatch" style="background:${PALETTE[i % PALETTE.length]}"></span>${jobLink(j)}</td>
        <td>${badge(j.state || "?")}</td><td>${m.total_points}</td><td class="mono">${num(last.train_loss)}</td>
        <td class="mono">${num(last.test_loss)}</td><td class="mono">${accs.length ? num(Math.max(...accs)) : "–"}</td>
        <td>${m.teleports.length}</td></tr>`;
    }));
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

// ---- sweeps ----------------------------------------------------------------------------------

async function sweepsPage(page) {
  put(page.el, html`<section class="card"><h2>Sweeps</h2>
    <p class="muted small">Submit one with <code>tlab sweep SPEC --space SPACE.yaml</code> or <code>POST /v1/sweeps</code>.</p>
    <table><thead><tr><th>name</th><th>id</th><th>owner</th><th>state</th><th>pos</th><th>why pending / outcome</th>
      <th>created</th></tr></thead><tbody id="sweeps-body"></tbody></table></section>`);
  await page.every(POLL_MS, async () => {
    const list = await api("GET", "/v1/sweeps", { params: { limit: 100 } });
    if (page.dead) return;
    put($("#sweeps-body"), list.items.length ? list.items.map((j) => html`<tr><td>${jobLink(j)}</td>
      <td class="mono small">${j.id}</td><td>${j.owner}</td><td>${badge(j.state)}</td><td>${j.queue_position ?? ""}</td>
      <td class="reason">${j.state === "queued" ? j.pending_reason : j.failure_reason || ""}</td>
      <td class="small">${ago(j.created_at)}</td></tr>`) : html`<tr><td colspan="7" class="muted">no sweeps yet</td></tr>`);
  });
}

async function sweepPage(page, [id]) {
  put(page.el, html`
    <section class="card">
      <div class="row"><h2 id="sweep-title">${id}</h2><span id="sweep-state"></span><span id="live" class="small muted"></span>
        <span class="grow"></span><button id="cancel" type="button" class="danger" hidden>Cancel sweep</button></div>
      <p id="sweep-best" class="small"></p>
    </section>
    <section class="card"><h3 id="sweep-metric">Trials</h3><div id="sweep-chart" class="chart"></div>
      <p id="no-curves" class="muted small">no trial has reported an epoch yet</p>
      <table><thead><tr><th>trial</th><th>config</th><th>state</th><th>epochs</th><th>last</th><th>best</th>
        <th>scheduler</th></tr></thead><tbody id="trials-body"></tbody></table></section>`);
  let sweep = null;
  const curves = new Map(); // trial -> Map(epoch -> record)
  let chart = null;
  let drawnTrials = "";
  const metricOf = () => sweep?.metric || "test_loss";
  const redraw = throttle(() => {
    if (page.dead || !curves.size) return;
    $("#no-curves").hidden = true;
    const trials = [...curves.keys()].sort();
    const metric = metricOf();
    if (trials.join() !== drawnTrials) { // a new trial: rebuild with one series each
      destroy(chart);
      $("#sweep-chart").innerHTML = "";
      chart = lineChart($("#sweep-chart"), {
        yLabel: metric, height: 300,
        series: trials.map((t, i) => ({ label: t, color: PALETTE[i % PALETTE.length] })),
      });
      window.tlab.charts.sweep = chart;
      drawnTrials = trials.join();
    }
    chart.setData(aligned(trials.map((t) => new Map([...curves.get(t).values()]
      .filter((r) => r[metric] !== undefined).map((r) => [r.epoch, r[metric]])))));
  });
  page.on(() => { destroy(chart); delete window.tlab.charts.sweep; });
  const refresh = async () => {
    const v = await api("GET", `/v1/sweeps/${id}`);
    if (page.dead) return false;
    sweep = v;
    $("#sweep-title").textContent = v.job.name || id;
    put($("#sweep-state"), badge(v.job.state));
    $("#cancel").hidden = TERMINAL.has(v.job.state);
    $("#sweep-metric").textContent = `Trials: ${v.metric} (${v.mode})`;
    const cfg = (c) => Object.entries(c).map(([k, x]) => `${k}=${num(x)}`).join("  ");
    put($("#sweep-best"), v.best ? html`${TERMINAL.has(v.job.state) ? "best" : "best so far"}: <b>${v.best.trial}</b> ${v.metric}=${num(v.best.best)} with ${cfg(v.best.config)}`
      : v.job.state === "queued" ? html`queued: ${v.job.pending_reason || ""}` : v.job.failure_reason || "");
    put($("#trials-body"), v.trials.length ? v.trials.map((t) => html`<tr class="${v.best?.trial === t.trial ? "best" : ""}">
      <td class="mono">${t.trial}</td><td class="small mono">${cfg(t.config)}</td><td>${t.state}</td><td>${t.epochs}</td>
      <td class="mono">${num(t.last)}</td><td class="mono">${num(t.best)}</td><td>${t.stopped_early ? "stopped early" : t.perturbed ? `PBT moves: ${t.perturbed}` : ""}</td></tr>`)
      : html`<tr><td colspan="7" class="muted">no trial has reported yet</td></tr>`);
    return !TERMINAL.has(v.job.state);
  };
  cancelButton(page, `/v1/sweeps/${id}`, "Cancel sweep", refresh);
  await refresh().catch(showError);
  if (page.dead || !sweep) return;
  page.every(POLL_MS, refresh);
  page.stream(`/v1/sweeps/${id}/events`, {
    metric: (m) => {
      const t = m.trial || "(driver)";
      if (!curves.has(t)) curves.set(t, new Map());
      curves.get(t).set(m.epoch, m);
      redraw();
    },
    end: (e) => {
      $("#live").textContent = `ended: ${e.state}`;
      $("#live").classList.remove("on");
      refresh().catch(showError);
    },
    state: (st) => {
      if ($("#live").textContent.startsWith("ended")) return;
      $("#live").textContent = st === "live" ? "● live" : st;
      $("#live").classList.toggle("on", st === "live");
    },
  });
}

// ---- cluster ---------------------------------------------------------------------------------

async function clusterPage(page) {
  put(page.el, html`<section class="card"><h2>Cluster</h2><p id="cluster-summary"></p>
    <table><thead><tr><th>node</th><th>alive</th><th>CPUs free / total</th><th></th><th>GPUs free / total</th><th></th>
      </tr></thead><tbody id="nodes-body"></tbody></table>
    <h3>Running</h3><p id="running"></p></section>`);
  const meter = (free, total) => html`<div class="bar" title="${num(total - free)} of ${num(total)} in use">
    <div class="fill running" style="width:${total ? ((100 * (total - free)) / total).toFixed(1) : 0}%"></div></div>`;
  await page.every(POLL_MS, async () => {
    const c = await api("GET", "/v1/cluster");
    if (page.dead) return;
    put($("#cluster-summary"), html`${c.nodes.length} node(s) · CPUs <b>${num(c.cpus_free)}</b> free of ${num(c.cpus_total)} ·
      GPUs <b>${num(c.gpus_free)}</b> free of ${num(c.gpus_total)} ·
      ${c.cpus_outside || c.gpus_outside ? html`<span id="outside" title="other Ray work on the cluster, or a finished job's workers still being released">Ray holds ${num(c.cpus_outside)} CPUs, ${num(c.gpus_outside)} GPUs beyond Teleport Lab's jobs</span> · ` : ""}
      scheduler ${c.scheduler_alive ? html`<span class="badge state-succeeded">alive</span>` : html`<span class="badge state-failed">not reporting</span>`}`);
    put($("#nodes-body"), c.nodes.length ? c.nodes.map((n) => html`<tr><td class="mono">${n.id}</td><td>${n.alive ? "yes" : "no"}</td>
      <td>${num(n.cpus_free)} / ${num(n.cpus_total)}</td><td>${meter(n.cpus_free, n.cpus_total)}</td>
      <td>${num(n.gpus_free)} / ${num(n.gpus_total)}</td><td>${n.gpus_total ? meter(n.gpus_free, n.gpus_total) : ""}</td></tr>`)
      : html`<tr><td colspan="6" class="muted">no nodes known yet: has the scheduler started?</td></tr>`);
    put($("#running"), c.running_jobs.length ? c.running_jobs.map((j) => html`<a class="chip" href="#/job/${j}">${j}</a> `)
      : html`<span class="muted">nothing is running</span>`);
  });
}

// ---- the router ------------------------------------------------------------------------------

const PAGES = {
  signin: signinPage, jobs: jobsPage, job: jobPage, submit: submitPage, compare: comparePage,
  sweeps: sweepsPage, sweep: sweepPage, cluster: clusterPage,
};
let current = null;

async function route() {
  current?.close();
  clearError();
  const [path, q] = location.hash.replace(/^#/, "").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  const name = PAGES[parts[0]] ? parts[0] : "jobs";
  if (!token.get() && name !== "signin") {
    sessionStorage.setItem("tlab.next", location.hash);
    location.hash = "#/signin";
    return;
  }
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.dataset.route === name);
  const el = $("#view");
  el.innerHTML = "";
  const page = new Page(el);
  current = page;
  try {
    await PAGES[name](page, parts.slice(1), new URLSearchParams(q || ""));
  } catch (err) {
    if (!page.dead) showError(err);
  }
}

$("#signout").addEventListener("click", () => {
  token.clear();
  signedOut();
  location.hash = "#/signin";
});
$("#error").addEventListener("click", () => clearError());
window.addEventListener("hashchange", route);
if (token.get()) whoami().catch(showError);
route();
