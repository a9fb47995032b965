"use strict";
// node --test web/test/: the outbox (web/outbox.js).
const test = require("node:test");
const assert = require("node:assert/strict");
const {
  queueSave,
  queueCreate,
  queueCapture,
  queueUpload,
  queueVoice,
  relink,
  pendingFile,
  uploadBytes,
  settle,
  markSent,
  nextItem,
  waiting,
} = require("../outbox.js");

function ids() {
  let n = 0;
  return () => "k" + ++n;
}

test("saves of one note become one, from the version the first started from", () => {
  const id = ids();
  let q = queueSave([], "notes/a.md", '"v1"', "one", id);
  q = queueSave(q, "notes/b.md", '"w1"', "other", id);
  q = queueSave(q, "notes/a.md", '"v2"', "one two", id);
  assert.deepEqual(
    q.map((i) => [i.path, i.base, i.content]),
    [
      ["notes/a.md", '"v1"', "one two"],
      ["notes/b.md", '"w1"', "other"],
    ],
  );
  assert.notEqual(q[0].key, "k2"); // new text: a new key, never the answer to the old one
  assert.equal(waiting(q), "2 changes wait to be sent");
  assert.equal(waiting([]), "");
});

test("a save already sent is not changed: the next one queues behind it", () => {
  const id = ids();
  let q = queueSave([], "notes/a.md", '"v1"', "one", id);
  q = [{...q[0], sent: true}];
  q = queueSave(q, "notes/a.md", '"v1"', "one two", id);
  assert.equal(q.length, 2);
});

test("a create already sent once (its answer lost) is queued with the key it went with", () => {
  const id = ids();
  const q = queueCreate([], "new:k1", "notes/inbox", "# Shopping", id, "k1");
  assert.equal(q[0].key, "k1"); // the server answers it as the first: made once
  assert.notEqual(queueCreate([], "new:2", "", "x", id)[0].key, undefined); // else a new one
});

test("a note made offline keeps its edits in its create, then gets its path", () => {
  const id = ids();
  let q = queueCreate([], "new:1", "notes/inbox", "# Shopping", id);
  q = queueSave(q, "new:1", null, "# Shopping\n- milk", id);
  assert.equal(q.length, 1);
  assert.equal(q[0].content, "# Shopping\n- milk");
  q = [{...q[0], sent: true}];
  q = queueSave(q, "new:1", null, "# Shopping\n- milk\n- eggs", id);
  q = queueCapture(q, "a shared link", [], id);
  q = settle(q, q[0], {path: "notes/inbox/Shopping.md", etag: '"s1"'});
  assert.deepEqual(
    q.map((i) => [i.kind, i.path, i.base]),
    [
      ["save", "notes/inbox/Shopping.md", '"s1"'],
      ["capture", undefined, undefined],
    ],
  );
});

test("every item has its own idempotency key", () => {
  const id = ids();
  let q = queueSave([], "notes/a.md", '"v1"', "x", id);
  q = queueCreate(q, "new:2", "notes/inbox", "y", id);
  q = queueCapture(q, "z", [], id);
  assert.equal(new Set(q.map((i) => i.key)).size, 3);
});

test("a save on its way is not changed: the next edit queues anew, from the version it made", () => {
  const id = ids();
  let q = queueSave([], "notes/a.md", '"v1"', "one", id);
  q = markSent(q, q[0]);
  q = queueSave(q, "notes/a.md", '"v1"', "one two", id);
  assert.equal(q.length, 2);
  assert.equal(q[0].content, "one");
  q = settle(q, q[0], {path: "notes/a.md", etag: '"v2"'});
  assert.deepEqual(
    q.map((i) => [i.path, i.base, i.content]),
    [["notes/a.md", '"v2"', "one two"]],
  );
});

test("the share sheet's items wait for a yes; the others go past them", () => {
  const id = ids();
  const held = {id: "s", kind: "capture", key: "s", text: "from a web page", ask: true};
  const q = queueSave([held], "notes/a.md", '"v1"', "one", id);
  assert.equal(nextItem(q).path, "notes/a.md");
  assert.equal(nextItem([held]), null);
});

test("a file put into a note offline goes before the edit that links it", () => {
  const id = ids();
  const file = {name: "shelf.png", size: 67};
  let q = queueSave([], "notes/a.md", '"v1"', "typed", id);
  q = queueUpload(q, "attachments/1-shelf.png", "notes/a.md", file, id);
  q = queueSave(q, "notes/a.md", '"v1"', "typed\n![shelf.png](../attachments/1-shelf.png)", id);
  q = queueSave(
    q,
    "notes/a.md",
    '"v1"',
    "typed\n![shelf.png](../attachments/1-shelf.png)\nmore",
    id,
  );
  assert.deepEqual(
    q.map((i) => [i.kind, i.content]),
    [
      ["save", "typed"],
      ["upload", undefined],
      ["save", "typed\n![shelf.png](../attachments/1-shelf.png)\nmore"],
    ],
  );
  assert.equal(pendingFile(q, "attachments/1-shelf.png"), file);
  assert.equal(uploadBytes(q), 67);
  // kept under another name (the first was taken): the queued edit links that one
  q = settle(q, q[0], {path: "notes/a.md", etag: '"v2"'});
  q = relink(q, "notes/a.md", "../attachments/1-shelf.png", "../attachments/1-shelf-2.png");
  q = settle(q, q[0], {path: "attachments/1-shelf-2.png"});
  assert.deepEqual(
    q.map((i) => [i.kind, i.base, i.content]),
    [["save", '"v2"', "typed\n![shelf.png](../attachments/1-shelf-2.png)\nmore"]],
  );
});

test("a recording made offline waits with the key it may have been sent with, and counts", () => {
  const id = ids();
  const file = {size: 5000};
  let q = queueVoice([], file, "sent-once", 1700000000000, id);
  q = queueVoice(q, {size: 100}, "", 1700000001000, id);
  assert.deepEqual(
    q.map((i) => [i.kind, i.key, i.at]),
    [
      ["voice", "sent-once", 1700000000000],
      ["voice", "k3", 1700000001000],
    ],
  );
  assert.equal(uploadBytes(q), 5100);
  assert.equal(nextItem(q).file, file);
});
