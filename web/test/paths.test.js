"use strict";
// node --test web/test/: names and paths (web/paths.js).
const test = require("node:test");
const assert = require("node:assert/strict");
const paths = require("../paths.js");

test("toNotePath: what a person types becomes a note path", () => {
  for (const [typed, want] of [
    ["ideas", "notes/ideas.md"],
    ["  kitchen/pie ", "notes/kitchen/pie.md"],
    ["/notes/a.md", "notes/a.md"],
    ["notes/A.MD", "notes/A.MD"],
  ]) {
    assert.equal(paths.toNotePath(typed), want);
  }
});

test("relativeTo: the link one note writes to another, as other editors read it", () => {
  for (const [from, to, want] of [
    ["notes/a.md", "notes/b.md", "b.md"],
    ["notes/home/keys.md", "notes/kitchen/pancakes.md", "../kitchen/pancakes.md"],
    ["notes/a.md", "attachments/x/y z.png", "../attachments/x/y%20z.png"],
    ["notes/x/y/z.md", "notes/x/w.md", "../w.md"],
  ]) {
    assert.equal(paths.relativeTo(from, to), want);
  }
});

test("names: a note's name, a file's name, attachments", () => {
  assert.equal(paths.nameOf("notes/kitchen/Pie crust.md"), "Pie crust");
  assert.equal(paths.fileName("attachments/a/b.png"), "b.png");
  for (const [name, attachment] of [
    ["photo.JPG", true],
    ["a/b.pdf", true],
    ["note.md", false],
    ["README", false],
    ["x.toolong", false],
  ]) {
    assert.equal(paths.isAttachmentName(name), attachment, name);
  }
});

test("fold keeps the length, so highlights land where the words are", () => {
  for (const s of ["Crème Brûlée", "ÉÀÇ", "straße", "日本語"]) {
    assert.equal(paths.fold(s).length, s.length, s);
  }
  assert.equal(paths.fold("Crème"), "creme");
});

test("queryWords: what search highlights; excluded words and OR left out", () => {
  // a plural's ending dropped: a prefix of every form of the word
  assert.deepEqual(paths.queryWords('"blue jar" -red pancakes OR crêpes a'), [
    "blue",
    "jar",
    "pancak",
    "crep",
  ]);
});

test("lexicalOnly: phrases and prefixes are searched by words, as the server decides", () => {
  for (const q of ['"car repair"', "car rep*", 'fix "brake pads" -"old car"'])
    assert.equal(paths.lexicalOnly(q), true, q);
  const meaning = ["car repair", '"car" repair', 'car -"old car"', "car -rep*", "a OR b", "- car"];
  for (const q of [...meaning, "e-mail setup", "command-line tool"])
    assert.equal(paths.lexicalOnly(q), false, q);
});

test("meaningLine: the line under the search box, from the answer's embeddings", () => {
  const on = (embedded, total, more) =>
    Object.assign({mode: "hybrid", fallback: false, embeddings: {embedded, total}}, more);
  assert.equal(paths.meaningLine({mode: "keyword", fallback: false}, "car"), ""); // off
  assert.equal(paths.meaningLine({mode: "keyword", fallback: true}, "car"), "");
  assert.equal(paths.meaningLine(on(4, 4), "car"), "Searching by words and meaning");
  assert.equal(
    paths.meaningLine(on(1234, 1250), "car"),
    "Searching by words and meaning · 1,234 of 1,250 notes ready",
  );
  const down = on(4, 4, {mode: "keyword", fallback: true});
  assert.equal(paths.meaningLine(down, "car repair"), "By words only: the model is not answering");
  assert.equal(paths.meaningLine(down, '"car repair"'), 'By words only, as "quotes" and * ask');
  assert.equal(paths.meaningLine(on(4, 4, {mode: "keyword"}), "car"), "By words only");
});

test("nothingLine: an empty answer by meaning says so", () => {
  const answer = (mode, fallback) => ({mode, fallback, total: 0, results: []});
  assert.equal(paths.nothingLine(answer("hybrid", false)), "Nothing found by words or by meaning.");
  assert.equal(paths.nothingLine(answer("semantic", false)), "Nothing found near this in meaning.");
  const words = "Nothing found. Try fewer words, or pre* for a prefix.";
  assert.equal(paths.nothingLine(answer("keyword", false)), words);
  assert.equal(paths.nothingLine(answer("keyword", true)), words); // the model not answering
});

test("plainSnippet: Markdown marks dropped", () => {
  assert.equal(
    paths.plainSnippet("## Keys\n- [x] give **one** to [Anna](notes/a.md) `now`"),
    "Keys give one to Anna now",
  );
});

test("plainSnippet: pictures, links and marks as the server's previews drop them", () => {
  for (const [text, want] of [
    ["![beach](beach.png) at **noon**", "at noon"],
    ["see ![[beach.png]] and [[Pie crust|the crust]]", "see beach.png and the crust"],
    ["# Packing\n1. socks\n> quoted _here_\n```js\nx\n```", "Packing socks quoted here x"],
    ["| a | b |\n|---|---|\n| 1 | 2 |", "a b 1 2"],
    ["…ch.png) cut ![be", "…ch.png) cut be"],
    ["snake_case stays", "snake_case stays"],
  ]) {
    assert.equal(paths.plainSnippet(text), want, text);
  }
});

test("notePreview: the text after the title, without front matter or markup", () => {
  assert.equal(
    paths.notePreview("---\ntags: [a]\n---\n# Pie\n\n- [ ] **2** eggs, see [the shop](s.md)"),
    "2 eggs, see the shop",
  );
  assert.equal(
    paths.notePreview("\nBeach day\n![beach](../attachments/b.png)\n#sea ~~no~~"),
    "#sea no",
  );
  assert.equal(paths.notePreview("Only a title"), "");
  assert.equal(paths.notePreview("T\n" + "word ".repeat(100)).length, 160);
});

test("sizeText", () => {
  assert.deepEqual([0, 1023, 1024, 1536, 1048576 * 3].map(paths.sizeText), [
    "0 B",
    "1023 B",
    "1.0 KB",
    "1.5 KB",
    "3.0 MB",
  ]);
});
