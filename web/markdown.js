// -- Markdown: a small renderer that builds DOM nodes, so no HTML in a note can run ----------
// (MARKDOWN_JS, shared with the share page: each page brings its own link(), wikiLink()
// and image(), in the ctx it renders with, which decide what a link or an image may reach.)

const markdown = (() => {
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === false || v === null || v === undefined) continue;
      if (k === "class") e.className = v;
      else if (k === "onclick") e.addEventListener("click", v);
      else e.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children) {
      if (c === null || c === undefined || c === false) continue;
      e.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    }
    return e;
  }

  function folderOf(path) {
    return path.split("/").slice(0, -1).join("/");
  }

  const LIST_RE = /^(\s*)([-*+]|\d{1,9}[.)])(?:\s+(.*)|$)/;
  const FENCE_RE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
  const HEADING_RE = /^ {0,3}(#{1,6})(?:\s+(.*?))?(?:\s+#+)?\s*$/;
  const HR_RE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE_RE = /^ {0,3}> ?/;
  const TABLE_SEP_RE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

  // Inline syntax, one alternative per construct; the group numbers are used below.
  const INLINE_SOURCE = [
    /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/.source, // 1, 2: code
    /!\[([^\]\n]*)\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"\n]*")?\s*\)/.source, // 3, 4: image
    /\[\[([^\[\]|\n]+)(?:\|([^\[\]\n]+))?\]\]/.source, // 5, 6: wikilink
    /\[([^\[\]\n]+)\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"\n]*")?\s*\)/.source, // 7, 8: link
    /<((?:https?|mailto):[^>\s]+)>/.source, // 9: autolink
    /(https?:\/\/[^\s<]*[^\s<.,:;"')\]!?*_~])/.source, // 10: a bare URL
    /(\*\*|__)(?=\S)([\s\S]*?\S)\11/.source, // 11, 12: strong
    /(\*|_)(?=[^\s*_])([\s\S]*?[^\s\\])\13/.source, // 13, 14: emphasis
    /~~(?=\S)([\s\S]*?\S)~~/.source, // 15: strike-through
    /==(?=\S)([\s\S]*?\S)==/.source, // 16: highlight
    /\\([\\`*_{}\[\]()#+\-.!|~<>=])/.source, // 17: an escape
    /(\n)/.source, // 18: a line break
  ].join("|");

  function renderMarkdown(text, ctx) {
    ctx = ctx || {};
    const lines = text
      .replace(/\r\n?/g, "\n")
      .split("\n")
      .map((t, n) => ({t, n}));
    const root = el("div", {class: "md"});
    let start = 0;
    if (lines.length > 2 && lines[0].t === "---") {
      // front matter: shown small, as it is
      const end = lines.findIndex((l, i) => i > 0 && (l.t === "---" || l.t === "..."));
      if (end > 0) {
        root.appendChild(
          el(
            "pre",
            {class: "front"},
            lines
              .slice(1, end)
              .map((l) => l.t)
              .join("\n"),
          ),
        );
        start = end + 1;
      }
    }
    blocks(lines.slice(start), root, ctx);
    return root;
  }

  function startsBlock(t) {
    return (
      FENCE_RE.test(t) || HEADING_RE.test(t) || HR_RE.test(t) || QUOTE_RE.test(t) || LIST_RE.test(t)
    );
  }

  // ctx.lines: each block (and list item) says which source lines it was drawn from, in
  // data-line and data-end (the page opens the editor at the place a tap lands on).
  function mark(node, ctx, first, last) {
    if (!ctx.lines || !node || node.nodeType === 3) return;
    node.setAttribute("data-line", String(first));
    node.setAttribute("data-end", String(last));
  }

  function blocks(lines, out, ctx) {
    let i = 0;
    while (i < lines.length) {
      const t = lines[i].t;
      let m;
      if (!t.trim()) {
        i++;
        continue;
      }
      const at = i;
      const count = out.children ? out.children.length : 0;
      if ((m = FENCE_RE.exec(t))) {
        const close = new RegExp("^ {0,3}" + m[1][0] + "{" + m[1].length + ",}\\s*$");
        const body = [];
        for (i++; i < lines.length && !close.test(lines[i].t); i++) body.push(lines[i].t);
        i++;
        out.appendChild(
          el(
            "pre",
            {},
            el(
              "code",
              {class: m[2] ? "lang-" + m[2].replace(/[^\w-]/g, "") : null},
              body.join("\n"),
            ),
          ),
        );
      } else if ((m = HEADING_RE.exec(t))) {
        const h = el("h" + m[1].length);
        inline(m[2] || "", h, ctx);
        out.appendChild(h);
        i++;
      } else if (HR_RE.test(t)) {
        out.appendChild(el("hr"));
        i++;
      } else if (QUOTE_RE.test(t)) {
        const inner = [];
        for (; i < lines.length && QUOTE_RE.test(lines[i].t); i++) {
          inner.push({t: lines[i].t.replace(QUOTE_RE, ""), n: lines[i].n});
        }
        const q = el("blockquote");
        blocks(inner, q, ctx);
        out.appendChild(q);
      } else if (
        i + 1 < lines.length &&
        t.includes("|") &&
        lines[i + 1].t.includes("-") &&
        TABLE_SEP_RE.test(lines[i + 1].t)
      ) {
        i = table(lines, i, out, ctx);
      } else if (LIST_RE.test(t)) {
        i = list(lines, i, out, ctx);
      } else {
        const para = [t.trim()];
        for (i++; i < lines.length && lines[i].t.trim() && !startsBlock(lines[i].t); i++)
          para.push(lines[i].t.trim());
        const p = el("p");
        inline(para.join("\n"), p, ctx);
        out.appendChild(p);
      }
      const made = out.children ? out.children[count] : null;
      if (made && !/^(ul|ol|blockquote)$/i.test(made.tagName || "")) {
        mark(made, ctx, lines[at].n, lines[Math.min(i, lines.length) - 1].n);
      }
    }
  }

  function indentOf(s) {
    return s.replace(/\t/g, "    ").length;
  }

  function list(lines, i, out, ctx) {
    const first = LIST_RE.exec(lines[i].t);
    const indent = indentOf(first[1]);
    const ordered = /\d/.test(first[2]);
    const listEl = el(ordered ? "ol" : "ul");
    if (ordered && parseInt(first[2], 10) !== 1)
      listEl.setAttribute("start", String(parseInt(first[2], 10)));
    out.appendChild(listEl);
    let li = null;
    let body = null; // where the item's text goes: a task's text is inside its label
    while (i < lines.length) {
      const t = lines[i].t;
      if (!t.trim()) {
        // a blank line: the list goes on if an item follows
        let j = i;
        while (j < lines.length && !lines[j].t.trim()) j++;
        const next = j < lines.length ? LIST_RE.exec(lines[j].t) : null;
        if (!next || indentOf(next[1]) < indent) return j;
        i = j;
        continue;
      }
      const m = LIST_RE.exec(t);
      if (m && !HR_RE.test(t)) {
        const ind = indentOf(m[1]);
        if (ind < indent) return i;
        if (ind > indent && li) {
          i = list(lines, i, li, ctx);
          body = li; // text after a nested list goes after it
          continue;
        }
        if (/\d/.test(m[2]) !== ordered) return i;
        li = el("li");
        mark(li, ctx, lines[i].n, lines[i].n);
        body = li;
        let content = m[3] || "";
        const task = /^\[([ xX])\](?:\s+|$)/.exec(content);
        if (task) {
          li.className = "task";
          const n = lines[i].n;
          const box = el("input", {
            type: "checkbox",
            "data-line": String(n),
            "aria-label": content.slice(task[0].length).slice(0, 80) || "task",
          });
          box.checked = task[1] !== " ";
          box.disabled = !ctx.onTask;
          if (ctx.onTask) box.addEventListener("change", () => ctx.onTask(n, box));
          body = el("span");
          li.appendChild(el("label", {}, box, body));
          content = content.slice(task[0].length);
        }
        inline(content, body, ctx);
        listEl.appendChild(li);
        i++;
      } else if (li && (/^\s/.test(t) || (!startsBlock(t) && li.className !== "task"))) {
        // the item's text goes on (a task is its one line, as CalDAV reads it: an unindented
        // line after it is a paragraph of its own, never greyed with the ticked box)
        body.appendChild(el("br"));
        inline(t.trim(), body, ctx);
        if (ctx.lines) mark(li, ctx, Number(li.getAttribute("data-line")), lines[i].n);
        i++;
      } else {
        return i;
      }
    }
    return i;
  }

  function splitRow(row) {
    let s = row.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    return s
      .replace(/\\\|/g, "\u0000")
      .split("|")
      .map((c) => c.replace(/\u0000/g, "|").trim());
  }

  function table(lines, i, out, ctx) {
    const head = splitRow(lines[i].t);
    const align = splitRow(lines[i + 1].t).map((c) =>
      c.endsWith(":") ? (c.startsWith(":") ? "al-c" : "al-r") : null,
    );
    const tr = el("tr");
    head.forEach((c, k) => {
      const th = el("th", {class: align[k]});
      inline(c, th, ctx);
      tr.appendChild(th);
    });
    const tbody = el("tbody");
    for (i += 2; i < lines.length && lines[i].t.includes("|") && lines[i].t.trim(); i++) {
      const row = el("tr");
      const cells = splitRow(lines[i].t);
      head.forEach((_, k) => {
        const td = el("td", {class: align[k]});
        inline(cells[k] || "", td, ctx);
        row.appendChild(td);
      });
      tbody.appendChild(row);
    }
    out.appendChild(el("div", {class: "table"}, el("table", {}, el("thead", {}, tr), tbody)));
    return i;
  }

  function inline(text, parent, ctx) {
    if (text.length > 20000) {
      parent.appendChild(document.createTextNode(text));
      return;
    }
    const re = new RegExp(INLINE_SOURCE, "g");
    let last = 0;
    let m;
    const add = (s) => {
      if (s) parent.appendChild(document.createTextNode(s));
    };
    while ((m = re.exec(text))) {
      if (
        m[13] === "_" &&
        (/\w/.test(text[m.index - 1] || "") || /\w/.test(text[re.lastIndex] || ""))
      ) {
        re.lastIndex = m.index + 1; // snake_case is not emphasis
        continue;
      }
      // ![[name]] embeds what [[name]] links to (an image shows, a file is offered).
      const embed = m[5] !== undefined && m.index > last && text[m.index - 1] === "!";
      add(text.slice(last, embed ? m.index - 1 : m.index));
      last = re.lastIndex;
      if (m[1] !== undefined) parent.appendChild(el("code", {}, m[2].replace(/^ (.*) $/, "$1")));
      else if (m[3] !== undefined) parent.appendChild(ctx.image(m[3], m[4], ctx));
      else if (m[5] !== undefined) parent.appendChild(ctx.wikiLink(m[5], m[6], ctx, embed));
      else if (m[7] !== undefined) parent.appendChild(ctx.link(m[8], m[7], ctx, true));
      else if (m[9] !== undefined)
        parent.appendChild(ctx.link(m[9], m[9].replace(/^mailto:/, ""), ctx));
      else if (m[10] !== undefined) parent.appendChild(ctx.link(m[10], m[10], ctx));
      else if (m[11] !== undefined) {
        const e = el("strong");
        inline(m[12], e, ctx);
        parent.appendChild(e);
      } else if (m[13] !== undefined) {
        const e = el("em");
        inline(m[14], e, ctx);
        parent.appendChild(e);
      } else if (m[15] !== undefined) {
        const e = el("del");
        inline(m[15], e, ctx);
        parent.appendChild(e);
      } else if (m[16] !== undefined) {
        const e = el("mark");
        inline(m[16], e, ctx);
        parent.appendChild(e);
      } else if (m[17] !== undefined) add(m[17]);
      else if (m[18] !== undefined) parent.appendChild(el("br"));
    }
    add(text.slice(last));
  }

  function safeDecode(s) {
    try {
      return decodeURIComponent(s);
    } catch (e) {
      return s;
    }
  }

  // Return the note path (or attachment path) a relative link points at, or null.
  function resolveRelative(href, from) {
    const target = safeDecode(href.split("#")[0].split("?")[0]);
    if (!target) return null;
    const parts = target.startsWith("/")
      ? target.startsWith("/notes/") || target.startsWith("/attachments/")
        ? []
        : ["notes"]
      : folderOf(from || "notes/x.md").split("/");
    for (const seg of target.split("/")) {
      if (seg === "" || seg === ".") continue;
      if (seg === "..") {
        if (!parts.length) return null;
        parts.pop();
      } else parts.push(seg);
    }
    const path = parts.join("/");
    return /^(notes|attachments)\//.test(path) ? path : null;
  }

  return {el, folderOf, inline, renderMarkdown, resolveRelative, safeDecode};
})();

if (typeof module !== "undefined") module.exports = markdown;
