"use strict";
// node --test web/test/: the drafts this browser keeps (web/drafts.js). The lifecycle: a
// draft is kept while the open note has unsaved text, dropped once it is saved (a new
// note's only when the server made it), restored when the note (or a new note) opens.
const test = require("node:test");
const assert = require("node:assert/strict");
const drafts = require("../drafts.js");

const {NEW_NOTE, key, nameFor, record, parse, onKeep, onOpen, restoresNew} = drafts;

test("a draft is named by its server and its note; a new note has one", () => {
  assert.equal(key("/api", "notes/a.md"), "notesvc.draft:/api|notes/a.md");
  assert.equal(key("/api", NEW_NOTE), "notesvc.draft:/api|(new note)");
  assert.equal(nameFor(true, null), NEW_NOTE);
  assert.equal(nameFor(true, "notes/a.md"), NEW_NOTE);
  assert.equal(nameFor(false, "notes/a.md"), "notes/a.md");
  assert.equal(nameFor(false, null), null); // no note open: none
});

test("kept as JSON, read back; what cannot be read is no draft", () => {
  assert.equal(record("text", '"v1"', 5), '{"content":"text","etag":"\\"v1\\"","at":5}');
  assert.equal(record("text", null, 5), '{"content":"text","etag":null,"at":5}');
  assert.equal(record("text", undefined, 5), '{"content":"text","at":5}'); // a copy's
  assert.deepEqual(parse(record("text", '"v1"', 5)), {content: "text", etag: '"v1"', at: 5});
  assert.equal(parse(null), null);
  assert.equal(parse(""), null);
  assert.equal(parse("{not json"), null);
});

test("kept while unsaved, dropped once saved; a new note's stays until it is made", () => {
  assert.equal(onKeep("notes/a.md", true, false, true), "keep");
  assert.equal(onKeep(NEW_NOTE, true, true, true), "keep");
  assert.equal(onKeep("notes/a.md", false, false, true), "drop");
  // A new note's draft is not dropped here: it goes when the server answers its create.
  // (As it is now, a new note made offline is queued and that draft stays behind.)
  assert.equal(onKeep(NEW_NOTE, false, true, true), "");
  // with no key, what the copy on this device left as drafts stays
  assert.equal(onKeep("notes/a.md", false, false, false), "");
  assert.equal(onKeep(null, true, false, true), ""); // no note open
  // a note made offline ("new:..." until it is sent) keeps its draft under that name
  assert.equal(onKeep("new:1", true, false, true), "keep");
});

test("opening a note: a draft with other text comes back, one with the same goes", () => {
  const draft = {content: "mine", etag: '"v1"', at: 0};
  assert.equal(onOpen(draft, "theirs"), "restore");
  assert.equal(onOpen(draft, "mine"), "drop");
  assert.equal(onOpen({...draft, content: ""}, "theirs"), "restore"); // emptied: that too
  assert.equal(onOpen(null, "theirs"), "");
});

test("a new note's draft comes back when it holds words", () => {
  assert.equal(restoresNew({content: "# Shopping", at: 0}), true);
  assert.equal(restoresNew({content: " \n\n", at: 0}), false);
  assert.equal(restoresNew(null), false);
});

test("what the page says of a draft that is back", () => {
  const at = Date.UTC(2024, 4, 1, 9, 30);
  const when = new Date(at).toLocaleString();
  const draft = {content: "mine", etag: '"v1"', at};
  assert.equal(drafts.notice(draft, '"v1"'), "Your unsaved draft from " + when + " is back.");
  assert.equal(
    drafts.notice(draft, '"v2"'),
    "Your unsaved draft from " + when + " is back. The note has changed since then.",
  );
  // a draft with no version (a conflict copy's text kept here) says nothing of changes
  assert.equal(
    drafts.notice({content: "x", at}, '"v2"'),
    "Your unsaved draft from " + when + " is back.",
  );
  assert.equal(drafts.newNotice({content: "x", at}), "Your new note from " + when + " is back.");
});

test("an outbox let go: edits become their notes' drafts, the rest one new note's", () => {
  const items = [
    {id: "1", kind: "save", key: "a", path: "notes/a.md", base: '"v1"', content: "edit a"},
    {id: "2", kind: "create", key: "b", local: "new:1", folder: "", content: "# New"},
    {id: "3", kind: "capture", key: "c", text: "captured", files: [], at: "t"},
    {id: "4", kind: "capture", key: "d", text: "from another site", ask: true},
    {id: "5", kind: "capture", key: "e", text: "", files: ["f"]},
  ];
  const kept = drafts.fromOutbox(items, {content: "older new note", at: 1}, 9);
  assert.deepEqual(kept.notes, [["notes/a.md", record("edit a", '"v1"', 9)]]);
  assert.deepEqual(parse(kept.newNote), {content: "older new note\n\n# New\n\ncaptured", at: 9});
  assert.deepEqual(drafts.fromOutbox(items.slice(0, 1), null, 9).newNote, null);
  assert.equal(parse(drafts.fromOutbox(items.slice(1, 2), null, 9).newNote).content, "# New");
  assert.deepEqual(drafts.fromOutbox(undefined, null, 9), {notes: [], newNote: null});
});
