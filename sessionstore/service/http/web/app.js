// The coli-kv session page: the sessions list (refreshed), a chat pane streaming from
// POST /v1/chat/completions, and fork / suspend / delete per session. A session's past messages come
// from GET /v1/sessions/{id}?messages=1 (the server's conversation file), so any session can be
// continued, whoever made it. Server text is only ever rendered with textContent / Text nodes, or
// through Markdown.render (markdown.js), which builds element and Text nodes and never parses HTML.
//
// Every turn sends the whole conversation; the server prefix-matches it against the session's
// history and truncates the session at the first token that differs. So regenerate sends the
// messages without the last reply, edit-and-resend the messages up to the edited one (later ones
// dropped), and a changed system prompt (the first message) starts the session over.
"use strict";

const KEY_STORE = "coli.apiKey";
const SELECTED_STORE = "coli.selected";
const REFRESH_MS = 3000;
const ID_RE = /^[A-Za-z0-9][A-Za-z0-9._-]*$/;
// the sessions the APIs make for themselves: a Responses chain's (chain- + 32 hex) and a
// conversation's (conv_ + 48 hex); listed apart, under their own heading
const CHAIN_RE = /^chain-[0-9a-f]{32}$/;
const CONVERSATION_RE = /^conv_[0-9a-f]{48}$/;
const madeBy = (sid) => CHAIN_RE.test(sid) ? "chain" : CONVERSATION_RE.test(sid) ? "conversation" : null;

const $ = (id) => document.getElementById(id);
const state = {
  model: null,       // the id GET /v1/models names
  sessions: [],      // the last GET /v1/sessions data
  drafts: new Set(), // ids chosen here that the server does not have yet (created by their first turn)
  selected: null,
  views: new Map(),  // id -> the server's {messages, messages_state, messages_reason, tokens} of it
  shown: [],         // the messages the log shows now
  shownKey: "[[],false]", // those messages and whether the last is a partial reply, as JSON
  loading: 0,        // a counter: the answer of an older load for the log is not rendered
  abort: null,       // the AbortController of the turn streaming now
  keyWait: null,     // the promise of the open API-key dialog
  armedDelete: null, // the session whose delete button asks "sure?"
  systemFor: null,   // the session whose system prompt the field was set from (or kept for: a draft)
  stats: new Map(),  // "sid\0index" -> {content, stats}: the figures of the replies streamed here
  listed: false,     // whether a listing has come (until then the list says nothing, or why not)
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
      $("key-button").hidden = false;  // this server wants a key: it can be changed from now on
      const asked = askKey(key ? "The server refused this key: enter it again." : "This server needs an API key.");
      renderList();  // says why the list is empty meanwhile
      await asked;
      continue;
    }
    if (!res.ok) throw new Error(await errorText(res));
    return res;
  }
}

const sessionPath = (sid, action = "") => `/v1/sessions/${encodeURIComponent(sid)}${action}`;

// ---- a session's messages, as the server has them -------------------------------------------------
// null messages: the server's conversation file does not describe the session's tokens (say why)
async function loadView(sid) {
  const res = await api("GET", `${sessionPath(sid)}?messages=1`);
  const body = await res.json();
  return { messages: body.messages, state: body.messages_state, reason: body.messages_reason,
           tokens: body.tokens };
}

// load the selected session's messages and show them (unless the log already shows exactly them)
async function showView(sid) {
  const ticket = ++state.loading;
  const view = await loadView(sid);
  if (ticket !== state.loading || state.selected !== sid || state.abort) return;  // stale: neither kept nor shown
  state.views.set(sid, view);  // what the next turn sends as the history
  if (state.systemFor !== sid) {  // a newly selected session: the field shows its system prompt
    state.systemFor = sid;
    Settings.showSystemOf(view.messages);
  }
  if (logKey(view) !== state.shownKey) renderLog(view);
  renderHead();
}

const logKey = (view) => JSON.stringify([(view && view.messages) || [], Boolean(view && view.state === "turn_partial")]);

function renderLog(view) {
  $("log").replaceChildren();
  state.shown = (view && view.messages) || [];
  state.shownKey = logKey(view);
  state.shown.forEach((m, i) => {
    const box = addMessage(m.role, m.content, i);
    if (view.state === "turn_partial" && i === state.shown.length - 1) box.classList.add("partial");
  });
}

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

// what a session stored (its committed records), with what its files take on disk in the tooltip
function size(s) {
  const stored = s.stored_bytes === null || s.stored_bytes === undefined ? s.bytes : s.stored_bytes;
  const node = el("span", "size", bytes(stored));
  node.title = `${bytes(stored)} stored; its files take ${bytes(s.bytes)} on disk (with room kept for the next tokens)`;
  return node;
}

