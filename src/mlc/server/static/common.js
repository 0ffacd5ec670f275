// Shared by every page: the API key (kept in this tab's sessionStorage only), authenticated fetches that ask for
// the key on a 401, the server status in the header, and number formatting.
"use strict";
window.MLC = window.MLC || {};

(function (MLC) {
  const KEY = "mlc.apiKey";
  localStorage.removeItem("mlc_api_key"); // an older page kept the key here; it belongs to the session only

  MLC.$ = (id) => document.getElementById(id);
  MLC.key = () => sessionStorage.getItem(KEY) || "";

  MLC.headers = function (extra) {
    const h = Object.assign({}, extra || {});
    if (MLC.key()) h["Authorization"] = "Bearer " + MLC.key();
    return h;
  };

  let dialog = null, pending = null, declined = false; // declined: do not ask again until the user opens the dialog
  function buildDialog() {
    dialog = document.createElement("dialog");
    dialog.id = "key-dialog";
    dialog.setAttribute("aria-labelledby", "key-title");
    dialog.innerHTML =
      '<form method="dialog" id="key-form"><h2 id="key-title">API key</h2>' +
      '<p class="muted" id="key-why">This server needs an API key.</p>' +
      '<label class="field" for="key-input">Key (kept in this browser tab only)' +
      '<input id="key-input" type="password" autocomplete="off" spellcheck="false"></label>' +
      '<div class="actions"><button type="button" class="secondary" id="key-clear">Forget key</button>' +
      '<button type="button" class="secondary" id="key-cancel">Cancel</button>' +
      '<button type="submit" id="key-save">Use key</button></div></form>';
    document.body.appendChild(dialog);
    const finish = (ok) => {
      declined = !ok;
      if (dialog.open) dialog.close();
      if (pending) { pending(ok); pending = null; }
    };
    dialog.querySelector("#key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const v = dialog.querySelector("#key-input").value.trim();
      if (v) sessionStorage.setItem(KEY, v); else sessionStorage.removeItem(KEY);
      finish(!!v);
      document.dispatchEvent(new CustomEvent("mlc:key"));
    });
    dialog.querySelector("#key-cancel").addEventListener("click", () => finish(false));
    dialog.querySelector("#key-clear").addEventListener("click", () => {
      sessionStorage.removeItem(KEY); dialog.querySelector("#key-input").value = ""; finish(false);
      document.dispatchEvent(new CustomEvent("mlc:key"));
    });
    dialog.addEventListener("cancel", () => finish(false));
  }

  // Resolves true once the user entered a key, false if they cancelled.
  MLC.askKey = function (why) {
    if (!dialog) buildDialog();
    if (pending) return new Promise((resolve) => { const prev = pending; pending = (ok) => { prev(ok); resolve(ok); }; });
    dialog.querySelector("#key-why").textContent = why || "This server needs an API key.";
    dialog.querySelector("#key-input").value = MLC.key();
    dialog.showModal();
    dialog.querySelector("#key-input").focus();
    return new Promise((resolve) => { pending = resolve; });
  };

  // fetch() with the key; a 401 asks for a key and retries. Throws MLC.HttpError for other failures.
  MLC.HttpError = class extends Error {
    constructor(status, message) { super(message); this.status = status; }
  };
  MLC.api = async function (path, opts) {
    opts = Object.assign({}, opts || {});
    for (;;) {
      const r = await fetch(path, Object.assign({}, opts, { headers: MLC.headers(opts.headers) }));
      if (r.status !== 401) return r;
      const body = await r.json().catch(() => ({}));
      const msg = MLC.key() ? "The key was not accepted. " : "This server runs with --api-key. ";
      if (declined || !(await MLC.askKey(msg + "Enter a key it was started with."))) {
        throw new MLC.HttpError(401, (body.error && body.error.message) || "unauthorized");
      }
    }
  };
  MLC.json = async function (path, opts) {
    const r = await MLC.api(path, opts);
    const body = await r.json().catch(() => null);
    if (!r.ok) throw new MLC.HttpError(r.status, (body && body.error && body.error.message) || "HTTP " + r.status);
    return body;
  };
  MLC.errorMessage = async function (r) {
    const body = await r.json().catch(() => ({}));
    return (body.error && body.error.message) || "HTTP " + r.status;
  };

  MLC.fmt = {
    num(x, digits) {
      if (x === null || x === undefined || !isFinite(x)) return "–";
      if (digits === undefined) digits = Math.abs(x) >= 100 ? 0 : Math.abs(x) >= 10 ? 1 : 2;
      return Number(x).toLocaleString(undefined, { minimumFractionDigits: digits, maximumFractionDigits: digits });
    },
    ms(s) { return s === null || s === undefined ? "–" : s < 1 ? Math.round(s * 1000) + " ms" : s.toFixed(2) + " s"; },
    pct(x) { return x === null || x === undefined ? "–" : (x * 100).toFixed(1) + " %"; },
    sci(x) { return x === null || x === undefined ? "–" : Number(x).toExponential(2); },
    dur(s) {
      if (s === null || s === undefined || !isFinite(s)) return "–";
      s = Math.round(s);
      if (s < 60) return s + " s";
      if (s < 3600) return Math.floor(s / 60) + " min " + String(s % 60).padStart(2, "0") + " s";
      return Math.floor(s / 3600) + " h " + String(Math.floor(s / 60) % 60).padStart(2, "0") + " min";
    },
    clock(t) { return new Date(t * 1000).toLocaleTimeString(); },
  };

  // The header's status dot: /health, and the served model's name once ready.
  MLC.watchHealth = function (onReady) {
    const dot = MLC.$("status-dot"), text = MLC.$("status-text");
    let readyOnce = false;
    async function poll() {
      try {
        const r = await fetch("/health");
        const body = await r.json();
        if (r.ok) {
          dot.className = "dot ok"; text.textContent = MLC.readyText || "ready";
          if (!readyOnce) { readyOnce = true; if (onReady) onReady(); }
        } else {
          dot.className = body.status === "loading" ? "dot wait" : "dot bad";
          text.textContent = body.status + (body.message ? ": " + body.message : "");
        }
      } catch (e) { dot.className = "dot bad"; text.textContent = "server unreachable"; }
    }
    poll();
    setInterval(poll, 5000);
  };

  document.addEventListener("DOMContentLoaded", () => {
    const btn = MLC.$("key-button");
    if (btn) btn.addEventListener("click", () => MLC.askKey("Set or forget the API key for this tab."));
  });
})(window.MLC);
