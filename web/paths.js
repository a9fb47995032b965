// -- paths and names (pure: no page; node --test web/) -------------------------------------

// A note's name: its file name without .md.
const paths = (() => {
  function nameOf(path) {
    return path.split("/").pop().replace(/\.md$/, "");
  }

  function fileName(path) {
    return path.split("/").pop();
  }

  // Whether a name is a file other than a note (it has an extension, and it is not .md).
  function isAttachmentName(name) {
    const ext = /\.([a-z0-9]{1,5})$/i.exec(fileName(name));
    return !!ext && ext[1].toLowerCase() !== "md";
  }

  // The note path a person's "folder/name" means: under notes/, ending in .md.
  function toNotePath(name) {
    let path = name.trim().replace(/^\/+/, "");
    if (!path.startsWith("notes/")) path = "notes/" + path;
    if (!/\.md$/i.test(path)) path += ".md";
    return path;
  }

  // The link a note at `from` writes to `path`, so other Markdown editors find it too.
  function relativeTo(from, path) {
    const a = from.split("/").slice(0, -1);
    const b = path.split("/");
    let i = 0;
    while (i < a.length && i < b.length - 1 && a[i] === b[i]) i++;
    return "../".repeat(a.length - i) + b.slice(i).map(encodeURIComponent).join("/");
  }

  // Lower case without accents, the same length (in UTF-16 units) as s.
  function fold(s) {
    return s
      .split("")
      .map((c) => c.normalize("NFD")[0].toLowerCase()[0])
      .join("");
  }

  // The words of a search query to highlight in its snippets (as the server matches them).
  function queryWords(q) {
    return fold(q)
      .replace(/(^|\s)-\S+/g, " ")
      .replace(/["*()]/g, " ")
      .split(/\s+/)
      .filter((w) => w && w !== "or" && w.length > 1)
      .map((w) => (w.length > 4 ? w.replace(/(es|s)$/, "") : w));
  }

  // Whether a query runs by words only whatever the server offers, as the server decides it:
  // a "phrase" (two words or more in quotes, or joined as in e-mail) or a prefix*, unless
  // -excluded. (Such a query answers fallback: true without the model being at fault.)
  function lexicalOnly(q) {
    const items = q.match(/-?"[^"]*"|\S+/g) || [];
    return items.some((item) => {
      if (item.startsWith("-") && item.length > 1) return false;
      const quoted = item.startsWith('"');
      if (!quoted && item.endsWith("*")) return true;
      // a quoted phrase; a word with inner punctuation (e-mail) is searched by meaning too
      return quoted && (item.match(/[\p{L}\p{N}]+/gu) || []).length > 1;
    });
  }

  // The quiet line under the search box, from a search answer (docs/api.md: "Search by
  // meaning"): nothing while embeddings are off (the answer has no `embeddings`).
  function meaningLine(answer, q) {
    const e = answer.embeddings;
    if (!e) return "";
    if (answer.fallback) {
      return lexicalOnly(q)
        ? 'By words only, as "quotes" and * ask'
        : "By words only: the model is not answering";
    }
    if (answer.mode === "keyword") return "By words only";
    const line = "Searching by words and meaning";
    if (e.embedded >= e.total) return line;
    const n = (x) => Number(x).toLocaleString("en");
    return line + " · " + n(e.embedded) + " of " + n(e.total) + " notes ready";
  }

  // What an empty result list says: a search by meaning that found nothing says so (the
  // server keeps only notes over its floor, so "nothing" is an answer, not a failure).
  function nothingLine(answer) {
    if (!answer.fallback && answer.mode === "semantic")
      return "Nothing found near this in meaning.";
    if (!answer.fallback && answer.mode === "hybrid")
      return "Nothing found by words or by meaning.";
    return "Nothing found. Try fewer words, or pre* for a prefix.";
  }

  // Markdown as plain text, for every preview and snippet the page shows: pictures go, links
  // keep their words, marks of headings, lists, tasks, quotes, emphasis and code go (as the
  // server's note_preview does); then what a cut snippet leaves half of. (No lookbehind:
  // older Safari refuses the whole script for one.)
  function plainSnippet(text) {
    return text
      .replace(/!\[[^\]\n]*\]\([^)\n]*\)/g, "")
      .replace(/!?\[\[(?:[^\]|\n]*\|)?([^\]\n]*)\]\]/g, "$1")
      .replace(/\[([^\]\n]*)\]\([^)\n]*\)/g, "$1")
      .replace(
        /^[ \t]{0,3}(?:#{1,6}[ \t]+|>[ \t]?|[-*+][ \t]+(?:\[[ xX]\][ \t]+)?|\d{1,9}[.)][ \t]+)/gm,
        "",
      )
      .replace(/^\s*(?:```|~~~).*$|^\s*\|?[-:| ]{3,}\|?\s*$/gm, "")
      .replace(/(\*\*|__|~~|==|`+|\*|_)(?=\S)([^\n]*?\S)\1/g, "$2")
      .replace(/\]\([^)\s]*\)?/g, "]")
      .replace(/\[[ xX]\]/g, "")
      .replace(/!?\[\[|\]\]|!\[|[[\]]|\*\*|__|`+|~~|==/g, "")
      .replace(/(^|\s)(#{1,6}|>|[-*+]|\|[-:| ]*\|?)(?=\s)/g, "$1")
      .replace(/\|/g, " ")
      .replace(/\s+/g, " ")
      .trim();
  }

  // A note's preview in a list: the text after its title (a heading, else the first line),
  // without front matter or marks, at most 160 characters: what the server's listing gives.
  function notePreview(content) {
    const text = content.slice(0, 160 * 8).replace(/\r\n?/g, "\n");
    const fm = /^---\n[\s\S]*?\n(?:---|\.\.\.)[ \t]*(?:\n|$)/.exec(text);
    const lines = (fm ? text.slice(fm[0].length) : text).split("\n");
    const first = lines.findIndex((l) => l.trim());
    return plainSnippet(first < 0 ? "" : lines.slice(first + 1).join("\n")).slice(0, 160);
  }

  function sizeText(n) {
    return n < 1024
      ? n + " B"
      : n < 1048576
        ? (n / 1024).toFixed(1) + " KB"
        : (n / 1048576).toFixed(1) + " MB";
  }

  return {
    fileName,
    fold,
    isAttachmentName,
    lexicalOnly,
    meaningLine,
    nameOf,
    nothingLine,
    notePreview,
    plainSnippet,
    queryWords,
    relativeTo,
    sizeText,
    toNotePath,
  };
})();

if (typeof module !== "undefined") module.exports = paths;
