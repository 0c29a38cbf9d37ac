// The chat settings panel (#settings): the system prompt field and the sampling controls
// (temperature, top_p, max tokens). The system prompt is sent as a conversation's first message;
// the controls' values go into each request (an empty one: the server's default) and are kept in
// localStorage. It reads and writes only its own inputs.
"use strict";

const Settings = (() => {
  const STORE = "coli.knobs";
  const SYSTEM_ROLES = new Set(["system", "developer"]);
  // input id -> request field; an input's min, max and step (1: whole numbers) are its bounds
  const KNOBS = [["temperature", "temperature"], ["top-p", "top_p"], ["max-tokens", "max_tokens"]];
  const input = (id) => document.getElementById(id);

  /** `messages` with the field's prompt as their first message (none when the field is empty). */
  function withSystem(messages) {
    const prompt = input("system").value;
    const head = messages.length && SYSTEM_ROLES.has(messages[0].role) ? messages[0] : null;
    const rest = head ? messages.slice(1) : messages;
    if (!prompt.trim()) return rest;
    if (head && head.content === prompt) return messages;  // unchanged (a developer message stays one)
    return [{ role: "system", content: prompt }, ...rest];
  }

  /** The field shows the system prompt of `messages` (a session's), or nothing when it has none. */
  function showSystemOf(messages) {
    const head = messages && messages[0];
    input("system").value = head && SYSTEM_ROLES.has(head.role) ? head.content : "";
    summarize();
  }

  /** The request's sampling fields from the controls; an Error saying which one is out of bounds. */
  function knobs() {
    const fields = {};
    for (const [id, field] of KNOBS) {
      const box = input(id);
      const raw = box.value.trim();
      if (raw === "") continue;
      const value = Number(raw);
      const [lo, hi, whole] = [Number(box.min), Number(box.max), box.step === "1"];
      if (!Number.isFinite(value) || value < lo || value > hi || (whole && !Number.isInteger(value))) {
        throw new Error(`${field} must be ${whole ? "a whole number" : "a number"} in [${lo}, ${hi}]`);
      }
      fields[field] = value;
    }
    return fields;
  }

  function save() {
    localStorage.setItem(STORE, JSON.stringify(Object.fromEntries(KNOBS.map(([id]) => [id, input(id).value]))));
  }

  // the panel's summary line: what the next request sends
  function summarize() {
    const shown = (id) => input(id).value || "default";
    const parts = [`temperature ${shown("temperature")}`, `top_p ${shown("top-p")}`,
                   `max ${shown("max-tokens")} tokens`];
    if (input("system").value.trim()) parts.unshift("system prompt");
    input("settings-summary").textContent = parts.join(" · ");
  }

  /** Restore the kept controls, keep them on change, and open the panel unless on a phone. */
  function start() {
    let saved = null;
    try { saved = JSON.parse(localStorage.getItem(STORE) || "null"); } catch (_) { /* not ours: ignore */ }
    if (saved && typeof saved === "object") {
      for (const [id] of KNOBS) if (typeof saved[id] === "string") input(id).value = saved[id];
    }
    for (const id of ["system", ...KNOBS.map(([knob]) => knob)]) input(id).addEventListener("input", summarize);
    for (const [id] of KNOBS) input(id).addEventListener("change", save);
    input("settings").open = window.matchMedia("(min-width: 701px)").matches;  // folded on a phone
    summarize();
  }

  return { withSystem, showSystemOf, knobs, start };
})();
