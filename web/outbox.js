// -- the outbox (pure: no page; node --test web/) ----------------------------------------
// What was written while the server could not be reached, in order, sent when it can be.
// An item is {id, kind, key, ...}: `key` is its Idempotency-Key, so an item sent twice
// (its answer lost) is done once. Kinds: "save" {path, base, content} (through merge, from
// the version it started from), "create" {local, folder, content} (a new note, named by
// the server; `local` stands for its path until then), "capture" {text, files, at} (today's
// note: the capture box, the share sheet).

// Queue a save; an unsent save of the same note takes the new text (it keeps the version
// the edits started from), and so does the unsent create of a note not sent yet.
const outbox = (() => {
  function queueSave(items, path, base, content, newId) {
    const out = items.slice();
    const create = out.findIndex((i) => i.kind === "create" && i.local === path && !i.sent);
    if (create >= 0) {
      out[create] = {...out[create], content, key: newId()};
      return out;
    }
    const at = out.findIndex((i) => i.kind === "save" && i.path === path && !i.sent);
    if (at >= 0) out[at] = {...out[at], content, key: newId()};
    else out.push({id: newId(), kind: "save", key: newId(), path, base, content});
    return out;
  }

  // `key`: the create's Idempotency-Key when the page already sent it once (the answer lost as
  // the connection went): the server makes the note once.
  function queueCreate(items, local, folder, content, newId, key) {
    return [...items, {id: newId(), kind: "create", key: key || newId(), local, folder, content}];
  }

  // `at`: when it was captured (its time in today's note), not when it is sent.
  function queueCapture(items, text, files, newId, at) {
    const item = {id: newId(), kind: "capture", key: newId(), text, files: files || [], at};
    return [...items, item];
  }

  // The item sent: gone from the queue. A create's answer gives the note its path: later
  // saves of it go there, from the version the server made; a later save of a note just
  // saved starts from the version that save made (its text already holds the earlier edit).
  function settle(items, item, answer) {
    const made = answer && answer.etag;
    return items
      .filter((i) => i.id !== item.id)
      .map((i) => {
        if (i.kind !== "save") return i;
        if (item.kind === "create" && i.path === item.local) {
          return {...i, path: answer.path, base: answer.etag};
        }
        if (item.kind === "save" && made && i.path === item.path && answer.path === item.path) {
          return {...i, base: answer.etag};
        }
        return i;
      });
  }

  // Before an item goes out it is marked sent: a later edit of the same note queues anew
  // instead of changing text that may already be on the server.
  function markSent(items, item) {
    return items.map((i) => (i.id === item.id ? {...i, sent: true} : i));
  }

  // The first item that may go now: the share sheet's items wait until the person says yes.
  function nextItem(items) {
    return items.find((i) => !i.ask) || null;
  }

  // What the page says about the queue.
  function waiting(items) {
    const n = items.length;
    if (!n) return "";
    return n === 1 ? "1 change waits to be sent" : n + " changes wait to be sent";
  }

  return {markSent, nextItem, queueCapture, queueCreate, queueSave, settle, waiting};
})();

if (typeof module !== "undefined") module.exports = outbox;
