// -- lists in the editor (pure: no page; node --test web/) ----------------------------------
// What the checklist button and Enter do to the Markdown text, as one edit the page makes
// with the browser's own editing (so Undo takes it back): {from, to, insert} replaces
// text.slice(from, to), and the selection is then {start, end}. The editor stays Markdown.

const lists = (() => {
  // indent, bullet or number + delimiter, the space, a task's box and its space
  const ITEM_RE = /^([ \t]*)(?:([-*+])|(\d{1,9})([.)]))([ \t]+)(?:\[([ xX])\]([ \t]+|$))?/;
  const TASK_RE = /^([ \t]*)(?:[-*+]|\d{1,9}[.)])[ \t]+\[[ xX]\](?:[ \t]+|$)/;

  // The start and end (before its \n) of the line holding offset `at`.
  function lineAt(text, at) {
    const start = text.lastIndexOf("\n", at - 1) + 1;
    const nl = text.indexOf("\n", at);
    return [start, nl < 0 ? text.length : nl];
  }

  // The offset where line `n` (from 0) starts; the text's end past its last line.
  function lineStart(text, n) {
    let at = 0;
    for (let k = 0; k < n; k++) {
      const nl = text.indexOf("\n", at);
      if (nl < 0) return text.length;
      at = nl + 1;
    }
    return at;
  }

  // The marker the next item of `line`'s list starts with, or null: not a list line.
  // A task goes on as an open task; a number as the next number.
  function nextMarker(m) {
    const mark = m[2] || String(parseInt(m[3], 10) + 1) + m[4];
    return m[1] + mark + " " + (m[6] !== undefined ? "[ ] " : "");
  }

  // Enter at `start`..`end`: the edit that continues the list (a new item after the caret's,
  // the rest of the line in it) or ends it (an empty item loses its marker and stays as a
  // blank line, the caret on a new line below it: what is typed there is a paragraph of its
  // own, never a lazy continuation of the last item); null when the line is not a list
  // item (Enter does what it always does).
  function onEnter(text, start, end) {
    const [ls, le] = lineAt(text, start);
    if (end > le) return null; // a selection over lines: a plain Enter replaces it
    const m = ITEM_RE.exec(text.slice(ls, le));
    if (!m || start - ls < m[0].length) return null; // in the marker: a line goes in above
    if (!text.slice(ls + m[0].length, le).trim()) {
      // no item above (the text's start, or a blank line): nothing to keep apart
      const alone = ls === 0 || !text.slice(lineAt(text, ls - 1)[0], ls - 1).trim();
      const insert = alone ? "" : "\n";
      return {from: ls, to: le, insert, start: ls + insert.length, end: ls + insert.length};
    }
    const insert = "\n" + nextMarker(m);
    return {from: start, to: end, insert, start: start + insert.length, end: start + insert.length};
  }

  // The checklist button: the caret's line, or every selected line, becomes a task ("- item"
  // keeps its bullet, a plain line gets "- [ ] "); when all of them are tasks already, they
  // lose the box and the bullet (plain lines again). Blank lines in a selection stay blank.
  function toggleTask(text, start, end) {
    const from = lineAt(text, start)[0];
    // a selection ending at a line's very start does not take that line
    const last = end > start && text[end - 1] === "\n" ? end - 1 : end;
    const to = lineAt(text, Math.max(last, from))[1];
    const lines = text.slice(from, to).split("\n");
    const filled = lines.filter((l) => l.trim());
    const off = filled.length > 0 && filled.every((l) => TASK_RE.test(l));
    // each line: [column where the change is, characters taken out, text put in]
    const changes = lines.map((line) => {
      if (off) {
        const t = TASK_RE.exec(line);
        return [t[1].length, t[0].length - t[1].length, ""];
      }
      if (TASK_RE.test(line) || (!line.trim() && lines.length > 1)) return [0, 0, ""];
      const m = ITEM_RE.exec(line);
      if (m) return [m[0].length, 0, "[ ] "];
      const indent = /^[ \t]*/.exec(line)[0].length;
      return [indent, 0, "- [ ] "];
    });
    const out = lines.map((l, k) => {
      const [col, cut, put] = changes[k];
      return l.slice(0, col) + put + l.slice(col + cut);
    });
    // an offset in the old text, where it is in the new one (on its line, past the change)
    const starts = [];
    let at = from;
    for (const l of lines) {
      starts.push(at);
      at += l.length + 1;
    }
    // (a selection's start stays before what is put in at it: the lines stay selected whole)
    const moved = (p, before) => {
      let k = starts.length - 1;
      while (k > 0 && starts[k] > p) k--;
      let shift = 0;
      for (let j = 0; j < k; j++) shift += changes[j][2].length - changes[j][1];
      const [col, cut, put] = changes[k];
      const c = p - starts[k];
      const inLine =
        c < col || (before && c === col) ? c : c < col + cut ? col : c - cut + put.length;
      return starts[k] + shift + inLine;
    };
    return {from, to, insert: out.join("\n"), start: moved(start, end > start), end: moved(end)};
  }

  // The text once `edit` is made (what the page's editing does; the tests use it).
  function apply(text, edit) {
    return text.slice(0, edit.from) + edit.insert + text.slice(edit.to);
  }

  // Where the caret goes when a person taps a note's formatted text: in the source lines
  // first..last (the block tapped), after what was shown before the tap (`before`, the
  // block's text up to the tap). The shown text lacks the Markdown marks, so the last few
  // characters of it are looked for, the nearest where the marks would put them.
  function caretFor(text, first, last, before) {
    const from = lineStart(text, first);
    const to = lineAt(text, lineStart(text, last))[1];
    const block = text.slice(from, Math.max(from, to)).replace(/\s/g, " "); // offsets kept
    const lead = /^[ \t]*(?:#{1,6}[ \t]+|>[ \t]?|(?:[-*+]|\d{1,9}[.)])[ \t]+(?:\[[ xX]\][ \t]+)?)?/;
    const skip = lead.exec(block)[0].length;
    const shown = before.replace(/\s+/g, " ");
    if (!shown.trim()) return from + skip;
    const guess = skip + shown.length;
    for (let n = Math.min(24, shown.length); n > 0; n--) {
      const tail = shown.slice(-n);
      let best = -1;
      for (let i = block.indexOf(tail, skip); i >= 0; i = block.indexOf(tail, i + 1)) {
        if (best < 0 || Math.abs(i + n - guess) < Math.abs(best + n - guess)) best = i;
      }
      if (best >= 0) return from + best + n;
    }
    return from + Math.min(block.length, guess);
  }

  return {apply, caretFor, lineAt, lineStart, onEnter, toggleTask};
})();

if (typeof module !== "undefined") module.exports = lists;
