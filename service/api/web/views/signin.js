// #/signin: paste a token; it is checked with GET /v1/me before the page moves on.

import { ApiError, token } from "../api.js";
import { $, html, put } from "../dom.js";
import { clearError, showError, signedOut, whoami } from "../page.js";

export async function signinPage(page) {
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
