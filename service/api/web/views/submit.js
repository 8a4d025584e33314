// #/submit: a preset or a blank spec, path=value overrides on top, "Check fit" (a dry run) and Submit.

import { api } from "../api.js";
import { $, html, put } from "../dom.js";
import { clearError, showError } from "../page.js";

// "training.epochs=5" lines on top of the spec: values are JSON when they parse, text otherwise.
export function applyOverrides(spec, text) {
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

const form = (presets) => html`
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
  </section>`;

// The request body the form describes (throws a one-line error for a spec that is not JSON).
function body() {
  let spec;
  try {
    spec = JSON.parse($("#spec").value || "{}");
  } catch (err) {
    throw new Error(`spec: not valid JSON (${err.message})`);
  }
  const tags = $("#tags").value.split(",").map((t) => t.trim()).filter(Boolean);
  return { spec: applyOverrides(spec, $("#overrides").value), name: $("#name").value.trim()
    || ($("#preset").value ? $("#preset").value : ""), priority: Number($("#priority").value || 0), tags };
}

export async function submitPage(page) {
  const presets = await api("GET", "/v1/presets");
  if (page.dead) return;
  put(page.el, form(presets));
  $("#preset").addEventListener("change", () => {
    const p = presets[$("#preset").value];
    $("#spec").value = JSON.stringify(p ? p.spec : {}, null, 2);
    $("#preset-note").textContent = p ? p.note : "";
    if (p && !$("#name").value) $("#name").placeholder = $("#preset").value;
  });
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
