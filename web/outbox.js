// -- the outbox (pure: no page; node --test web/) ----------------------------------------
// What was written while the server could not be reached, in order, sent when it can be.
// An item is {id, kind, key, ...}: `key` is its Idempotency-Key, so an item sent twice
// (its answer lost) is done once. Kinds: "save" {path, base, content} (through merge, from
// the version it started from), "create" {local, folder, content} (a new note, named by
// the server; `local` stands for its path until then), "capture" {text, files, at} (today's
// note: the capture box, the share sheet), "upload" {path, note, file} (a photo or file put
// into a note offline: sent before the edit that links it, named `path` unless taken),
// "voice" {file, at} (a recording: its note is made when it is sent, record.js).

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
    let at = -1; // the last unsent save of it
    out.forEach((i, n) => {
      if (i.kind === "save" && i.path === path && !i.sent) at = n;
    });
    // (an upload queued after that save stays before the edit that links it: a save of its own)
    const linked = out.some((i, n) => n > at && i.kind === "upload" && i.note === path);
    if (at >= 0 && !linked) out[at] = {...out[at], content, key: newId()};
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

  // A voice note recorded with no connection: its audio (a Blob) and when it was made; `key`
  // is the Idempotency-Key the page may have sent it with already (the answer lost).
  function queueVoice(items, file, key, at, newId) {
    return [...items, {id: newId(), kind: "voice", key: key || newId(), file, at}];
  }

  // A file for the note `note` (its path, or a new note's local name), to be kept as `path`.
  function queueUpload(items, path, note, file, newId) {
    return [...items, {id: newId(), kind: "upload", key: newId(), path, note, file}];
  }

  // The upload was kept under another path (its name was taken meanwhile): the note's queued
  // text links the path it got. `from`, `to`: the links as the note writes them.
  function relink(items, note, from, to) {
    const fix = (text) => text.split("](" + from + ")").join("](" + to + ")");
    return items.map((i) =>
      (i.kind === "save" && i.path === note) || (i.kind === "create" && i.local === note)
        ? {...i, content: fix(i.content)}
        : i,
    );
  }

  // The files that wait to be sent, by the path they will have.
  function pendingFile(items, path) {
    const item = items.find((i) => i.kind === "upload" && i.path === path);
    return item ? item.file : null;
  }

  // What waits in uploads, in bytes.
  function uploadBytes(items) {
    return items.reduce(
      (n, i) => n + (i.kind === "upload" || i.kind === "voice" ? i.file.size || 0 : 0),
      0,
    );
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

  return {
    markSent,
    nextItem,
    pendingFile,
    queueCapture,
    queueCreate,
    queueSave,
    queueUpload,
    queueVoice,
    relink,
    settle,
    uploadBytes,
    waiting,
  };
})();

if (typeof module !== "undefined") module.exports = outbox;