// ---- the sessions list ------------------------------------------------------------------------
const LIST_PAGES = 10;  // pages of 1,000 the list loads at most (the server pages its session catalogue)

async function listSessions() {
  // every session (up to LIST_PAGES pages), page after page: GET /v1/sessions?limit=1000&after=ID
  const all = [];
  let after = null;
  for (let page = 0; page < LIST_PAGES; page++) {
    const query = new URLSearchParams({ limit: "1000" });
    if (after !== null) query.set("after", after);
    const body = await (await api("GET", `/v1/sessions?${query}`)).json();
    all.push(...body.data);
    if (!body.has_more || !body.data.length) break;
    after = body.last_id;
  }
  return all;
}

async function refresh() {
  state.sessions = await listSessions();
  state.listed = true;
  for (const s of state.sessions) state.drafts.delete(s.id);
  renderList();
  renderHead();
  const sid = state.selected;
  const s = sid && findSession(sid);
  const view = sid && state.views.get(sid);
  if (s && !state.abort && (!view || s.tokens !== view.tokens)) await showView(sid);  // changed, or not loaded
}

function renderList() {
  const list = $("session-list");
  const items = [...[...state.drafts].map((id) => ({ id, draft: true })), ...state.sessions];
  const mine = items.filter((s) => !madeBy(s.id));
  const made = items.filter((s) => madeBy(s.id));
  const hint = $("empty-list");
  hint.textContent = !state.listed
    ? (state.keyWait ? "This server needs an API key: its sessions show once the key is given." : "")
    : mine.length ? "" : made.length ? "No sessions of your own yet: send a message to start one."
      : "No sessions yet: send a message to start one.";
  hint.hidden = !hint.textContent;
  const shown = JSON.stringify([items, state.selected, state.armedDelete, Math.floor(Date.now() / 10000)]);
  if (shown === list.dataset.shown) return;  // unchanged: keep the buttons under the pointer
  list.dataset.shown = shown;
  list.replaceChildren(...mine.map(sessionItem));
  const group = $("api-group");
  group.hidden = made.length === 0;
  $("api-group-title").textContent = `Responses API chains and conversations (${made.length})`;
  if (made.some((s) => s.id === state.selected)) group.open = true;  // the open session is never hidden
  $("api-list").replaceChildren(...made.map(sessionItem));
}

function sessionItem(s) {
  const li = el("li", "session");
  li.dataset.id = s.id;
  li.classList.toggle("selected", s.id === state.selected);
  li.addEventListener("click", () => select(s.id));
  const top = el("div", "row");
  top.append(el("span", "sid", s.id));
  top.append(el("span", `badge ${s.draft ? "draft" : s.state}`, s.draft ? "new" : s.state));
  if (madeBy(s.id)) top.append(el("span", "badge made", madeBy(s.id)));
  li.append(top);
  if (s.draft) {
    li.append(el("div", "facts", "created by its first message"));
    return li;
  }
  const facts = el("div", "facts");
  const tokens = el("span", "tokens", String(s.tokens));
  facts.append(tokens, ` tok · `, size(s), ` · ${s.kv_dtype} · `);
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
  await api("POST", sessionPath(sid, "/fork"), { new: fresh });  // a whole-session fork keeps the messages
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
  state.views.delete(sid);
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
  state.loading += 1;
  if (sid) state.views.delete(sid);  // sends wait for the server's messages, never a stale copy
  state.systemFor = sid && !findSession(sid) ? sid : null;  // a draft keeps the field as it is
  renderLog(null);
  renderHead();
  if (sid && findSession(sid)) run(() => showView(sid));  // a draft has no messages yet
}

function renderHead() {
  const sid = state.selected;
  const s = sid ? findSession(sid) : null;
  $("chat-title").textContent = sid || "no session";
  $("chat-meta").replaceChildren(...(s ? [`${s.tokens} tokens · `, size(s), ` · ${s.kv_dtype} · ${s.state}`] : []));
  const view = sid ? state.views.get(sid) : null;
  const note = $("log-note");
  note.textContent = !sid ? "Pick a session from the list, or start a new one."
    : !s ? ""
      : !view ? "Loading its messages…"
        : !view.messages
          ? `This session holds ${s.tokens} tokens but no messages to show: `
            + `${view.reason ? view.reason.message : "the server gave none"}. `
            + "A message sent here starts its conversation over (fork it first to keep it)."
          : view.state === "turn_partial"
            ? "A turn is open on this session (running elsewhere, or cut): its last reply is what is committed so far."
            : "";
  note.hidden = !note.textContent;
  $("send").disabled = !sid || state.abort !== null || Boolean(s && !view);
  for (const button of $("log").querySelectorAll("button.turn")) button.disabled = state.abort !== null;
}

