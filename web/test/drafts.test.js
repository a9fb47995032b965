"use strict";
// node --test web/test/: the drafts this browser keeps (web/drafts.js). The lifecycle: a
// draft belongs to one note (a new note's is "new:<its create's key>"); it is kept while the
// note has unsaved text and dies once the text is safe (saved, merged, sent from the outbox,
// or handed to it); a note opened with one gets it back; *New note* is always blank, and a
// new note's draft left by a closed tab is sent at the next start.
const test = require("node:test");
const assert = require("node:assert/strict");
const drafts = require("../drafts.js");

const {NEW_NOTE, key, newName, isNew, createKey, nameFor, record, parse, onKeep, onOpen} = drafts;

test("a draft is named by its server and its note; each new note has its own", () => {
  assert.equal(key("/api", "notes/a.md"), "notesvc.draft:/api|notes/a.md");
  assert.equal(key("/api", newName("k1")), "notesvc.draft:/api|new:k1");
  assert.equal(nameFor(true, null, "k1"), "new:k1");
  assert.equal(nameFor(true, null, "k2"), "new:k2"); // the next new note: another draft
  assert.equal(nameFor(false, "notes/a.md", "k1"), "notes/a.md");
  assert.equal(nameFor(false, "new:k1", "k1"), "new:k1"); // queued offline: the same name
  assert.equal(nameFor(false, null, "k1"), null); // no note open: none
  assert.equal(isNew("new:k1"), true);
  assert.equal(isNew("notes/new:x.md"), false);
  assert.equal(isNew(NEW_NOTE), false); // an older page's one draft: not sent by itself
  assert.equal(isNew(null), false);
  assert.equal(createKey("new:k1"), "k1"); // its create's Idempotency-Key
  assert.equal(createKey("notes/a.md"), null);
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

test("kept while unsaved, dropped once safe: a new note's too", () => {
  assert.equal(onKeep("notes/a.md", true, true), "keep");
  assert.equal(onKeep("new:k1", true, true), "keep");
  assert.equal(onKeep("notes/a.md", false, true), "drop");
  // A new note queued in the outbox, or emptied: nothing unsaved, so its draft goes. (Before,
  // a new note's draft stayed until the server answered its own create, so one queued
  // offline outlived its sending and came back in the next new note.)
  assert.equal(onKeep("new:k1", false, true), "drop");
  // with no key, what the copy on this device left as drafts stays
  assert.equal(onKeep("notes/a.md", false, false), "");
  assert.equal(onKeep(null, true, true), ""); // no note open
});

test("at the start, the new notes a closed tab left are sent, or join the outbox", () => {
  const kept = {
    "new:k1": {content: "Shopping\n\nmilk", at: 0},
    "new:k2": {content: "Queued\n\nmore typed", at: 0},
    "new:k3": {content: " \n", at: 0},
    "notes/a.md": {content: "an edit", etag: '"v1"', at: 0},
    [NEW_NOTE]: {content: "an older page's", at: 0},
  };
  const read = (name) => kept[name] || null;
  const items = [
    {id: "1", kind: "create", key: "k2", local: "new:k2", folder: "", content: "Queued\n"},
    {id: "2", kind: "save", key: "s", path: "notes/a.md", base: '"v1"', content: "x"},
  ];
  assert.deepEqual(drafts.onStart(Object.keys(kept), read, items), [
    ["new:k1", "send"], // sent now, with k1 as its key
    ["new:k2", "queue"], // its create waits: the text typed since joins it
    ["new:k3", "drop"], // no words
  ]);
  assert.deepEqual(drafts.onStart(["new:k1"], read, undefined), [["new:k1", "send"]]);
  assert.deepEqual(drafts.onStart(["new:gone"], read, []), [["new:gone", "drop"]]);
});

test("sent from the outbox: the draft holding that text dies", () => {
  const draft = {content: "Made offline\n\non the train", at: 0};
  assert.equal(drafts.onSent(draft, "Made offline\n\non the train", true), "drop");
  assert.equal(drafts.onSent(draft, "Made offline\n\non the train", false), "drop");
  // typed on since it was queued: a new note's becomes the made note's draft; an edit's stays
  assert.equal(drafts.onSent(draft, "Made offline\n", true), "move");
  assert.equal(drafts.onSent(draft, "Made offline\n", false), "");
  assert.equal(drafts.onSent(null, "x", true), "");
});

test("opening a note: a draft with other text comes back, one with the same goes", () => {
  const draft = {content: "mine", etag: '"v1"', at: 0};
  assert.equal(onOpen(draft, "theirs"), "restore");
  assert.equal(onOpen(draft, "mine"), "drop");
  assert.equal(onOpen({...draft, content: ""}, "theirs"), "restore"); // emptied: that too
  assert.equal(onOpen(null, "theirs"), "");
});

test("an older page's one new-note draft comes back once when it holds words", () => {
  assert.equal(drafts.restoresNew({content: "# Shopping", at: 0}), true);
  assert.equal(drafts.restoresNew({content: " \n\n", at: 0}), false);
  assert.equal(drafts.restoresNew(null), false);
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

test("an outbox let go: each note and each new note keeps its own draft", () => {
  const items = [
    {id: "1", kind: "save", key: "a", path: "notes/a.md", base: '"v1"', content: "edit a"},
    {id: "2", kind: "create", key: "b", local: "new:1", folder: "", content: "# New"},
    {id: "3", kind: "capture", key: "c", text: "captured", files: [], at: "t"},
    {id: "4", kind: "capture", key: "d", text: "from another site", ask: true},
    {id: "5", kind: "capture", key: "e", text: "", files: ["f"]},
    {id: "6", kind: "capture", key: "f", text: "shared too", files: [], at: "t"},
  ];
  assert.deepEqual(drafts.fromOutbox(items, 9, "new:loose"), [
    ["notes/a.md", record("edit a", '"v1"', 9)],
    ["new:1", record("# New", null, 9)], // sent at the next start, as its own note
    ["new:loose", record("captured\n\nshared too", null, 9)],
  ]);
  assert.deepEqual(drafts.fromOutbox(items.slice(0, 1), 9, "new:loose"), [
    ["notes/a.md", record("edit a", '"v1"', 9)],
  ]);
  assert.deepEqual(drafts.fromOutbox(undefined, 9, "new:loose"), []);
});
