"""The page's stylesheet and script, inlined into it: the page loads nothing from anywhere. The
script swaps in the live part, sends the token and drives the cancel buttons."""

from __future__ import annotations

import json

__all__ = ["POLL_MS", "PRIVATE_NOTE", "SCRIPT", "STYLE"]

# Milliseconds between two refreshes of a visible page: a trial takes seconds, a person looks.
POLL_MS = 2000

STYLE = """
:root { color-scheme: light dark; --fg: #1d232a; --muted: #5d6873; --bg: #f6f7f9;
  --card: #fff; --line: #d9dee4; --accent: #2f6fdb; --ok: #1f7a3f; --warn: #9a5b00;
  --bad: #b3261e; }
@media (prefers-color-scheme: dark) { :root { --fg: #e6e9ec; --muted: #9aa5b1;
  --bg: #15181c; --card: #1e2228; --line: #343b44; --accent: #7aa7ff; --ok: #6fcf8e;
  --warn: #e5b25d; --bad: #ff8a80; } }
* { box-sizing: border-box; }
body { margin: 0; font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif;
  color: var(--fg); background: var(--bg); }
header { display: flex; flex-wrap: wrap; gap: .5rem 1.5rem; align-items: center;
  justify-content: space-between; padding: .75rem 1rem; background: var(--card);
  border-bottom: 1px solid var(--line); }
header h1 { font-size: 1.15rem; margin: 0; }
.muted, .when { color: var(--muted); font-size: .85rem; }
.status { margin: .9rem 0 0; color: var(--muted); }
main { padding: 0 1rem 2rem; max-width: 80rem; margin: 0 auto; }
h2 { font-size: 1.05rem; margin: 1.5rem 0 .5rem; }
h2 .count { color: var(--muted); font-weight: normal; }
a { color: var(--accent); }
.scroll { overflow-x: auto; background: var(--card); border: 1px solid var(--line);
  border-radius: 6px; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .45rem .6rem; border-bottom: 1px solid var(--line);
  vertical-align: top; }
tr:last-child td { border-bottom: none; }
th { font-size: .8rem; color: var(--muted); font-weight: 600; white-space: nowrap; }
td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
.name { font-weight: 600; overflow-wrap: break-word; }
code { font-size: .85em; overflow-wrap: break-word; }
progress { width: 100%; height: .7rem; accent-color: var(--accent); }
.cards { display: grid; gap: .75rem; grid-template-columns: repeat(auto-fill, minmax(min(22rem, 100%), 1fr)); }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 6px;
  padding: .75rem .9rem; }
.card h3 { margin: 0 0 .25rem; font-size: 1rem; overflow-wrap: anywhere; }
.card dl { display: grid; grid-template-columns: max-content 1fr; gap: .2rem .75rem;
  margin: .5rem 0; }
.card dt { color: var(--muted); font-size: .85rem; }
.card dd { margin: 0; overflow-wrap: anywhere; }
.badge { display: inline-block; padding: 0 .45rem; border-radius: 1rem; font-size: .78rem;
  border: 1px solid currentColor; white-space: nowrap; }
.running, .done, .ok { color: var(--ok); }
.paused, .queued, .warn { color: var(--warn); }
.failed, .bad { color: var(--bad); }
.cancelled { color: var(--muted); }
.chips { display: flex; flex-wrap: wrap; gap: .3rem; }
.chip { background: var(--bg); border: 1px solid var(--line); border-radius: 4px;
  padding: 0 .35rem; font-size: .85rem; white-space: nowrap; }
.empty { color: var(--muted); padding: .6rem; background: var(--card);
  border: 1px dashed var(--line); border-radius: 6px; }
button { font: inherit; font-size: .85rem; padding: .2rem .6rem; border-radius: 4px;
  border: 1px solid var(--line); background: var(--bg); color: var(--fg); cursor: pointer; }
button.cancel { color: var(--bad); border-color: var(--bad); }
button.confirm { background: var(--bad); color: #fff; }
button:disabled { opacity: .5; cursor: not-allowed; }
form.token { display: flex; gap: .4rem; align-items: center; flex-wrap: wrap; }
form.token input { font: inherit; padding: .2rem .4rem; width: 12rem; max-width: 50vw; }
#live { font-size: .85rem; }
#notice:empty { display: none; }
#notice { margin: .75rem 0 0; padding: .5rem .75rem; border-radius: 6px;
  background: var(--card); border: 1px solid var(--line); }
@media (max-width: 640px) {
  body { font-size: 14px; }
  .wide { display: none; }
  th, td { padding: .4rem .45rem; }
  .muted { overflow-wrap: anywhere; }
  header { padding: .6rem .75rem; }
  main { padding: 0 .6rem 1.5rem; }
}
"""

# What a private service's page shows until its token is given.
PRIVATE_NOTE = (
    '<p class="empty">This service is private: give its token above to see its devices and '
    "studies.</p>"
)

