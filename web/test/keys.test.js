"use strict";
// node --test web/test/: which key goes where (web/keys.js).
const test = require("node:test");
const assert = require("node:assert/strict");
const {sameOrigin, keptEntry, keyFor, pairTarget, groupCode} = require("../keys.js");

const HERE = "https://abcdefghijklmnopqrst.relay.example/?relayCode=x";
const STRANGER = "https://zzzzzzzzzzzzzzzzzzzz.relay.example";

test("sameOrigin: relative paths are here; other hosts, ports and schemes are not", () => {
  for (const [url, same] of [
    ["/api/v1", true],
    ["api/v1", true],
    ["https://abcdefghijklmnopqrst.relay.example/r/x/api/v1", true],
    [STRANGER + "/api/v1", false],
    ["http://abcdefghijklmnopqrst.relay.example/api/v1", false],
    ["https://abcdefghijklmnopqrst.relay.example:8443/api/v1", false],
    ["//evil.example/api/v1", false],
    ["javascript:alert(1)", false],
    ["http://[", false],
  ]) {
    assert.equal(sameOrigin(url, HERE), same, url);
  }
});

test("keptEntry: the first whole pair that names an API path on this origin", () => {
  assert.deepEqual(
    keptEntry(
      [
        [null, null],
        ["nsk_a", "/api/v1"],
      ],
      HERE,
    ),
    {
      key: "nsk_a",
      base: "/api/v1",
    },
  );
  assert.deepEqual(
    keptEntry(
      [
        ["nsk_s", "/r/s/api/v1"],
        ["nsk_a", "/api/v1"],
      ],
      HERE,
    ).key,
    "nsk_s",
  );
  for (const pairs of [
    [["nsk_a", null]], // a key without the base it was given for is never used
    [[null, "/api/v1"]],
    [["nsk_a", STRANGER + "/api/v1"]], // another origin
    [["nsk_a", "https://abcdefghijklmnopqrst.relay.example/api/v1"]], // absolute: not trusted
    [["nsk_a", "javascript:alert(1)"]],
    [],
  ]) {
    assert.equal(keptEntry(pairs, HERE), null, JSON.stringify(pairs));
  }
});

test("keyFor: a typed key goes where it was typed; a kept one only to its own base", () => {
  const kept = {key: "nsk_mine", base: "/api/v1"};
  for (const [base, typed, want] of [
    ["/api/v1", "", "nsk_mine"],
    ["/api/v1", "nsk_typed", "nsk_typed"],
    ["/r/zzzzzzzzzzzzzzzzzzzz/api/v1", "", ""], // a stranger's code: nothing is sent
    ["/r/zzzzzzzzzzzzzzzzzzzz/api/v1", "nsk_typed", "nsk_typed"],
    ["/api/v1/", "", ""], // not the same base
  ]) {
    assert.equal(keyFor(base, typed, kept), want, base + " " + typed);
  }
  assert.equal(keyFor("/api/v1", "", null), "");
});

test("pairTarget: another server's own origin is opened, never talked to from here", () => {
  const cases = [
    [{serverId: "zzzzzzzzzzzzzzzzzzzz", origin: STRANGER}, {open: STRANGER + "/"}],
    [{serverId: "abcdefghijklmnopqrst", relayApiBase: "/api/v1"}, {base: "/api/v1"}],
    [
      {
        serverId: "abcdefghijklmnopqrst",
        relayApiBase: "https://abcdefghijklmnopqrst.relay.example/api/v1/",
        origin: "https://abcdefghijklmnopqrst.relay.example",
      },
      {base: "/api/v1"},
    ],
    // an API base on another origin is never used: the server's prefix here instead
    [{serverId: "s1", relayApiBase: "https://evil.example/r/s1/api/v1"}, {base: "/r/s1/api/v1"}],
    // an origin that is not <serverId>.<domain> is not opened
    [{serverId: "s1", origin: "https://evil.example"}, {base: "/r/s1/api/v1"}],
    [{serverId: "s1", origin: "javascript:alert(1)//"}, {base: "/r/s1/api/v1"}],
    [{serverId: "../../x"}, null],
    [{}, null],
    [null, null],
  ];
  for (const [data, want] of cases) {
    assert.deepEqual(pairTarget(data, HERE), want, JSON.stringify(data));
  }
});

test("groupCode: a pairing secret in groups of four, as a person types it", () => {
  assert.equal(groupCode("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), "abcd-efgh-ijkl-mnop-qrst-uvwx-yz");
  assert.equal(groupCode("ab cd-ef"), "abcd-ef");
  assert.equal(groupCode(""), "");
});
