// The coli-kv session page: the sessions list (refreshed), a chat pane streaming from
// POST /v1/chat/completions, and fork / suspend / delete per session. Server text is only ever
// rendered with textContent / Text nodes.
"use strict";

const KEY_STORE = "coli.apiKey";
const MESSAGES_STORE = "coli.messages.";
const SELECTED_STORE = "coli.selected";
const REFRESH_MS = 3000;
const ID_RE = /^[A-Za-z0-9][A-Za-z0-9._-]*$/;

const $ = (id) => document.getElementById(id);
const state = {
  model: null,       // the id GET /v1/models names
  sessions: [],      // the last GET /v1/sessions data
  drafts: new Set(), // ids chosen here that the server does not have yet (created by their first turn)
  selected: null,
  abort: null,       // the AbortController of the turn streaming now
  keyWait: null,     // the promise of the open API-key dialog
  armedDelete: null, // the session whose delete button asks "sure?"
};

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function say(text, isError = false) {
  const status = $("status");
  status.textContent = text;
  status.classList.toggle("error", isError);
  clearTimeout(say.timer);
  if (text) say.timer = setTimeout(() => say(""), isError ? 8000 : 3000);
}

// ---- the API key ------------------------------------------------------------------------------
function askKey(reason) {
  if (!state.keyWait) {
    const dialog = $("key-dialog");
    $("key-reason").textContent = reason;
    $("key-input").value = "";
    state.keyWait = new Promise((resolve) => {
      dialog.addEventListener("close", () => {
        const key = $("key-input").value.trim();
        if (key) sessionStorage.setItem(KEY_STORE, key);
        state.keyWait = null;
        resolve();
      }, { once: true });
    });
    dialog.showModal();
    $("key-input").focus();
  }
  return state.keyWait;
}

// ---- the API ----------------------------------------------------------------------------------
async function errorText(res) {
  try {
    const body = await res.json();
    if (body && body.error && body.error.message) return `${res.status}: ${body.error.message}`;
  } catch (_) { /* not JSON: the status says enough */ }
  return `${res.status} ${res.statusText}`;
}