// one message of the log (`index` in state.shown); a user's text is plain, the rest markdown
function addMessage(role, content, index) {
  const box = el("div", `msg ${role}`);
  box.dataset.index = String(index);
  box.append(el("div", "role", role));
  const text = el("div", "text");
  showText(text, role, content);
  box.append(text);
  const done = state.stats.get(statsKey(state.selected, index));
  if (done && done.content === content) box.append(statsLine(done.stats));
  box.append(messageActions(box, role, index));
  $("log").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

// `text` shows `content`; data-source keeps it verbatim (what copy copies and edit starts from)
function showText(text, role, content) {
  text.dataset.source = content;
  const markdown = role !== "user";
  text.classList.toggle("md", markdown);
  text.replaceChildren(markdown ? Markdown.render(content) : document.createTextNode(content));
}

const statsKey = (sid, index) => `${sid}\u0000${index}`;

// run `change` (which grows `box`); a log scrolled to its end stays there, one scrolled up stays put
function growing(box, change) {
  const log = $("log");
  const atEnd = log.scrollHeight - log.scrollTop - log.clientHeight < 48;
  change();
  if (atEnd) box.scrollIntoView({ block: "end" });
}

// a reply's figures from its stream: usage (stream_options.include_usage) and the times its text came
function turnStats(usage, began, first, ended) {
  const tokens = usage.completion_tokens;
  const details = usage.prompt_tokens_details;
  const decoding = first !== null && ended > first ? (ended - first) / 1000 : 0;
  const whole = ended > began ? (ended - began) / 1000 : 0;
  // the rate after the first token; when the rest came in one piece (a fast server, one read) that time is
  // not seen here, so the rate over the whole reply, request to end (lower, never higher, than the true one)
  const rateOver = tokens > 1 ? (decoding > 0 ? "decode" : whole > 0 ? "reply" : null) : null;
  return {
    tokens,
    prompt: usage.prompt_tokens,
    cached: (details && details.cached_tokens) || 0,
    rate: rateOver === "decode" ? (tokens - 1) / decoding : rateOver === "reply" ? tokens / whole : null,
    rateOver,
    ttft: first === null ? null : (first - began) / 1000,
  };
}

function statsLine(stats) {
  const parts = [`${stats.tokens} tokens`];
  if (stats.rate !== null) parts.push(`${stats.rate.toFixed(1)} tok/s${stats.rateOver === "reply" ? " (whole reply)" : ""}`);
  parts.push(`${stats.cached} of ${stats.prompt} prompt tokens cached`);
  if (stats.ttft !== null) parts.push(`first token ${stats.ttft.toFixed(2)} s`);
  const line = el("div", "stats", parts.join(" · "));
  line.dataset.tokens = String(stats.tokens);
  line.dataset.cached = String(stats.cached);
  line.dataset.prompt = String(stats.prompt);
  if (stats.rate !== null) line.dataset.rate = stats.rate.toFixed(2);
  if (stats.rateOver) line.dataset.rateOver = stats.rateOver;
  line.title = "tokens/s: the reply's tokens after its first, over the time from its first text to its end; "
    + "cached: the prompt's tokens the session already held (not computed again)";
  return line;
}

// copy (every message), edit (a user's message), regenerate (the last reply)
function messageActions(box, role, index) {
  const row = el("div", "msg-actions");
  const copy = el("button", "small", "copy");
  copy.type = "button";
  copy.addEventListener("click", () => run(() => copyText(box, copy)));
  row.append(copy);
  if (role === "user") row.append(turnButton("edit", () => startEdit(box, index)));
  if (role === "assistant") row.append(turnButton("regenerate", () => regenerate(index)));
  return row;
}

function turnButton(label, fn) {
  const button = el("button", `small turn ${label}`, label);
  button.type = "button";
  button.disabled = state.abort !== null;
  button.addEventListener("click", () => run(fn));
  return button;
}

async function copyText(box, button) {
  const source = box.querySelector(".text").dataset.source;
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(source);
  } else {  // plain http to another host is no secure context: no navigator.clipboard there
    const area = el("textarea", "offscreen");
    area.value = source;
    document.body.append(area);
    area.select();
    const ok = document.execCommand("copy");
    area.remove();
    if (!ok) throw new Error("this browser refused to copy");
  }
  button.textContent = "copied";
  setTimeout(() => { button.textContent = "copy"; }, 1500);
}

