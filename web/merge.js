// -- diffs and merges (pure: no page; node --test web/) -----------------------------------
// The same three-way line merge as the server's (merge3 in notesvc.py): the page uses it
// when the person typed on while a save was on its way and the server merged in someone
// else's change meanwhile. The word diff draws a version against another on a phone.

// How long a and b (arrays or strings) are the same from the start, and then from the end
// (never overlapping the start).
const merge = (() => {
  function commonEnds(a, b) {
    let pre = 0;
    while (pre < a.length && pre < b.length && a[pre] === b[pre]) pre++;
    let suf = 0;
    while (
      suf < a.length - pre &&
      suf < b.length - pre &&
      a[a.length - 1 - suf] === b[b.length - 1 - suf]
    )
      suf++;
    return [pre, suf];
  }

  // Past this many differences a diff gives up on the middle: it is one change there (a
  // merge then keeps both sides apart, a word diff marks it all), in bounded time and memory.
  const MAX_EDITS = 2000;

  // Myers' diff of two arrays (by ===): the matching runs, as [aStart, bStart, length]. The
  // common start and end are matched first; the middle is searched at most MAX_EDITS deep.
  function matches(a, b) {
    const [pre, suf] = commonEnds(a, b);
    const mid = myers(a.slice(pre, a.length - suf), b.slice(pre, b.length - suf)) || [];
    const runs = [[0, 0, pre], ...mid.map(([x, y, len]) => [x + pre, y + pre, len])];
    runs.push([a.length - suf, b.length - suf, suf]);
    return runs.filter((r) => r[2] > 0);
  }

  // The runs of a against b, or null past MAX_EDITS. Each depth keeps only its own diagonals
  // (2d + 3 of them), so the memory is the square of the differences, not of the lengths.
  function myers(a, b) {
    const n = a.length;
    const m = b.length;
    const max = n + m;
    const v = new Int32Array(2 * max + 3);
    const trace = [];
    let done = max === 0;
    for (let d = 0; d <= max && !done; d++) {
      if (d > MAX_EDITS) return null;
      trace.push(v.slice(max - d, max + d + 3)); // diagonals -d-1 .. d+1
      for (let k = -d; k <= d; k += 2) {
        const i = k + max + 1;
        let x = k === -d || (k !== d && v[i - 1] < v[i + 1]) ? v[i + 1] : v[i - 1] + 1;
        let y = x - k;
        while (x < n && y < m && a[x] === b[y]) {
          x++;
          y++;
        }
        v[i] = x;
        if (x >= n && y >= m) {
          done = true;
          break;
        }
      }
    }
    // walk back through the trace: the snakes are the matching runs
    const runs = [];
    let x = n;
    let y = m;
    for (let d = trace.length - 1; d >= 0 && (x > 0 || y > 0); d--) {
      const vd = trace[d];
      const at = (k) => vd[k + d + 1];
      const k = x - y;
      const prevK = k === -d || (k !== d && at(k - 1) < at(k + 1)) ? k + 1 : k - 1;
      const prevX = d === 0 ? 0 : at(prevK);
      const prevY = prevX - prevK;
      const startX = d === 0 ? 0 : prevK === k + 1 ? prevX : prevX + 1;
      const startY = startX - k;
      if (x > startX) runs.push([startX, startY, x - startX]);
      x = d === 0 ? 0 : prevX;
      y = d === 0 ? 0 : prevY;
    }
    return runs.reverse().filter((r) => r[2] > 0);
  }

  // The changes from a to b: [aStart, aEnd, bStart, bEnd] of every region that differs.
  function changes(a, b) {
    const out = [];
    let i = 0;
    let j = 0;
    for (const [x, y, len] of [...matches(a, b), [a.length, b.length, 0]]) {
      if (x > i || y > j) out.push([i, x, j, y]);
      i = x + len;
      j = y + len;
    }
    return out;
  }

  function splitLines(text) {
    const lines = text.match(/[^\n]*\n|[^\n]+$/g) || [];
    return lines;
  }

  const bare = (line) => line.replace(/\r?\n$/, "");

  function overlap(a, b) {
    if (a[0] === a[1] && b[0] === b[1]) return a[0] === b[0];
    if (a[0] === a[1]) return b[0] < a[0] && a[0] < b[1];
    if (b[0] === b[1]) return a[0] < b[0] && b[0] < a[1];
    return a[0] < b[1] && b[0] < a[1];
  }

  function alreadyMade(h, all) {
    if (h[0] !== h[1] || !h[2].length) return false;
    const wanted = h[2].map(bare).join("\n");
    const n = h[2].length;
    return all.some((g) => {
      if (g[3] === h[3] || g[0] === g[1] || g[2].length < n) return false;
      const lines = g[2].map(bare);
      return (
        (g[1] === h[0] && lines.slice(-n).join("\n") === wanted) ||
        (g[0] === h[0] && lines.slice(0, n).join("\n") === wanted)
      );
    });
  }

  function apply(base, lo, hi, hunks) {
    const out = [];
    let at = lo;
    for (const [i1, i2, lines] of hunks) {
      out.push(...base.slice(at, i1), ...lines);
      at = i2;
    }
    return out.concat(base.slice(at, hi));
  }

  // {text, conflict}: a three-way line merge of base, current and edit. Changes on one side
  // are kept, identical changes on both sides once, overlapping different ones are a
  // conflict (current's side is kept there). Line endings do not count as changes.
  function merge3(base, current, edit) {
    const b = splitLines(base);
    const c = splitLines(current);
    const e = splitLines(edit);
    for (const side of [c, e]) {
      if (side.length && !side[side.length - 1].endsWith("\n")) side[side.length - 1] += "\n";
    }
    const kb = b.map(bare);
    const kept = b.slice();
    for (const [x, y, len] of matches(kb, c.map(bare))) {
      for (let k = 0; k < len; k++) kept[x + k] = c[y + k];
    }
    let all = [];
    for (const [side, other] of [
      [0, c],
      [1, e],
    ]) {
      for (const [i1, i2, j1, j2] of changes(kb, other.map(bare))) {
        all.push([i1, i2, other.slice(j1, j2), side]);
      }
    }
    all = all.filter((h) => !alreadyMade(h, all));
    all.sort((p, q) => p[0] - q[0] || p[1] - q[1] || p[3] - q[3]);
    const groups = [];
    for (const h of all) {
      const last = groups[groups.length - 1];
      if (last && last.some((g) => overlap(h, g))) last.push(h);
      else groups.push([h]);
    }
    const out = [];
    let at = 0;
    let conflict = false;
    for (const group of groups) {
      const lo = Math.min(...group.map((g) => g[0]));
      const hi = Math.max(...group.map((g) => g[1]));
      out.push(...kept.slice(at, lo));
      const ours = group.filter((g) => g[3] === 0);
      const theirs = group.filter((g) => g[3] === 1);
      if (ours.length && theirs.length) {
        const mine = apply(b, lo, hi, ours);
        const edited = apply(b, lo, hi, theirs);
        if (mine.map(bare).join("\n") !== edited.map(bare).join("\n")) conflict = true;
        out.push(...mine);
      } else {
        out.push(...apply(b, lo, hi, ours.length ? ours : theirs));
      }
      at = hi;
    }
    out.push(...kept.slice(at));
    return {text: out.join(""), conflict};
  }

  // The difference between two texts word by word: [{op: "same"|"add"|"del", text}], the
  // runs joined, so a version reads as one text with what changed marked in it.
  function wordDiff(before, after) {
    const split = (t) => t.match(/\s+|[^\s]+/g) || [];
    const a = split(before);
    const b = split(after);
    const raw = [];
    let i = 0;
    let j = 0;
    for (const [x, y, len] of [...matches(a, b), [a.length, b.length, 0]]) {
      if (i < x) raw.push({op: "del", text: a.slice(i, x).join("")});
      if (j < y) raw.push({op: "add", text: b.slice(j, y).join("")});
      for (let k = x; k < x + len; k++) raw.push({op: "same", text: a[k]});
      i = x + len;
      j = y + len;
    }
    // One change reads as one: a space between two changes joins them (the words struck
    // out together, then the words put in), as a person would mark up a text.
    const out = [];
    const push = (op, text) => {
      const last = out[out.length - 1];
      if (!text) return;
      if (last && last.op === op) last.text += text;
      else out.push({op, text});
    };
    let del = "";
    let add = "";
    const flush = () => {
      push("del", del);
      push("add", add);
      del = add = "";
    };
    raw.forEach((part, k) => {
      const next = raw[k + 1];
      if (part.op === "del") del += part.text;
      else if (part.op === "add") add += part.text;
      else if ((del || add) && /^\s+$/.test(part.text) && next && next.op !== "same") {
        del += part.text;
        add += part.text;
      } else {
        flush();
        push("same", part.text);
      }
    });
    flush();
    return out;
  }

  return {changes, commonEnds, matches, merge3, wordDiff};
})();

if (typeof module !== "undefined") module.exports = merge;
