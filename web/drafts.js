// -- drafts: what this browser keeps of unsaved text (pure: no page, no storage; node --test web/)
// A draft is {content, etag, at}, kept in localStorage under key(base, name): `etag` is the
// version the text started from (none for a new note), `at` when it was kept. A draft
// belongs to one note: a note's is named by its path; a note not on the server yet is
// "new:<id>", where <id> is the Idempotency-Key of its create (and the outbox's `local` for
// it), so sending it twice makes one note. A draft dies when its note's text is safe: on the
// server (saved, merged, sent from the outbox) or handed to the outbox. *New note* is always
// blank; a new note's draft left by a closed tab is sent at the next start. The page reads
// and writes the storage; this says under which name, in what form, and when.
const drafts = (() => {
  const NEW = "new:";
  // Older pages kept one draft for every new note under this name: read once, as before.
  const NEW_NOTE = "(new note)";

  function key(base, name) {
    return "notesvc.draft:" + base + "|" + name;
  }

  // The name of a new note's draft (and its stand-in path until the server names it).
  function newName(id) {
    return NEW + id;
  }

  // Whether a draft (or an outbox path) is a note not on the server yet.
  function isNew(name) {
    return !!name && name.startsWith(NEW);
  }

  // The Idempotency-Key of a new note's create, from its name.
  function createKey(name) {
    return isNew(name) ? name.slice(NEW.length) : null;
  }

  // The open note's draft name: its own new name while a new note is written (`id`: its
  // create's key), else its path (none when no note is open).
  function nameFor(blank, path, id) {
    return blank ? newName(id) : path;
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
  // failed, the outbox took it): "keep" unsaved text as its draft; "drop" the draft once
  // nothing is unsaved (saved, merged, queued; a new note emptied); "" leaves the storage as
  // it is: with no key, what the copy on this device left as drafts stays.
  function onKeep(name, dirty, hasKey) {
    if (!name) return "";
    if (dirty) return "keep";
    return hasKey ? "drop" : "";
  }

  // A note opened with a draft: "restore" the draft when it holds other text than the note,
  // "drop" it when it holds the same, "" when there is none.
  function onOpen(draft, saved) {
    if (draft && draft.content !== saved) return "restore";
    return draft ? "drop" : "";
  }

  // At the start, the drafts of new notes (`names`, of every draft kept for this server)
  // that a closed tab left: each is sent now ("send"); one whose create waits in the outbox
  // joins it there ("queue": what was typed since it was queued goes too); one with no words
  // goes ("drop").
  function onStart(names, read, items) {
    const queued = new Set((items || []).filter((i) => i.kind === "create").map((i) => i.local));
    const steps = [];
    for (const name of names) {
      if (!isNew(name)) continue;
      const draft = read(name);
      const empty = !draft || !String(draft.content || "").trim();
      steps.push([name, empty ? "drop" : queued.has(name) ? "queue" : "send"]);
    }
    return steps;
  }

  // The outbox sent a note's text (`sent`, as the editor has it): its draft dies ("drop")
  // when it holds that text; one holding more, typed since, stays for the next save, or
  // ("move") becomes the draft of the note a create made (`created`).
  function onSent(draft, sent, created) {
    if (!draft) return "";
    if (draft.content === sent) return "drop";
    return created ? "move" : "";
  }

  // The one draft of an older page's new notes comes back (once) when it holds any words.
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

  // ... and of an older page's new note's.
  function newNotice(draft) {
    return "Your new note from " + new Date(draft.at).toLocaleString() + " is back.";
  }

  // The outbox let go (its key refused): each unsent edit of a note becomes that note's
  // draft, each new note its own (under its new name: the next start sends it), and shared
  // text one more new note's, named `loose`. Resolves to [[name, record]].
  function fromOutbox(items, at, loose) {
    const kept = [];
    const shared = [];
    for (const item of items || []) {
      if (item.kind === "save") {
        kept.push([item.path, record(item.content, item.base, at)]);
      } else if (item.kind === "create") {
        kept.push([item.local, record(item.content, null, at)]);
      } else if (item.text && !item.ask) {
        shared.push(item.text);
      }
    }
    if (shared.length) kept.push([loose, record(shared.join("\n\n"), null, at)]);
    return kept;
  }

  return {
    NEW_NOTE,
    key,
    newName,
    isNew,
    createKey,
    nameFor,
    record,
    parse,
    onKeep,
    onOpen,
    onStart,
    onSent,
    restoresNew,
    notice,
    newNotice,
    fromOutbox,
  };
})();

if (typeof module !== "undefined") module.exports = drafts;
