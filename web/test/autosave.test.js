"use strict";
// node --test web/test/: when the open note is saved (web/autosave.js).
const test = require("node:test");
const assert = require("node:assert/strict");
const {naming, wait, retry, sendsAsThePageHides} = require("../autosave.js");

test("a second after the last keystroke", () => {
  // typing began just now, nothing saved for long
  assert.equal(wait(10000, 10000, 0, false), 1000);
});

test("every 3 s while typing goes on", () => {
  // typing since 2.5 s: the save is due in half a second, not a second from now
  assert.equal(wait(12500, 10000, 0, false), 500);
  // typing for longer than 3 s: due at once
  assert.equal(wait(14000, 10000, 0, false), 0);
});

test("never more than one request a second", () => {
  // the last save started 200 ms ago: the next waits until a second after it
  assert.equal(wait(14000, 10000, 13800, false), 800);
  assert.equal(wait(10000, 10000, 9500, false), 1000);
});

test("a new note waits for its first line (or five quiet seconds)", () => {
  assert.equal(naming(true, ""), true);
  assert.equal(naming(true, "# Shopping"), true);
  assert.equal(naming(true, "\n\n  \n"), true); // no words yet
  assert.equal(naming(true, "# Shopping\n"), false);
  assert.equal(naming(true, "\n# Shopping\n- milk"), false);
  assert.equal(naming(false, "no newline"), false); // a note that has its name
  assert.equal(wait(14000, 10000, 0, true), 5000);
  assert.equal(wait(14000, 10000, 13500, true), 5000);
});

test("a failed save is tried again, less and less often, at least once a minute", () => {
  assert.deepEqual(
    [1, 2, 3, 11, 12, 13, 100].map(retry),
    [5000, 10000, 15000, 55000, 60000, 60000, 60000],
  );
});

test("as the page hides a small saved note's edit goes out; otherwise it waits as a draft", () => {
  const open = {
    dirty: true,
    path: "notes/a.md",
    blank: false,
    writes: 0,
    bytes: 64 * 1024,
    key: "k",
    keyBase: "/api",
    base: "/api",
  };
  assert.equal(sendsAsThePageHides(open), true);
  const not = (change) => assert.equal(sendsAsThePageHides({...open, ...change}), false);
  not({dirty: false}); // nothing unsaved
  not({path: null}); // no note open
  not({blank: true}); // a new note: its create waits
  not({writes: 1}); // a save on its way: this one's base would be stale
  not({bytes: 64 * 1024 + 1}); // too large for a request that outlives the page
  not({key: ""}); // no key
  not({keyBase: "/other"}); // the key was given for another server
});
