// -- keys: which key goes where (pure: no page, no storage; node --test web/) ---------------
// A key is kept on a device together with the API base it was given for, and is sent to
// that base only. A pairing code may name any server: what it resolves to decides where
// the page talks, never which key it sends.

// Whether url (absolute or relative to `here`) has the origin of `here`.
const keys = (() => {
  function sameOrigin(url, here) {
    try {
      return new URL(url, here).origin === new URL(here).origin;
    } catch (e) {
      return false;
    }
  }

  // The first kept [key, base] pair that is whole and names an API on this origin (as a
  // path: a kept absolute URL is never trusted); null when there is none.
  function keptEntry(pairs, here) {
    for (const [key, base] of pairs) {
      if (key && base && sameOrigin(base, here) && !/^[a-z][a-z0-9+.-]*:/i.test(base)) {
        return {key, base};
      }
    }
    return null;
  }

  // The key to send to `base`: the one typed, else the kept one if it was kept for `base`.
  function keyFor(base, typed, kept) {
    if (typed) return typed;
    return kept && kept.base === base ? kept.key : "";
  }

  // Where a pairing answer ({serverId, relayApiBase, origin?}) leads: {open: <another
  // server's own page>} to go to, {base: <API path on this origin>}, or null.
  function pairTarget(data, here) {
    const origin = String((data && data.origin) || "");
    if (origin && !sameOrigin(origin, here) && /^https?:\/\/[a-z2-7]{20}\.[^/?#]+$/.test(origin)) {
      return {open: origin + "/"};
    }
    const given = String((data && data.relayApiBase) || "").replace(/\/$/, "");
    if (given && sameOrigin(given, here)) {
      return {base: new URL(given, here).pathname.replace(/\/$/, "")};
    }
    const id = String((data && data.serverId) || ""); // the server's relay prefix, here
    return /^[A-Za-z0-9_-]{1,64}$/.test(id) ? {base: "/r/" + id + "/api/v1"} : null;
  }

  // A pairing secret as a person types it: groups of four, lower case.
  function groupCode(secret) {
    return (
      String(secret)
        .toLowerCase()
        .replace(/[^a-z2-7]/g, "")
        .match(/.{1,4}/g) || []
    ).join("-");
  }

  return {groupCode, keptEntry, keyFor, pairTarget, sameOrigin};
})();

if (typeof module !== "undefined") module.exports = keys;
