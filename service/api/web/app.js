// Teleport Lab dashboard: hash-routed pages over the REST API (no framework, no build step).
//
// #/signin  #/jobs  #/job/ID  #/submit  #/compare?ids=a,b  #/sweeps  #/sweep/ID  #/cluster
// One module per view in views/; tables poll every 2 s; a job's curves and teleport diagnostics come live
// from its SSE stream.

import { token } from "./api.js";
import { $ } from "./dom.js";
import { clearError, Page, showError, signedOut, whoami } from "./page.js";
import { clusterPage } from "./views/cluster.js";
import { comparePage } from "./views/compare.js";
import { jobPage } from "./views/job.js";
import { jobsPage } from "./views/jobs.js";
import { signinPage } from "./views/signin.js";
import { submitPage } from "./views/submit.js";
import { sweepPage, sweepsPage } from "./views/sweeps.js";

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
