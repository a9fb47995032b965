// -- drafts: what this browser keeps of unsaved text (pure: no page, no storage; node --test web/)
// A draft is {content, etag, at}, kept in localStorage under key(base, name): `etag` is the
// version the text started from (none for a new note), `at` when it was kept. A note's draft
// is named by its path; a note not created yet has one draft, named NEW_NOTE. The page reads
// and writes the storage; this says under which name, in what form, and when.
const drafts = (() => {
  const NEW_NOTE = "(new note)";

  function key(base, name) {
    return "notesvc.draft:" + base + "|" + name;
  }

  // The open note's draft name: NEW_NOTE while a new note is written, else its path (none
  // when no note is open).
  function nameFor(blank, path) {
    return blank ? NEW_NOTE : path;
  }

  // What is kept: the stored text of a draft (no etag: a new note, or a copy's).
  function record(content, etag, at) {
    return JSON.stringify({content, etag, at});
  }

  // The stored text read back: a draft, or null (none, or not readable).
  function parse(text) {
    try {
      return JSON.parse(text || "null");
    } catch (e) {
      return null;
    }
  }

  // As the page keeps the open note's text (typing stopped, the page hides or closes, a save
  // failed): "keep" unsaved text as its draft; "drop" the draft of a note that is saved; ""
  // leaves the storage as it is: a new note's draft goes only when the server made the note,
  // and with no key what the copy on this device left as drafts stays.
  function onKeep(name, dirty, blank, hasKey) {
    if (!name) return "";
    if (dirty) return "keep";
    return !blank && hasKey ? "drop" : "";
  }

  // A note opened with a draft: "restore" the draft when it holds other text than the note,
  // "drop" it when it holds the same, "" when there is none.
  function onOpen(draft, saved) {
    if (draft && draft.content !== saved) return "restore";
    return draft ? "drop" : "";
  }

  // A new note started: its draft comes back when it holds any words.
  function restoresNew(draft) {
    return !!(draft && draft.content.trim());
  }

  // What the page says of a note's draft that is back (etag: the note's version now).
  function notice(draft, etag) {
    const moved = draft.etag && draft.etag !== etag;
    return (
      "Your unsaved draft from " +
      new Date(draft.at).toLocaleString() +
      " is back." +
      (moved ? " The note has changed since then." : "")
    );
  }

  // ... and of a new note's.
  function newNotice(draft) {
    return "Your new note from " + new Date(draft.at).toLocaleString() + " is back.";
  }

  // The outbox let go (its key refused): each unsent edit of a note becomes that note's
  // draft; the new notes and shared text become one new note's draft, after what that draft
  // held (`old`). Resolves to {notes: [[path, record]], newNote: record or null}.
  function fromOutbox(items, old, at) {
    const notes = [];
    const loose = [];
    for (const item of items || []) {
      if (item.kind === "save") {
        notes.push([item.path, record(item.content, item.base, at)]);
      } else if (item.kind === "create") {
        loose.push(item.content);
      } else if (item.text && !item.ask) {
        loose.push(item.text);
      }
    }
    if (!loose.length) return {notes, newNote: null};
    if (old) loose.unshift(old.content);
    return {notes, newNote: record(loose.join("\n\n"), undefined, at)};
  }

  return {
    NEW_NOTE,
    key,
    nameFor,
    record,
    parse,
    onKeep,
    onOpen,
    restoresNew,
    notice,
    newNotice,
    fromOutbox,
  };
})();

if (typeof module !== "undefined") module.exports = drafts;
