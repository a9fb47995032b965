"use strict";
// node --test web/test/: lists in the editor (web/lists.js): Enter and the checklist button.
const test = require("node:test");
const assert = require("node:assert/strict");
const lists = require("../lists.js");

// "|" marks the caret (or "«" and "»" a selection) in a picture of the text.
function parse(pic) {
  if (pic.includes("|")) {
    const at = pic.indexOf("|");
    return [pic.replace("|", ""), at, at];
  }
  const a = pic.indexOf("«");
  const b = pic.indexOf("»") - 1;
  return [pic.replace("«", "").replace("»", ""), a, b];
}
function picture(text, start, end) {
  if (start === end) return text.slice(0, start) + "|" + text.slice(start);
  return text.slice(0, start) + "«" + text.slice(start, end) + "»" + text.slice(end);
}
function run(fn, pic) {
  const [text, start, end] = parse(pic);
  const edit = fn(text, start, end);
  if (!edit) return null;
  return picture(lists.apply(text, edit), edit.start, edit.end);
}

test("Enter continues a list, keeping its indent; a task goes on open", () => {
  for (const [before, after] of [
    ["- [ ] passport|", "- [ ] passport\n- [ ] |"],
    ["- [x] tickets|", "- [x] tickets\n- [ ] |"],
    ["- milk|", "- milk\n- |"],
    ["* eggs|\n* flour", "* eggs\n* |\n* flour"],
    ["1. one|", "1. one\n2. |"],
    ["9) nine|", "9) nine\n10) |"],
    ["# Trip\n  - [ ] socks|", "# Trip\n  - [ ] socks\n  - [ ] |"],
    ["- take| both", "- take\n- | both"],
  ]) {
    assert.equal(run(lists.onEnter, before), after, before);
  }
});

test("Enter on an empty item ends the list: its marker goes, a blank line stays", () => {
  for (const [before, after] of [
    // the blank line ends the list: what is typed next is a paragraph, not the last task's
    ["- [ ] passport\n- [ ] |", "- [ ] passport\n\n|"],
    ["- a\n- |\n\nnext", "- a\n\n|\n\nnext"],
    ["1. a\n2. |", "1. a\n\n|"],
    ["# Trip\n  - [ ] socks\n  - [ ] |", "# Trip\n  - [ ] socks\n\n|"],
    // nothing above to keep apart: the marker goes, the caret stays on its line
    ["  - [x] |", "|"],
    ["intro\n\n- |", "intro\n\n|"],
  ]) {
    assert.equal(run(lists.onEnter, before), after, before);
  }
  // typed after the list ends, a line is a paragraph of its own (web/markdown.js)
  const ended = lists.apply(
    "- [x] passport\n- [ ] ",
    lists.onEnter("- [x] passport\n- [ ] ", 21, 21),
  );
  assert.equal(ended + "Done.", "- [x] passport\n\nDone.");
});

test("Enter elsewhere is a plain Enter", () => {
  for (const pic of ["plain line|", "|- item", "-| item", "", "- a«\n- b»", "#| heading", "-x|"]) {
    const [text, start, end] = parse(pic || "|");
    assert.equal(lists.onEnter(text, start, end), null, pic);
  }
});

test("the checklist button makes the caret's line a task, and a task a plain line", () => {
  for (const [before, after] of [
    ["passport|", "- [ ] passport|"],
    ["|", "- [ ] |"],
    ["- item|", "- [ ] item|"],
    ["* it|em", "* [ ] it|em"],
    ["1. first|", "1. [ ] first|"],
    ["  indented|", "  - [ ] indented|"],
    ["- [ ] passport|", "passport|"],
    ["- [x] do|ne", "do|ne"],
    ["- [|x] done", "|done"],
    ["# Trip\nsocks|\nshoes", "# Trip\n- [ ] socks|\nshoes"],
  ]) {
    assert.equal(run(lists.toggleTask, before), after, before);
  }
});

test("the checklist button on selected lines: all become tasks, or all lose it", () => {
  for (const [before, after] of [
    ["«a\nb\nc»", "«- [ ] a\n- [ ] b\n- [ ] c»"],
    ["x\n«a\n\n- [ ] b\n»c", "x\n«- [ ] a\n\n- [ ] b\n»c"],
    ["«- [ ] a\n- [x] b»", "«a\nb»"],
    ["- [ ] a\n- [x] «b\n»", "- [ ] a\n«b\n»"],
    ["- [ ] a\n«b\n»", "- [ ] a\n«- [ ] b\n»"],
  ]) {
    assert.equal(run(lists.toggleTask, before), after, before);
  }
});

test("caretFor: a tap on formatted text puts the caret at that place in the source", () => {
  const text =
    "# Trip\n\nFirst paragraph here.\n\nThe **second** one, with a [link](x.md) in it.\n";
  const second = text.indexOf("The");
  assert.equal(lists.caretFor(text, 4, 4, ""), second);
  assert.equal(lists.caretFor(text, 4, 4, "The second"), text.indexOf("** one"));
  assert.equal(lists.caretFor(text, 4, 4, "The second one, with a li"), text.indexOf("nk]"));
  assert.equal(lists.caretFor(text, 0, 0, "Tr"), 4);
  const items = "- [ ] passport\n- [ ] socks and shoes";
  assert.equal(lists.caretFor(items, 1, 1, "socks"), items.indexOf(" and"));
  const lines = "one line\nand the next";
  assert.equal(lists.caretFor(lines, 0, 1, "one line\nand"), lines.indexOf(" the"));
});

test("lineAt and lineStart", () => {
  assert.deepEqual(lists.lineAt("ab\ncd\n", 4), [3, 5]);
  assert.deepEqual(lists.lineAt("ab", 0), [0, 2]);
  assert.equal(lists.lineStart("ab\ncd\nef", 2), 6);
  assert.equal(lists.lineStart("ab", 5), 2);
});
