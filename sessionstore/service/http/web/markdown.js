// A small, safe markdown renderer for the chat log: fenced code blocks, inline code, emphasis
// (**strong**, *em*, ~~struck~~), lists (ordered, bulleted, nested), block quotes, headings, rules,
// paragraphs and http(s)/mailto links. It builds DOM nodes with createElement and Text nodes only:
// no string is ever parsed as HTML, so markup in a reply (<script>, <img onerror=...>) is shown as
// the text it is and never runs. Not CommonMark: no tables, no HTML blocks, no reference links.
"use strict";

const Markdown = (() => {
  const FENCE_OPEN = /^( {0,3})(`{3,}|~{3,})([^`]*)$/;
  const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
  const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)])( +|$)(.*)$/;
  const PUNCT = /[!-/:-@[-`{-~]/;
  const LINK = /^\[([^\]\n]+)\]\(((?:https?:\/\/|mailto:)[^\s()<>]+)\)/;
  const SAFE_SCHEME = /^(?:https?:\/\/|mailto:)/i;

  function node(tag, text) {
    const n = document.createElement(tag);
    if (text !== undefined) n.textContent = text;
    return n;
  }

  const indentOf = (line) => line.length - line.trimStart().length;
  const blank = (line) => line.trim() === "";
  const startsBlock = (line) => FENCE_OPEN.test(line) || HEADING.test(line) || RULE.test(line)
    || QUOTE.test(line) || ITEM.test(line);

  // ---- blocks ---------------------------------------------------------------------------------
  // append the blocks of `lines` (tabs already expanded) to `parent`
  function blocks(lines, parent) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (blank(line)) {
        i += 1;
      } else if ((m = FENCE_OPEN.exec(line))) {
        i = fence(lines, i, m, parent);
      } else if ((m = HEADING.exec(line))) {
        const h = node(`h${m[1].length}`);
        inline(m[2] || "", h);
        parent.append(h);
        i += 1;
      } else if (RULE.test(line)) {
        parent.append(node("hr"));
        i += 1;
      } else if (QUOTE.test(line)) {
        const inner = [];
        while (i < lines.length && !blank(lines[i])) {
          const q = QUOTE.exec(lines[i]);
          if (!q && startsBlock(lines[i])) break;
          inner.push(q ? q[1] : lines[i]);  // a line without ">" continues the quote's paragraph
          i += 1;
        }
        const quote = node("blockquote");
        blocks(inner, quote);
        parent.append(quote);
      } else if (ITEM.test(line)) {
        i = list(lines, i, parent);
      } else {
        const para = [line.trim()];
        i += 1;
        while (i < lines.length && !blank(lines[i]) && !startsBlock(lines[i])) {
          para.push(lines[i].trim());
          i += 1;
        }
        const p = node("p");
        inline(para.join("\n"), p);
        parent.append(p);
      }
    }
  }

  // a fenced code block from lines[i] (its opening match `m`); an unclosed fence runs to the end
  function fence(lines, i, m, parent) {
    const indent = m[1].length;
    const mark = m[2];
    const lang = m[3].trim().split(/\s+/)[0];
    const body = [];
    let j = i + 1;
    for (; j < lines.length; j++) {
      const close = /^ {0,3}(`{3,}|~{3,})[ \t]*$/.exec(lines[j]);
      if (close && close[1][0] === mark[0] && close[1].length >= mark.length) break;
      const line = lines[j];
      body.push(line.slice(Math.min(indent, indentOf(line))));
    }
    const pre = node("pre");
    const code = node("code", body.join("\n"));
    if (lang) code.dataset.lang = lang;
    pre.append(code);
    parent.append(pre);
    return j + 1;
  }

  const ordered = (marker) => /\d/.test(marker);

  // a list from lines[i] (an item line); its items' contents are blocks of their own (nesting)
  function list(lines, i, parent) {
    const first = ITEM.exec(lines[i]);
    const isOrdered = ordered(first[2]);
    const box = node(isOrdered ? "ol" : "ul");
    if (isOrdered && parseInt(first[2], 10) !== 1) box.start = parseInt(first[2], 10);
    const items = [];
    let loose = false;
    while (i < lines.length) {
      const m = ITEM.exec(lines[i]);
      if (!m || ordered(m[2]) !== isOrdered) break;
      const gap = m[3].length;
      const inner = m[1].length + m[2].length + (gap >= 1 && gap <= 4 ? gap : 1);
      const body = [m[4]];
      let j = i + 1;
      while (j < lines.length) {
        const line = lines[j];
        if (blank(line)) {
          let k = j;
          while (k < lines.length && blank(lines[k])) k += 1;
          if (k < lines.length && indentOf(lines[k]) >= inner) {  // the item goes on after the gap
            for (; j < k; j++) body.push("");
            continue;
          }
          break;
        }
        if (indentOf(line) >= inner) {
          body.push(line.slice(inner));
        } else if (!blank(lines[j - 1]) && !startsBlock(line)) {
          body.push(line.trim());  // a lazy continuation of the item's paragraph
        } else {
          break;
        }
        j += 1;
      }
      items.push(body);
      i = j;
      if (i < lines.length && blank(lines[i])) {  // a blank line, then the next item: a loose list
        let k = i;
        while (k < lines.length && blank(lines[k])) k += 1;
        const next = k < lines.length && ITEM.exec(lines[k]);
        if (!next || ordered(next[2]) !== isOrdered || indentOf(lines[k]) > first[1].length + 3) break;
        loose = true;
        i = k;
      }
    }
    for (const body of items) {
      const li = node("li");
      blocks(body, li);
      if (!loose) {  // a tight item: its paragraphs' text sits in the item itself
        for (const p of [...li.children].filter((c) => c.tagName === "P")) p.replaceWith(...p.childNodes);
      }
      box.append(li);
    }
    parent.append(box);
    return i;
  }

  // ---- inline ---------------------------------------------------------------------------------
  // `text` is one block's text: newlines become <br>, the rest Text nodes and the spans below
  function inline(text, parent) {
    let buffer = "";
    const flush = () => {
      if (buffer) parent.append(document.createTextNode(buffer));
      buffer = "";
    };
    let i = 0;
    while (i < text.length) {
      const c = text[i];
      if (c === "\\" && i + 1 < text.length && PUNCT.test(text[i + 1])) {
        buffer += text[i + 1];
        i += 2;
        continue;
      }
      if (c === "\n") {
        flush();
        parent.append(node("br"));
        i += 1;
        continue;
      }
      if (c === "`") {
        const run = /^`+/.exec(text.slice(i))[0];
        const close = text.indexOf(run, i + run.length);
        if (close >= 0 && text[close + run.length] !== "`") {
          let body = text.slice(i + run.length, close).replace(/\n/g, " ");
          if (/^ .*[^ ].* $/.test(body)) body = body.slice(1, -1);
          flush();
          parent.append(node("code", body));
          i = close + run.length;
          continue;
        }
        buffer += run;
        i += run.length;
        continue;
      }
      if (c === "*" || c === "_" || c === "~") {
        const span = emphasis(text, i);
        if (span) {
          flush();
          const el = node(span.tag);
          inline(span.inner, el);
          parent.append(el);
          i = span.end;
          continue;
        }
      }
      if (c === "[") {
        const m = LINK.exec(text.slice(i));
        if (m && SAFE_SCHEME.test(m[2])) {
          flush();
          const a = node("a", m[1]);
          a.href = m[2];
          a.rel = "noopener noreferrer nofollow";
          a.target = "_blank";
          parent.append(a);
          i += m[0].length;
          continue;
        }
      }
      buffer += c;
      i += 1;
    }
    flush();
  }

  const wordChar = (ch) => ch !== undefined && /[\p{L}\p{N}]/u.test(ch);
  const space = (ch) => ch === undefined || /\s/.test(ch);

  // the emphasis span opening at text[i] ({tag, inner, end}), or null when none closes there
  function emphasis(text, i) {
    const ch = text[i];
    const double = text[i + 1] === ch;
    if (ch === "~" && !double) return null;
    const width = double ? 2 : 1;
    const tag = ch === "~" ? "del" : double ? "strong" : "em";
    const open = i + width;
    if (space(text[open])) return null;  // "* item" or "a * b": not an opener
    if (ch === "_" && wordChar(text[i - 1])) return null;  // snake_case stays text
    for (let k = open + 1; k < text.length; k++) {
      if (text[k] === "`") {  // code spans bind tighter: skip over one
        const run = /^`+/.exec(text.slice(k))[0];
        const close = text.indexOf(run, k + run.length);
        if (close >= 0) k = close + run.length - 1;
        continue;
      }
      if (text[k] !== ch) continue;
      let run = 1;
      while (text[k + run] === ch) run += 1;
      if (!double && run >= 2 && run !== 3) {  // a "**" inside "*...*" belongs to a nested strong
        k += run - 1;
        continue;
      }
      const at = k + run - width;  // close on the run's last delimiters: "***x***" = em(strong)
      if (run >= width && !space(text[k - 1]) && !(ch === "_" && wordChar(text[at + width]))) {
        return { tag, inner: text.slice(open, double ? at : k), end: double ? at + width : k + 1 };
      }
      k += run - 1;
    }
    return null;
  }

  /** The DocumentFragment that shows markdown `source`: element and Text nodes only. */
  function render(source) {
    const fragment = document.createDocumentFragment();
    const lines = String(source).replace(/\r\n?/g, "\n").split("\n").map(expandTabs);
    blocks(lines, fragment);
    return fragment;
  }

  function expandTabs(line) {
    if (!line.includes("\t")) return line;
    let out = "";
    for (const ch of line) out += ch === "\t" ? " ".repeat(4 - (out.length % 4)) : ch;
    return out;
  }

  return { render };
})();