SCRIPT = """
(() => {
  "use strict";
  const KEY = "autotune-token";
  const POLL = __POLL_MS__;
  const store = window.sessionStorage;
  // 1. A token handed over in the address (#token=... never reaches the server; a ?token=...
  //    does, and the service's logs mask it): keep it for this tab, take it out of the address.
  const inUrl = (part) => new URLSearchParams(part).get("token");
  const given = inUrl(location.hash.slice(1)) || inUrl(location.search);
  if (given) {
    store.setItem(KEY, given.trim());
    history.replaceState(null, "", location.pathname);
  }
  const token = () => store.getItem(KEY) || "";
  const auth = () => (token() ? { Authorization: "Bearer " + token() } : {});
  const main = document.getElementById("live-main");
  const live = document.getElementById("live");
  const notice = document.getElementById("notice");
  const needsToken = document.body.dataset.tokenRequired === "true";
  // A private service shows nothing without its token; given it, the service sets a view
  // cookie (reading only) so that the report and best.json links read too.
  const isPrivate = document.body.dataset.private === "true";
  const hidden = __PRIVATE_NOTE__;
  // One call at a time, in order: a Forget clicked while the page's opening call is in flight
  // ends the view cookie after that call sets it, not before (the cookie outlived the token).
  let calls = Promise.resolve();
  const session = (end) => (calls = calls.catch(() => {}).then(() => fetch(
    end ? "page/session/end" : "page/session", { method: "POST", headers: end ? {} : auth() })));
  // Bumped when the token is given or forgotten: a fetch begun before then is not shown.
  let epoch = 0;
  let pending = "", pendingUntil = 0, timer = 0, failures = 0;

  const say = (text, ok) => { notice.textContent = text; notice.className = ok ? "ok" : "bad"; };
  const detail = async (r) => {
    try { return (await r.json()).detail || "HTTP " + r.status; } catch { return "HTTP " + r.status; }
  };
  // 2. The cancel buttons: usable with a token (or where the service needs none); the one
  //    waiting for its confirming click keeps waiting across a refresh.
  const decorate = () => {
    const state = document.getElementById("token-state");
    if (state) state.textContent = token() ? "token set for this tab" : "no token: read only";
    for (const b of main.querySelectorAll("button[data-cancel]")) {
      if (needsToken && !token()) {
        b.disabled = true;
        b.title = "give the service's token above to cancel";
      } else if (b.dataset.cancel === pending && Date.now() < pendingUntil) {
        b.textContent = "Really cancel?";
        b.classList.add("confirm");
      }
    }
  };
  // 3. The live part, fetched again and swapped in; slower while the service does not answer.
  const refresh = async () => {
    clearTimeout(timer);
    if (!document.hidden) {
      const mine = epoch;
      try {
        const r = await fetch("page/live", { headers: auth(), cache: "no-store" });
        if (mine !== epoch) return;  // the token changed meanwhile: a newer refresh shows it
        if (r.status === 401 && isPrivate) main.innerHTML = hidden;
        if (!r.ok) throw new Error(await detail(r));
        const text = await r.text();
        if (mine !== epoch) return;
        main.innerHTML = text;
        failures = 0;
        live.textContent = "live, updated " + new Date().toLocaleTimeString();
        live.className = "ok";
      } catch (e) {
        failures += 1;
        live.textContent = "not updating (" + e.message + "), trying again";
        live.className = "bad";
      }
      decorate();
    }
    timer = setTimeout(refresh, failures ? Math.min(30000, POLL * 2 ** failures) : POLL);
  };
  main.addEventListener("click", async (ev) => {
    const b = ev.target.closest("button[data-cancel]");
    if (!b || b.disabled) return;
    const name = b.dataset.cancel;
    if (name !== pending || Date.now() > pendingUntil) {
      pending = name;
      pendingUntil = Date.now() + 5000;
      decorate();
      return;
    }
    pending = "";
    b.disabled = true;
    b.textContent = "Cancelling...";
    const r = await fetch("studies/" + encodeURIComponent(name) + "/cancel",
                          { method: "POST", headers: auth() });
    say(r.ok ? name + ": " + (await r.json()).message : name + ": " + (await detail(r)), r.ok);
    refresh();
  });
  const form = document.getElementById("token-form");
  if (form) {
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const field = document.getElementById("token");
      epoch += 1;
      if (field.value.trim()) store.setItem(KEY, field.value.trim());
      field.value = "";
      if (isPrivate) await session(false);
      refresh();
    });
    document.getElementById("forget").addEventListener("click", async () => {
      epoch += 1;
      store.removeItem(KEY);
      if (isPrivate) {
        await session(true);
        epoch += 1;  // (a refresh begun before the cookie ended may still have read with it)
        main.innerHTML = hidden;
      }
      refresh();
    });
  }
  document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
  decorate();
  if (isPrivate && token()) session(false).then(refresh);
  else timer = setTimeout(refresh, POLL);
})();
""".replace("__POLL_MS__", str(POLL_MS)).replace("__PRIVATE_NOTE__", json.dumps(PRIVATE_NOTE))
