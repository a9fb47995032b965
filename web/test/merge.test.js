"use strict";
// node --test web/test/: diffs and merges (web/merge.js), the same cases as the server's.
const test = require("node:test");
const assert = require("node:assert/strict");
const {matches, merge3, wordDiff} = require("../merge.js");

function lcs(a, b) {
  const dp = Array.from({length: a.length + 1}, () => new Array(b.length + 1).fill(0));
  for (let i = a.length - 1; i >= 0; i--) {
    for (let j = b.length - 1; j >= 0; j--) {
      dp[i][j] = a[i] === b[j] ? dp[i + 1][j + 1] + 1 : Math.max(dp[i + 1][j], dp[i][j + 1]);
    }
  }
  return dp[0][0];
}

test("matches: valid, in order, and as long as the longest common subsequence", () => {
  let seed = 7;
  const rnd = () => (seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648;
  for (let round = 0; round < 300; round++) {
    const a = Array.from({length: Math.floor(rnd() * 12)}, () => "abc"[Math.floor(rnd() * 3)]);
    const b = Array.from({length: Math.floor(rnd() * 12)}, () => "abc"[Math.floor(rnd() * 3)]);
    const runs = matches(a, b);
    let total = 0;
    let lastX = 0;
    let lastY = 0;
    for (const [x, y, len] of runs) {
      assert.ok(x >= lastX && y >= lastY, JSON.stringify({a, b, runs}));
      for (let k = 0; k < len; k++) assert.equal(a[x + k], b[y + k]);
      lastX = x + len;
      lastY = y + len;
      total += len;
    }
    assert.equal(total, lcs(a, b), JSON.stringify({a, b, runs}));
  }
});

const CASES = [
  // [what, base, current, edit, merged text or null for a conflict]
  ["disjoint", "a\nb\nc\nd\n", "A\nb\nc\nd\n", "a\nb\nc\nD\n", "A\nb\nc\nD\n"],
  ["adjacent lines", "a\nb\nc\n", "A\nb\nc\n", "a\nB\nc\n", "A\nB\nc\n"],
  ["the same line", "a\nb\nc\n", "a\nX\nc\n", "a\nY\nc\n", null],
  ["the same change twice", "a\nb\n", "a\nB\n", "a\nB\n", "a\nB\n"],
  ["a deletion and an edit elsewhere", "a\nb\nc\n", "a\nc\n", "a\nb\nC\n", "a\nC\n"],
  ["a deletion of what the edit changed", "a\nb\nc\n", "a\nc\n", "a\nB\nc\n", null],
  ["both append", "a\n", "a\nb\n", "a\nc\n", null],
  ["one appends, one prepends", "a\n", "a\nz\n", "0\na\n", "0\na\nz\n"],
  ["CRLF against LF", "a\nb\nc\n", "a\r\nb\r\nc\r\n", "a\nb\nC\n", "a\r\nb\r\nC\n"],
  ["no newline at the end", "a\nb", "a\nb\nc", "A\nb", "A\nb\nc\n"],
  ["an empty base", "", "x\n", "x\n", "x\n"],
  ["nothing changed", "a\n", "a\n", "a\n", "a\n"],
  ["an applied edit sent again", "a\nb\n", "a\nB\nc\n", "a\nb\nc\n", "a\nB\nc\n"],
];

for (const [what, base, current, edit, merged] of CASES) {
  test("merge3: " + what, () => {
    const got = merge3(base, current, edit);
    if (merged === null) assert.equal(got.conflict, true);
    else assert.deepEqual(got, {text: merged, conflict: false});
  });
}

test("wordDiff: what changed, word by word, the rest as it was", () => {
  assert.deepEqual(wordDiff("buy oat milk today", "buy soy milk today"), [
    {op: "same", text: "buy "},
    {op: "del", text: "oat"},
    {op: "add", text: "soy"},
    {op: "same", text: " milk today"},
  ]);
  // a change of several words reads as one
  assert.deepEqual(wordDiff("The keys are in the blue jar.", "The keys are in the red tin now."), [
    {op: "same", text: "The keys are in the "},
    {op: "del", text: "blue jar."},
    {op: "add", text: "red tin now."},
  ]);
  assert.deepEqual(wordDiff("a b c d", "a x y d"), [
    {op: "same", text: "a "},
    {op: "del", text: "b c"},
    {op: "add", text: "x y"},
    {op: "same", text: " d"},
  ]);
  assert.deepEqual(wordDiff("", "new"), [{op: "add", text: "new"}]);
  assert.deepEqual(wordDiff("same", "same"), [{op: "same", text: "same"}]);
  const joined = (ops, skip) =>
    ops
      .filter((o) => o.op !== skip)
      .map((o) => o.text)
      .join("");
  const a = "# Pie\n\n- [ ] flour\n- [x] eggs\n";
  const b = "# Apple pie\n\n- [x] flour\n- [x] eggs\n- [ ] butter\n";
  assert.equal(joined(wordDiff(a, b), "add"), a);
  assert.equal(joined(wordDiff(a, b), "del"), b);
});

test("a diff of two unrelated long texts is bounded: one change in the middle", () => {
  const words = (seed, n) =>
    Array.from({length: n}, (_, i) => "w" + ((i * 7919 + seed * 104729) % 100003));
  const a = ["same", ...words(1, 60000), "end"];
  const b = ["same", ...words(2, 60000), "end"];
  const started = Date.now();
  assert.deepEqual(matches(a, b), [
    [0, 0, 1],
    [60001, 60001, 1],
  ]);
  assert.ok(Date.now() - started < 5000);
  const diff = wordDiff(a.join(" "), b.join(" "));
  assert.equal(diff.filter((p) => p.op === "same").length, 2);
  // a merge past the bound keeps the page's text and calls it a conflict, never a mix
  const m = merge3(a.join("\n"), b.join("\n"), ["same", ...words(3, 60000), "end"].join("\n"));
  assert.equal(m.conflict, true);
});
