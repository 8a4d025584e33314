// The REST API from the browser: the token in localStorage, errors as one line with the field path.

const TOKEN_KEY = "tlab.token";

export const token = {
  get: () => localStorage.getItem(TOKEN_KEY) || "",
  set: (t) => localStorage.setItem(TOKEN_KEY, t),
  clear: () => localStorage.removeItem(TOKEN_KEY),
};

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// Relative to the page, so the dashboard also works under a proxy's path prefix.
export function url(path, params = {}) {
  const u = new URL(path.replace(/^\//, ""), document.baseURI);
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") u.searchParams.set(k, v);
  return u;
}

// The API answers errors as {"detail": "field.path: message; ...", "errors": [...]}: show `detail`.
async function errorLine(res) {
  let detail = res.statusText || "request failed";
  try {
    const body = await res.json();
    if (typeof body.detail === "string") detail = body.detail;
    else if (body.detail) detail = JSON.stringify(body.detail);
  } catch {
    // not JSON (a proxy's error page): keep the status text
  }
  return `${res.status}: ${detail}`;
}

export async function api(method, path, { body, params, text = false } = {}) {
  const headers = { Authorization: `Bearer ${token.get()}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let res;
  try {
    res = await fetch(url(path, params), {
      method, headers, body: body === undefined ? undefined : JSON.stringify(body), cache: "no-store",
    });
  } catch (err) {
    throw new ApiError(0, `cannot reach the API (${err.message}): is \`tlab up\` running?`);
  }
  if (!res.ok) throw new ApiError(res.status, await errorLine(res));
  return text ? res.text() : res.json();
}

// EventSource cannot send an Authorization header: the SSE routes take ?token= instead.
export function follow(path, handlers) {
  const es = new EventSource(url(path, { token: token.get() }));
  for (const kind of ["metric", "teleport", "status", "log", "end"]) {
    es.addEventListener(kind, (e) => {
      let data;
      try {
        data = JSON.parse(e.data);
      } catch {
        return;
      }
      if (kind === "end") es.close(); // the stream is complete; do not let EventSource reconnect
      handlers[kind]?.(data, e.lastEventId);
    });
  }
  es.onopen = () => handlers.state?.("live");
  es.onerror = () => handlers.state?.(es.readyState === EventSource.CLOSED ? "closed" : "reconnecting");
  return es;
}
