// A finished run's artifacts, as a table of links: a job's own (/v1/experiments/ID) or a sweep's best trial's
// (/v1/sweeps/ID). `tlab pull ID` fetches the same files.

import { api, ApiError, token, url } from "../api.js";
import { $, html, put } from "../dom.js";
import { showError } from "../page.js";

const size = (n) => (n < 1024 ? `${n} B` : n < 1 << 20 ? `${(n / 1024).toFixed(1)} KiB` : `${(n / (1 << 20)).toFixed(1)} MiB`);

// The card, empty until showArtifacts fills it; `what` says which files these are.
export const artifactsCard = (id, what) => html`<section class="card"><div class="row"><h3>Artifacts</h3>
  <span class="small muted">${what}; <code>tlab pull ${id}</code> fetches them all</span></div>
  <div id="artifacts" class="muted small">written when it ends</div></section>`;

// A link cannot carry the bearer token: fetch the file with it, then save the blob under its name.
async function download(base, name) {
  const res = await fetch(url(`${base}/artifacts/${name.split("/").map(encodeURIComponent).join("/")}`),
    { headers: { Authorization: `Bearer ${token.get()}` } });
  if (!res.ok) throw new ApiError(res.status, `${res.status}: ${name}: ${(await res.json().catch(() => ({}))).detail || res.statusText}`);
  const href = URL.createObjectURL(await res.blob());
  const a = Object.assign(document.createElement("a"), { href, download: name.split("/").pop() });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(href), 60_000);
}

// base: "/v1/experiments/ID" or "/v1/sweeps/ID".
export async function showArtifacts(base) {
  const { items } = await api("GET", `${base}/artifacts`);
  const box = $("#artifacts");
  if (!box || !items.length) return;
  box.className = "";
  put(box, html`<table class="artifacts"><tr><th>name</th><th>size</th><th>sha256</th></tr>${items.map((a) => html`
    <tr><td><a href="#" data-name="${a.name}">${a.name}</a></td><td>${size(a.bytes)}</td>
    <td class="small muted" title="${a.sha256 || ""} ${a.sha256_note || ""}">${a.sha256 ? `${a.sha256.slice(0, 16)}…` : "–"}</td></tr>`)}</table>`);
  box.onclick = (e) => {
    const name = e.target.closest("a[data-name]")?.dataset.name;
    if (!name) return;
    e.preventDefault();
    download(base, name).catch(showError);
  };
}
