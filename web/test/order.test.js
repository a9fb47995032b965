"use strict";
// node --test web/test/: the order of lists (web/order.js).
const test = require("node:test");
const assert = require("node:assert/strict");
const {newestFirst, folderListing, firstOfEachName} = require("../order.js");

test("the recent list: newest first, ties as they came", () => {
  const notes = [
    {path: "a", modified: "2024-05-01T10:00:00Z"},
    {path: "b", modified: "2024-05-03T09:00:00Z"},
    {path: "c", modified: "2024-05-01T10:00:00Z"},
    {path: "d", modified: "2024-05-02T23:59:59Z"},
  ];
  assert.deepEqual(
    newestFirst(notes).map((n) => n.path),
    ["b", "d", "a", "c"],
  );
  assert.deepEqual(
    notes.map((n) => n.path),
    ["a", "b", "c", "d"],
  ); // the list given is left alone
  assert.deepEqual(newestFirst([]), []);
});

test("a folder's listing: its folders with their counts, then its notes, each by name", () => {
  const paths = [
    "notes/zebra.md",
    "notes/b/two.md",
    "notes/Apple.md",
    "notes/b/deep/three.md",
    "notes/a/one.md",
    "notesother/x.md",
    "attachments/notes/y.md",
  ];
  assert.deepEqual(folderListing(paths, "notes"), {
    children: [
      {type: "folder", name: "a", path: "notes/a", count: 1},
      {type: "folder", name: "b", path: "notes/b", count: 2},
      {type: "note", name: "Apple.md", path: "notes/Apple.md"},
      {type: "note", name: "zebra.md", path: "notes/zebra.md"},
    ],
  });
  assert.deepEqual(folderListing(paths, "notes/b"), {
    children: [
      {type: "folder", name: "deep", path: "notes/b/deep", count: 1},
      {type: "note", name: "two.md", path: "notes/b/two.md"},
    ],
  });
  assert.deepEqual(folderListing(paths, "notes/none"), {children: []});
});

test("a name names the first of its name in path order, whatever its case", () => {
  const fileName = (p) => p.split("/").pop();
  const paths = ["attachments/z/Photo.JPG", "attachments/b/photo.jpg", "attachments/a.png"];
  const first = firstOfEachName(paths, fileName);
  assert.equal(first.get("photo.jpg"), "attachments/b/photo.jpg");
  assert.equal(first.get("a.png"), "attachments/a.png");
  assert.equal(first.get("Photo.JPG"), undefined); // asked in lower case
  assert.equal(paths[0], "attachments/z/Photo.JPG"); // the list given is left alone
  const nameOf = (p) => fileName(p).replace(/\.md$/, "");
  const notes = ["notes/work/Plan.md", "notes/Plan.md", "notes/home/plan.md"];
  assert.equal(firstOfEachName(notes, nameOf).get("plan"), "notes/Plan.md");
});