// edit-and-resend: the message becomes a text box; sending it drops every later message
function startEdit(box, index) {
  if (box.querySelector(".editor") || state.abort) return;
  const text = box.querySelector(".text");
  const editor = el("form", "editor");
  const area = el("textarea");
  area.value = text.dataset.source;
  area.rows = Math.min(10, area.value.split("\n").length + 1);
  area.setAttribute("aria-label", "edited message");
  const resend = el("button", "", "Send");
  resend.type = "submit";
  const cancel = el("button", "ghost", "Cancel");
  cancel.type = "button";
  const row = el("div", "row");
  row.append(resend, cancel);
  editor.append(area, row);
  const close = () => { editor.remove(); text.hidden = false; };
  cancel.addEventListener("click", close);
  editor.addEventListener("submit", (event) => {
    event.preventDefault();
    if (!area.value.trim() || state.abort) return;
    run(() => editAndResend(index, area.value));
  });
  area.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      editor.requestSubmit();
    } else if (event.key === "Escape") {
      close();
    }
  });
  text.hidden = true;
  text.after(editor);
  area.focus();
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
  const known = findSession(sid);
  const view = state.views.get(sid);
  if (!sid || !content.trim() || state.abort || (known && !view)) return;
  await run(async () => {
    const knobs = Settings.knobs();  // a bad control says so and keeps the message in the box
    input.value = "";
    // the history is what the page holds for the session: a new session's first turn included, though
    // the list may not show the session yet (its refresh still loading); none for a draft never sent
    const before = view && view.messages ? view.messages : [];
    await converse(sid, Settings.withSystem([...before, { role: "user", content }]), knobs);
  });
}

// regenerate the reply at `index` (the last message): the messages before it, sent again
async function regenerate(index) {
  const sid = state.selected;
  if (!sid || state.abort || index !== state.shown.length - 1) return;
  await converse(sid, Settings.withSystem(state.shown.slice(0, index)), Settings.knobs());
}

// the user's message at `index` replaced by `content`: the messages up to it, later ones dropped
async function editAndResend(index, content) {
  const sid = state.selected;
  if (!sid || state.abort) return;
  const messages = Settings.withSystem([...state.shown.slice(0, index), { role: "user", content }]);
  await converse(sid, messages, Settings.knobs());
}

// one turn: the log shows `messages`, then the reply streams in below them
async function converse(sid, messages, knobs) {
  const asked = { messages, state: "complete", reason: null, tokens: null };
  const before = { messages: messages.slice(0, -1), state: "complete" };
  if (logKey(before) === state.shownKey) {  // a new message after the ones shown: only it is added
    const last = messages[messages.length - 1];
    addMessage(last.role, last.content, messages.length - 1);
    state.shown = messages;
    state.shownKey = logKey(asked);
  } else if (logKey(asked) !== state.shownKey) {
    renderLog(asked);  // an open turn's partial mark goes too: the server closes that turn with the
  }                    // committed reply sent back (as recovery does)
  ++state.loading;  // a view loaded before this turn is stale: never shown over it, even once it ends
  const index = messages.length;
  const box = addMessage("assistant", "", index);
  const text = box.querySelector(".text");
  text.classList.add("streaming");
  state.abort = new AbortController();
  $("stop").hidden = false;
  renderHead();
  let reply = "";
  let finish = null;
  let usage = null;
  let first = null;
  let painting = false;  // a render of the reply so far waits for the next frame
  const paint = () => {
    painting = false;
    if (text.classList.contains("streaming")) growing(box, () => text.replaceChildren(Markdown.render(reply)));
  };
  const began = performance.now();
  try {
    const body = { model: state.model, messages, stream: true, stream_options: { include_usage: true },
                   session: sid, ...knobs };
    const res = await api("POST", "/v1/chat/completions", body, state.abort.signal);
    for await (const chunk of sseData(res.body)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices[0];
      if (!choice) continue;  // the usage chunk has no choices
      const piece = choice.delta && choice.delta.content;
      if (piece) {
        if (first === null) first = performance.now();
        reply += piece;
        if (!painting) {  // the reply so far, as markdown, at most once a frame
          painting = true;
          requestAnimationFrame(paint);
        }
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  } catch (err) {
    if (err.name !== "AbortError") {
      box.classList.add("failed");
      say(err.message, true);
    }
  } finally {
    const ended = performance.now();
    text.classList.remove("streaming");
    growing(box, () => {
      showText(text, "assistant", reply);
      if (usage) {
        const stats = turnStats(usage, began, first, ended);
        state.stats.set(statsKey(sid, index), { content: reply, stats });
        text.after(statsLine(stats));
      }
    });
    if (finish) text.dataset.finish = finish;  // last: a test that waits for it finds the reply whole
    state.abort = null;
    $("stop").hidden = true;
    renderHead();
  }
  // shown until the server's record of the turn replaces it: the refresh sees its tokens unknown and loads it
  const provisional = { messages: [...messages, { role: "assistant", content: reply }], state: "complete",
                        reason: null, tokens: null };
  state.shown = provisional.messages;
  state.shownKey = logKey(provisional);
  state.views.set(sid, provisional);
  ++state.loading;  // nor one loaded while it ran
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
  Settings.start();
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("key-button").hidden = !sessionStorage.getItem(KEY_STORE);  // shown once a key is needed (a 401)
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