// fetch `path`; a 401 asks for the key and tries again (a refused request did nothing)
async function api(method, path, body, signal) {
  for (;;) {
    const headers = {};
    const key = sessionStorage.getItem(KEY_STORE);
    if (key) headers.Authorization = `Bearer ${key}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const res = await fetch(path, { method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body) });
    if (res.status === 401) {
      await askKey(key ? "The server refused this key: enter it again." : "This server needs an API key.");
      continue;
    }
    if (!res.ok) throw new Error(await errorText(res));
    return res;
  }
}

const sessionPath = (sid, action = "") => `/v1/sessions/${encodeURIComponent(sid)}${action}`;

// ---- messages kept by this tab (the sessions API returns token ids, not messages) ---------------
function loadMessages(sid) {
  try { return JSON.parse(sessionStorage.getItem(MESSAGES_STORE + sid)) || null; } catch (_) { return null; }
}
function saveMessages(sid, messages) { sessionStorage.setItem(MESSAGES_STORE + sid, JSON.stringify(messages)); }
function dropMessages(sid) { sessionStorage.removeItem(MESSAGES_STORE + sid); }

// ---- formatting -------------------------------------------------------------------------------
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${i === 0 ? n : n.toFixed(n < 10 ? 1 : 0)} ${units[i]}`;
}
function ago(iso) {
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (!Number.isFinite(s)) return "?";
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return new Date(iso).toLocaleDateString();
}
const findSession = (sid) => state.sessions.find((s) => s.id === sid);

// ---- the sessions list ------------------------------------------------------------------------
async function refresh() {
  const res = await api("GET", "/v1/sessions");
  state.sessions = (await res.json()).data;
  for (const s of state.sessions) state.drafts.delete(s.id);
  renderList();
  renderHead();
}

function renderList() {
  const list = $("session-list");
  const items = [...[...state.drafts].map((id) => ({ id, draft: true })), ...state.sessions];
  const shown = JSON.stringify([items, state.selected, state.armedDelete, Math.floor(Date.now() / 10000)]);
  if (shown === list.dataset.shown) return;  // unchanged: keep the buttons under the pointer
  list.dataset.shown = shown;
  list.replaceChildren(...items.map(sessionItem));
  $("empty-list").hidden = items.length > 0;
}

function sessionItem(s) {
  const li = el("li", "session");
  li.dataset.id = s.id;
  li.classList.toggle("selected", s.id === state.selected);
  li.addEventListener("click", () => select(s.id));
  const top = el("div", "row");
  top.append(el("span", "sid", s.id));
  top.append(el("span", `badge ${s.draft ? "draft" : s.state}`, s.draft ? "new" : s.state));
  li.append(top);
  if (s.draft) {
    li.append(el("div", "facts", "created by its first message"));
    return li;
  }
  const facts = el("div", "facts");
  const tokens = el("span", "tokens", String(s.tokens));
  facts.append(tokens, ` tok · ${bytes(s.bytes)} · ${s.kv_dtype} · `);
  const when = el("span", "when", ago(s.last_use));
  when.title = s.last_use;
  facts.append(when);
  li.append(facts);
  const actions = el("div", "actions");
  actions.append(action("fork", () => fork(s.id)));
  const suspend = action("suspend", () => suspendSession(s.id));
  suspend.disabled = s.state === "suspended";
  actions.append(suspend, deleteButton(s.id));
  li.append(actions);
  return li;
}

function action(label, fn) {
  const button = el("button", "small", label);
  button.type = "button";
  button.addEventListener("click", (event) => { event.stopPropagation(); run(fn); });
  return button;
}

// delete asks "sure?" on its first click and acts on a second within a few seconds
function deleteButton(sid) {
  const armed = state.armedDelete === sid;
  const button = action(armed ? "sure?" : "delete", async () => {
    if (state.armedDelete === sid) {
      state.armedDelete = null;
      return remove(sid);
    }
    state.armedDelete = sid;
    renderList();
    setTimeout(() => {
      if (state.armedDelete !== sid) return;
      state.armedDelete = null;
      renderList();
    }, 4000);
  });
  button.classList.add("delete");
  button.classList.toggle("armed", armed);
  return button;
}

async function run(fn) {
  try { await fn(); } catch (err) { if (err.name !== "AbortError") say(err.message, true); }
}

async function fork(sid) {
  const taken = new Set([...state.sessions.map((s) => s.id), ...state.drafts]);
  let k = 1;
  while (taken.has(`${sid}.fork${k}`)) k += 1;
  const fresh = `${sid}.fork${k}`;
  await api("POST", sessionPath(sid, "/fork"), { new: fresh });
  const messages = loadMessages(sid);
  if (messages) saveMessages(fresh, messages);  // a whole-session fork copies the conversation
  say(`forked ${sid} into ${fresh}`);
  await refresh();
  select(fresh);
}

async function suspendSession(sid) {
  await api("POST", sessionPath(sid, "/suspend"));
  say(`suspended ${sid}`);
  await refresh();
}

async function remove(sid) {
  await api("DELETE", sessionPath(sid));
  dropMessages(sid);
  if (state.selected === sid) select(null);
  say(`deleted ${sid}`);
  await refresh();
}

function newSession(event) {
  event.preventDefault();
  const input = $("new-id");
  const stamp = new Date().toISOString().replace(/[-:]/g, "").replace("T", "-").slice(0, 15);
  const sid = input.value.trim() || `chat-${stamp}`;
  if (!ID_RE.test(sid) || sid.length > 128) {
    say("a session id is letters, digits, '.', '_' or '-', starting with a letter or digit", true);
    return;
  }
  input.value = "";
  if (!findSession(sid)) state.drafts.add(sid);
  renderList();
  select(sid);
  $("input").focus();
}

// ---- the chat pane ----------------------------------------------------------------------------
function select(sid) {
  state.selected = sid;
  if (sid) sessionStorage.setItem(SELECTED_STORE, sid);
  else sessionStorage.removeItem(SELECTED_STORE);
  renderList();
  const log = $("log");
  log.replaceChildren();
  const messages = sid ? loadMessages(sid) : null;
  for (const m of messages || []) addMessage(m.role, m.content);
  renderHead();
}

function renderHead() {
  const sid = state.selected;
  const s = sid ? findSession(sid) : null;
  $("chat-title").textContent = sid || "no session";
  $("chat-meta").textContent = s ? `${s.tokens} tokens · ${bytes(s.bytes)} · ${s.kv_dtype} · ${s.state}` : "";
  const note = $("log-note");
  note.textContent = !sid ? "Pick a session on the left, or start a new one."
    : s && s.tokens > 0 && !loadMessages(sid)
      ? `This session holds ${s.tokens} tokens; the API returns no messages to show. `
        + "A message sent here starts its conversation over (fork it first to keep it)."
      : "";
  note.hidden = !note.textContent;
  $("send").disabled = !sid || state.abort !== null;
}

function addMessage(role, content) {
  const box = el("div", `msg ${role}`);
  box.append(el("div", "role", role));
  const text = el("div", "text", content);
  box.append(text);
  $("log").append(box);
  box.scrollIntoView({ block: "end" });
  return text;
}

// the SSE data lines of `body`, parsed as JSON, in order (ends at [DONE])
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(event) {
  event.preventDefault();
  const sid = state.selected;
  const input = $("input");
  const content = input.value;
  if (!sid || !content.trim() || state.abort) return;
  const messages = [...(loadMessages(sid) || []), { role: "user", content }];
  input.value = "";
  addMessage("user", content);
  const text = addMessage("assistant", "");
  text.classList.add("streaming");
  state.abort = new AbortController();
  $("stop").hidden = false;
  renderHead();
  let reply = "";
  try {
    const body = { model: state.model, messages, stream: true, session: sid,
                   max_tokens: Number($("max-tokens").value) || 128 };
    const res = await api("POST", "/v1/chat/completions", body, state.abort.signal);
    for await (const chunk of sseData(res.body)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices[0];
      const piece = choice.delta && choice.delta.content;
      if (piece) {
        reply += piece;
        text.append(piece);  // one Text node per streamed piece
      }
      if (choice.finish_reason) text.dataset.finish = choice.finish_reason;
    }
  } catch (err) {
    if (err.name !== "AbortError") {
      text.parentNode.classList.add("failed");
      say(err.message, true);
    }
  } finally {
    text.classList.remove("streaming");
    state.abort = null;
    $("stop").hidden = true;
  }
  if (reply || text.dataset.finish) saveMessages(sid, [...messages, { role: "assistant", content: reply }]);
  await run(refresh);
}

// ---- start ------------------------------------------------------------------------------------
async function refreshLoop() {
  if (!document.hidden && !state.keyWait) await run(refresh);
  setTimeout(refreshLoop, REFRESH_MS);
}

async function start() {
  $("key-button").addEventListener("click", () => askKey("Enter the API key for this server.").then(() => run(refresh)));
  $("new-form").addEventListener("submit", newSession);
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  const last = sessionStorage.getItem(SELECTED_STORE);
  select(null);
  await run(async () => {
    const res = await api("GET", "/v1/models");
    state.model = (await res.json()).data[0].id;
    $("model").textContent = state.model;
    await refresh();
  });
  if (last && findSession(last)) select(last);  // a reload keeps the open session
  setTimeout(refreshLoop, REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", start);
