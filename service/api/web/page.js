// What every view shares at run time: the one-line error bar, the signed-in user, and a page's lifetime
// (its timers, streams and charts end when the route changes).

import { api, ApiError, follow, token } from "./api.js";
import { destroy, lineChart } from "./charts.js";
import { $ } from "./dom.js";

// What the browser test (and a curious user's console) can look at.
window.tlab = { charts: {}, me: null };

// ---- the one-line error bar ------------------------------------------------------------------

let errorOwner = null;

export function showError(err, owner = null) {
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

export function clearError(owner = undefined) {
  if (owner !== undefined && owner !== errorOwner) return;
  $("#error").hidden = true;
  errorOwner = null;
}

// ---- the signed-in user ----------------------------------------------------------------------

export async function whoami() {
  window.tlab.me = await api("GET", "/v1/me");
  const me = window.tlab.me;
  const cap = me.quotas.max_storage_gb;
  const stored = ` · ${(me.storage_used_gb ?? 0).toFixed(2)} GB stored${cap ? ` of ${cap} GB` : ""}`;
  $("#who").textContent = `${me.name} (${me.role})${stored}`;
  $("#signout").hidden = false;
  return me;
}

export function signedOut() {
  window.tlab.me = null;
  $("#who").textContent = "";
  $("#signout").hidden = true;
}

// ---- a page's lifetime -----------------------------------------------------------------------

export class Page {
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

// The "● live / ended: STATE" indicator a streamed page keeps in #live; false once the stream has ended.
export function liveState(st) {
  const live = $("#live");
  if (live.textContent.startsWith("ended")) return false;
  live.textContent = st === "live" ? "● live" : st === "reconnecting" ? "reconnecting…" : "stream closed";
  live.classList.toggle("on", st === "live");
  return true;
}

export function liveEnded(state) {
  $("#live").textContent = `ended: ${state}`;
  $("#live").classList.remove("on");
}

// A button that acts on a second click within 5 s (a stray click never cancels a day of training, nor deletes it).
function twoClicks(page, btn, label, [armedText, busyText], send, after) {
  let armed = null;
  const disarm = () => { armed = null; btn.textContent = label; btn.classList.remove("armed"); };
  btn.addEventListener("click", async () => {
    if (!armed) {
      btn.textContent = armedText;
      btn.classList.add("armed");
      armed = setTimeout(disarm, 5000);
      return;
    }
    clearTimeout(armed);
    armed = null;
    btn.disabled = true;
    btn.textContent = busyText;
    try {
      await send();
      await after();
    } catch (err) {
      showError(err);
      btn.disabled = false;
      disarm();
    }
  });
  page.on(() => clearTimeout(armed));
}

// The page's #cancel button: POST `path`/cancel on the second click.
export function cancelButton(page, path, label, after) {
  twoClicks(page, $("#cancel", page.el), label, ["Click again to cancel", "Cancelling…"],
    () => api("POST", `${path}/cancel`), after);
}

// The page's #delete button (an ended job): DELETE `path` on the second click; everything it left goes.
export function deleteButton(page, path, label, after) {
  twoClicks(page, $("#delete", page.el), label, ["Click again: delete it and its files", "Deleting…"],
    () => api("DELETE", path, { text: true }), after);
}
