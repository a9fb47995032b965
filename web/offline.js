// -- offline: the notes kept on this device (opt-in, per device) ---------------------------
// "Keep notes on this device" mirrors the notes this key sees into IndexedDB and queues what
// is written while the server cannot be reached (the outbox, sent through merge when it can
// be): both work on plain HTTP too, in a page left open. In a secure context (HTTPS, a
// relay's per-server origin, or localhost) a service worker also keeps the app itself, so it
// opens with no connection; elsewhere the option says that only this needs HTTPS. A relay's
// shared origin keeps nothing. Turning it off deletes the copy. A key that stops working
// wipes it.

const offline = (() => {
  const {$, state} = core;
  const {el} = markdown;
  const store = {db: null, items: [], sending: false};

  function offlineOn() {
    return !!state.base && core.getItem("local", "notesvc.offline") === state.base;
  }

  // The server cannot be reached: no answer at all, or the relay's word that the server
  // behind it is not there (502, 503, 504).
  function unreachable(e) {
    return e.status === 0 || e.status === 502 || e.status === 503 || e.status === 504;
  }

  // The copy and the outbox need IndexedDB only (no secure context); on a relay's shared
  // origin every server would share them.
  function offlinePossible() {
    return "indexedDB" in window && !core.SHARED_ORIGIN;
  }
  // The app itself, kept for opening with no connection: a service worker, which only a
  // secure context has.
  function appKeepable() {
    return window.isSecureContext && "serviceWorker" in navigator;
  }
  const NEEDS_HTTPS = "only opening the app with no connection needs HTTPS";
  // What a photo or file put in offline may weigh (kept in IndexedDB until it is sent).
  const OFFLINE_FILE_BYTES = 10 * 1024 * 1024;
  const OFFLINE_FILES_BYTES = 50 * 1024 * 1024;

  function idb() {
    if (store.db) return Promise.resolve(store.db);
    return new Promise((resolve, reject) => {
      const open = indexedDB.open("notesvc", 1);
      open.onupgradeneeded = () => {
        open.result.createObjectStore("notes", {keyPath: "path"});
        open.result.createObjectStore("meta");
      };
      open.onsuccess = () => resolve((store.db = open.result));
      open.onerror = () => reject(open.error);
    });
  }

  // One request on one store, as a promise.
  async function stored(name, mode, fn) {
    const db = await idb();
    return new Promise((resolve, reject) => {
      const tx = db.transaction(name, mode);
      const req = fn(tx.objectStore(name));
      tx.oncomplete = () => resolve(req && req.result);
      tx.onerror = () => reject(tx.error);
    });
  }

  async function mirrorPut(note) {
    if (!offlineOn() || !note || !note.path) return;
    const kept = {path: note.path, title: note.title, etag: note.etag, modified: note.modified};
    kept.content =
      note.content !== undefined ? note.content : ((await mirrorGet(note.path)) || {}).content;
    await stored("notes", "readwrite", (s) => s.put(kept));
  }
  async function mirrorGet(path) {
    return stored("notes", "readonly", (s) => s.get(path));
  }
  async function mirrorAll() {
    return (await stored("notes", "readonly", (s) => s.getAll())) || [];
  }
  async function mirrorDrop(path) {
    if (!offlineOn()) return;
    await stored("notes", "readwrite", (s) => s.delete(path));
  }
  async function mirrorRecent(limit) {
    const all = noteOrder.newestFirst(await mirrorAll());
    return all.slice(0, limit).map((n) => ({
      ...n,
      preview: paths.notePreview(n.content || ""),
    }));
  }

  // The tree of a folder, from the copy (as GET /folders/tree?depth=1 has it).
  async function mirrorTree(folder) {
    const all = (await mirrorAll()).map((n) => n.path);
    return noteOrder.folderListing(all, folder);
  }

  async function loadOutbox() {
    store.items = offlineOn()
      ? (await stored("meta", "readonly", (s) => s.get("outbox"))) || []
      : [];
    showWaiting();
  }
  // At start: a browser that refuses IndexedDB (private mode, storage full) still opens the
  // notes from the server; the page says the copy cannot be read.
  async function loadOutboxOrSay() {
    try {
      await loadOutbox();
    } catch (e) {
      core.toast("The notes kept on this device cannot be read here: " + (e.message || e), true);
    }
  }
  // Change the outbox as one step: read, change, write in one IndexedDB transaction, so a
  // change made meanwhile (this tab's sender, another tab, the share sheet's worker) is never
  // written over with an older list. Resolves to the list as written.
  async function updateOutbox(change) {
    if (!offlineOn()) return store.items; // the copy was let go meanwhile: nothing is kept
    const db = await idb();
    store.items = await new Promise((resolve, reject) => {
      const tx = db.transaction("meta", "readwrite");
      const meta = tx.objectStore("meta");
      const read = meta.get("outbox");
      let items = [];
      read.onsuccess = () => {
        items = change(read.result || []);
        meta.put(items, "outbox");
      };
      tx.oncomplete = () => resolve(items);
      tx.onerror = () => reject(tx.error);
    });
    showWaiting();
    if (store.tabs) store.tabs.postMessage("outbox"); // the other tabs show it too
    return store.items;
  }

  // The badge in the bar, on every pane: "Offline", "2 to send" (its title says it whole).
  function showWaiting() {
    const box = $("offline-state");
    const on = offlineOn();
    const n = on ? store.items.length : 0;
    const off = on && !navigator.onLine;
    box.textContent = [off ? "Offline" : "", n ? n + " to send" : ""].filter(Boolean).join(" · ");
    box.title = [
      off ? "No connection: your notes open from this device" : "",
      outbox.waiting(store.items),
    ]
      .filter(Boolean)
      .join(". ");
    box.className = "";
    box.hidden = !box.textContent;
  }

  // The server cannot be reached: keep the text on this device, to send when it can be.
  async function keepOffline(path, content) {
    const raw = app.fromEditor(content); // (a CRLF note keeps its line endings)
    if (path === null) {
      // named as its draft is, and sent with the key its create went out with (an answer
      // lost as the connection went: the server makes it once)
      const local = drafts.newName(state.newKey);
      const folder = (state.grant && state.grant.folder) || "";
      await updateOutbox((items) =>
        outbox.queueCreate(items, local, folder, raw, app.newId, state.newKey),
      );
      state.blank = false;
      state.path = local;
      state.etag = null;
    } else {
      const base = state.etag;
      await updateOutbox((items) => outbox.queueSave(items, path, base, raw, app.newId));
    }
    state.saved = content;
    const title = (content.split("\n").find((l) => l.trim()) || "untitled").replace(/^#+\s*/, "");
    await mirrorPut({
      path: state.path,
      title,
      content: raw,
      etag: state.etag,
      modified: new Date().toISOString(),
    });
    core.loadRecent().catch(() => {}); // the list shows it too (from this device's copy)
    $("status").textContent = "Kept on this device";
    $("status").className = "";
    app.updateDirty();
    app.keepDraft(); // the outbox has the text: the draft goes (what was typed since stays)
    return true;
  }

  // A photo or file put into the note `note` with no connection: kept in the outbox, to be
  // uploaded as `path` before the edit that links it. Bounded: a file up to
  // OFFLINE_FILE_BYTES, all waiting files up to OFFLINE_FILES_BYTES (the page says why not).
  // Resolves to what the upload will answer, or null (refused, and said).
  async function keepFile(file, path, note, label) {
    const size = file.size || 0;
    const room = OFFLINE_FILES_BYTES - outbox.uploadBytes(store.items);
    if (size > OFFLINE_FILE_BYTES || size > room) {
      core.toast(
        "No connection: “" +
          label +
          "” (" +
          paths.sizeText(size) +
          ") was not added. " +
          (size > OFFLINE_FILE_BYTES
            ? "This device keeps files up to " + paths.sizeText(OFFLINE_FILE_BYTES)
            : "This device already keeps " + paths.sizeText(OFFLINE_FILES_BYTES - room)) +
          " to send; add it again once you are online.",
        true,
      );
      return null;
    }
    await updateOutbox((items) => outbox.queueUpload(items, path, note, file, app.newId));
    return {path, contentType: file.type || "application/octet-stream", kept: true};
  }

  // The file waiting to be sent as `path`, if one does.
  function pendingFile(path) {
    return outbox.pendingFile(store.items, path);
  }

  // An upload kept under another path than its link names (that name was taken meanwhile):
  // the note's queued edits, and the open editor, link the path it got.
  async function relinked(item, got) {
    const from = paths.relativeTo(item.note, item.path);
    const to = paths.relativeTo(item.note, got);
    await updateOutbox((items) => outbox.relink(items, item.note, from, to));
    const ed = app.editor();
    if (state.path !== item.note || !ed.value.includes("](" + from + ")")) return;
    const fix = (text) => text.split("](" + from + ")").join("](" + to + ")");
    if (state.saved === ed.value) state.saved = fix(state.saved);
    ed.value = fix(ed.value);
    app.updateDirty();
  }

  // Send what waits, in order, once each (the idempotency keys make a resend harmless); one
  // tab at a time (the others find the outbox done).
  async function sendOutbox() {
    if (!offlineOn() || store.sending || !navigator.onLine) return;
    if (!navigator.locks) return sendWaiting();
    return navigator.locks.request("notesvc-outbox", {ifAvailable: true}, (lock) =>
      lock ? sendWaiting() : null,
    );
  }
  async function sendWaiting() {
    store.sending = true;
    let done = 0;
    try {
      await loadOutbox();
      for (let item = outbox.nextItem(store.items); item && offlineOn();) {
        await updateOutbox((items) => outbox.markSent(items, item)); // a later edit queues anew
        let answer;
        try {
          answer = await sendItem(item);
        } catch (e) {
          const refused = e.status >= 400 && e.status < 500 && ![401, 408, 429].includes(e.status);
          if (!refused) break; // out of reach, the server unwell, the key refused: later, as it is
          // refused for good (too large, no longer allowed): out of the queue, and said; an
          // edit of a note stays in this browser as its draft
          if (item.kind === "save") {
            core.setItem(
              "local",
              app.draftKey(item.path),
              drafts.record(item.content, item.base, Date.now()),
            );
          }
          core.toast(
            item.kind === "upload"
              ? "Could not send “" + paths.nameOf(item.path) + "” kept on this device: " + e.message
              : "Could not send a change kept on this device: " + e.message,
            true,
          );
          answer = null;
        }
        if (item.kind === "create" && answer && state.path === item.local) {
          state.path = answer.path;
          state.etag = answer.etag;
          $("path").textContent = answer.path;
          core.setItem("session", "notesvc.open", answer.path);
        }
        if (answer && answer.path) sent(item, answer);
        if (item.kind === "create" && answer) await mirrorDrop(item.local);
        done++;
        if (!offlineOn()) break; // the key stopped working meanwhile: what waits became drafts
        item = outbox.nextItem(
          await updateOutbox((items) => outbox.settle(items, item, answer || {})),
        );
      }
    } finally {
      store.sending = false;
      showWaiting();
    }
    // what was sent has its place on the server now (nothing sent: the tree is as it was)
    if (done && !store.items.length) core.loadTree().catch(() => {});
  }

  // The note's text is on the server: its draft dies when it holds that text; a new note's
  // draft holding more (typed since) becomes the made note's draft.
  function sent(item, answer) {
    if (item.kind !== "create" && item.kind !== "save") return;
    const name = item.kind === "create" ? item.local : item.path;
    const draft = app.readDraft(name);
    const step = drafts.onSent(draft, app.toEditor(item.content), item.kind === "create");
    if (step === "move") {
      const moved = drafts.record(draft.content, answer.etag, draft.at);
      core.setItem("local", app.draftKey(answer.path), moved);
    }
    if (step) core.removeItem("local", app.draftKey(name));
  }

  async function sendItem(item) {
    const once = {"Idempotency-Key": item.key};
    if (item.kind === "upload") {
      const data = await app.upload(item.file, item.key, item.path);
      if (data.path !== item.path) await relinked(item, data.path);
      return data;
    }
    if (item.kind === "create") {
      const body = {content: item.content};
      if (item.folder) body.folder = item.folder;
      const {data} = await core.api("POST", "/notes", body, once);
      await mirrorPut(data);
      return data;
    }
    if (item.kind === "voice") {
      // a recording made with no connection (record.js): its note is made now
      const {data} = await core.api("POST", "/capture/voice", item.file, once);
      core.toast("A voice note kept on this device was saved: " + paths.nameOf(data.path));
      return {};
    }
    if (item.kind === "capture") {
      const files = [];
      let text = item.text;
      for (const [i, file] of (item.files || []).entries()) {
        const name = (file.name || "image").replace(/[[\]]/g, "");
        try {
          files.push([name, (await app.upload(file, item.key + ":file" + i)).path]);
        } catch (e) {
          if (e.status !== 413 && e.status !== 400) throw e;
          // too large (or not allowed): the text still goes; the page says why the file did not
          const limit = /over (\d+) bytes/.exec(e.message || "");
          const why = limit
            ? "this server takes files up to " + paths.sizeText(+limit[1])
            : e.message;
          core.toast(
            "“" +
              name +
              "” (" +
              paths.sizeText(file.size) +
              ") was not added: " +
              why +
              ". " +
              (text ? "The text is in today's note." : ""),
            true,
          );
        }
      }
      if (!text && !files.length) return {};
      // the images' links are relative to today's note, wherever the daily plugin keeps it
      const line = (notePath) =>
        [
          text,
          ...files.map(
            ([name, path]) => "![" + name + "](" + paths.relativeTo(notePath, path) + ")",
          ),
        ]
          .filter(Boolean)
          .join(" ");
      await app.appendToToday(line, item.key, item.at);
      return {};
    }
    try {
      const {data} = await core.api(
        "POST",
        "/notes/" + core.enc(item.path) + "/merge",
        {base: item.base, content: item.content, clientName: app.deviceName()},
        once,
      );
      await mirrorPut(data.note);
      const typed = app.toEditor(item.content);
      if (state.path === item.path && app.editor().value === typed) app.saved(data.note, typed);
      return data.note;
    } catch (e) {
      if (e.status === 409 && e.error && e.error.conflictPath) {
        app.ownCopy(e.error.conflictPath);
        core.toast(
          "“" +
            paths.nameOf(item.path) +
            "” changed meanwhile: your edit is kept as " +
            paths.nameOf(e.error.conflictPath),
        );
        return {};
      }
      if (e.status !== 404) throw e;
      // deleted: kept anew
      const {data} = await core.api("POST", "/notes", {content: item.content}, once);
      core.toast(
        "“" +
          paths.nameOf(item.path) +
          "” was deleted meanwhile: your text is kept as " +
          data.path,
      );
      return data;
    }
  }

  // The change feed keeps the copy current.
  async function mirrorChange(c) {
    if (c.kind === "deleted" || c.kind === "moved") await mirrorDrop(c.from || c.path);
    if (c.kind === "deleted") return;
    try {
      const {data} = await core.api("GET", "/notes/" + core.enc(c.path));
      await mirrorPut(data);
    } catch (e) {
      if (e.status === 404) await mirrorDrop(c.path);
    }
  }

  // The first copy: every note the key sees, a few at a time.
  async function copyAll() {
    const all = [];
    for (let offset = 0; ; offset += 1000) {
      const {data} = await core.api("GET", "/notes?limit=1000&offset=" + offset);
      all.push(...data.notes.map((n) => n.path));
      if (offset + 1000 >= data.total) break;
    }
    let done = 0;
    const total = all.length;
    const box = $("offline-state");
    box.hidden = false;
    box.title = "Copying your notes to this device";
    // kept 50 at a time, one transaction each (a transaction per note costs the page more
    // than the requests do)
    let batch = [];
    const flush = async () => {
      const notes = batch;
      batch = [];
      const kept = notes.map((n) => ({
        path: n.path,
        title: n.title,
        etag: n.etag,
        modified: n.modified,
        content: n.content,
      }));
      await stored("notes", "readwrite", (s) => kept.forEach((n) => s.put(n)));
    };
    const worker = async () => {
      while (all.length) {
        const path = all.pop();
        const {data} = await core.api("GET", "/notes/" + core.enc(path));
        batch.push(data);
        if (batch.length >= 50) await flush();
        done++;
        if (done % 25 === 0) box.textContent = "Copying " + done + "/" + total;
      }
    };
    await Promise.all(Array.from({length: 6}, worker));
    await flush();
    box.textContent = core.counted(done, "note") + " kept";
    box.title = core.counted(done, "note") + " kept on this device";
    box.className = "ready";
    performance.mark("notesvc:offline-copied");
    setTimeout(showWaiting, 5000);
  }

  async function enableOffline() {
    if (!offlinePossible()) {
      await app.dialog(
        "Keep notes on this device",
        [
          el(
            "p",
            {},
            core.SHARED_ORIGIN
              ? "This relay gives all its servers one address, where nothing can be kept."
              : "This browser cannot keep notes (IndexedDB is off here).",
          ),
        ],
        [["cancel", "Close"]],
      );
      return;
    }
    await idb(); // a browser that refuses IndexedDB says so here, before anything is kept
    await wipeOffline(); // whatever another key left on this device is not this key's
    if (appKeepable()) await navigator.serviceWorker.register("sw.js");
    if (navigator.storage && navigator.storage.persist) navigator.storage.persist().catch(() => {});
    core.setItem("local", "notesvc.offline", state.base);
    if (appKeepable() && core.getItem("local", "notesvc.key") === null) {
      // the app opens without the server (and from the share sheet): this device keeps the
      // key, as "Remember" would, until the option is turned off (on plain HTTP the app
      // cannot open without the server: the key stays where the person put it)
      core.setItem("local", "notesvc.key", state.key);
      core.setItem("local", "notesvc.keyFor", state.base);
      core.setItem("local", "notesvc.offlineKey", "1");
    }
    offlineMenu();
    await copyAll();
    core.toast(
      appKeepable()
        ? "Your notes are kept on this device: they open without a connection"
        : "Your notes are kept on this device: what you write offline in an open page " +
            "is sent later; " +
            NEEDS_HTTPS,
    );
  }

  async function disableOffline() {
    await sendOutbox().catch(() => {}); // what waits goes first, if it can
    if (!(await letWaitingGo("Stop keeping notes on this device"))) return;
    core.removeItem("local", "notesvc.offline");
    if (core.getItem("local", "notesvc.offlineKey") === "1") {
      for (const name of ["notesvc.key", "notesvc.keyFor", "notesvc.offlineKey"]) {
        core.removeItem("local", name); // kept for this option only: this tab keeps it
      }
    }
    await wipeOffline();
    offlineMenu();
    core.toast("The copy on this device is deleted");
  }

  // Changes not sent yet, before the copy is deleted: resolve to true when the person lets
  // them go (or there are none).
  async function letWaitingGo(title) {
    if (!offlineOn()) return true;
    await loadOutbox().catch(() => {});
    if (!store.items.length) return true;
    const choice = await app.choose(
      title,
      outbox.waiting(store.items) +
        ": the server could not be reached. They are lost if the copy on this device is " +
        "deleted now.",
      [
        ["cancel", "Keep them", "primary"],
        ["delete", "Delete them"],
      ],
    );
    return choice === "delete";
  }

  // The key this device kept was refused (revoked, rotated): the copy goes with it; what was
  // written here and not sent yet stays in this browser as drafts (a note's edit reopens
  // with it; new notes and shared text as one new note's draft), for the next key to send.
  async function forgetOffline() {
    if (!offlineOn() && core.getItem("local", "notesvc.wipe") !== state.base) return;
    core.setItem("local", "notesvc.wipe", state.base); // finished at the next start if cut short
    core.removeItem("local", "notesvc.offline");
    core.removeItem("local", "notesvc.offlineKey");
    const items = await stored("meta", "readonly", (s) => s.get("outbox")); // (unread: kept)
    const loose = drafts.newName(app.newId()); // shared text: one new note's
    for (const [name, draft] of drafts.fromOutbox(items, Date.now(), loose)) {
      core.setItem("local", app.draftKey(name), draft);
    }
    await wipeOffline();
    core.removeItem("local", "notesvc.wipe");
  }

  // Everything this option kept: the copy, the outbox, the worker and the app's cache.
  async function wipeOffline() {
    store.items = [];
    if (store.db) store.db.close();
    store.db = null;
    if ("indexedDB" in window) indexedDB.deleteDatabase("notesvc");
    if ("serviceWorker" in navigator) {
      for (const r of await navigator.serviceWorker.getRegistrations()) await r.unregister();
    }
    if ("caches" in window) for (const name of await caches.keys()) await caches.delete(name);
    showWaiting();
  }

  // What the share sheet brought waits for a yes here: any web page can post to the share
  // address, so nothing reaches today's note until the person has seen it.
  async function askShared() {
    await loadOutbox();
    for (const item of store.items.filter((i) => i.ask)) {
      const files = (item.files || []).map((f) => f.name || "image");
      const body = [el("p", {}, "Add this to today's note?")];
      if (item.text) body.push(el("blockquote", {class: "shared-text"}, item.text.slice(0, 500)));
      if (files.length) body.push(el("p", {}, "With " + files.join(", ")));
      if (item.dropped) {
        const more = core.counted(item.dropped, "more file");
        body.push(el("p", {class: "muted"}, "Too large to keep: " + more + "."));
      }
      const yes =
        (await app.dialog("Shared to notesvc", body, [
          ["add", "Add to today's note", "primary"],
          ["drop", "Discard"],
        ])) === "add";
      await updateOutbox((items) =>
        yes
          ? items.map((i) => (i.id === item.id ? {...i, ask: false} : i))
          : items.filter((i) => i.id !== item.id),
      );
    }
    sendOutbox().catch(() => {});
  }

  // The option; on plain HTTP it says what works there (the copy and the outbox, in an open
  // page) and what does not (opening with no connection).
  function offlineMenu() {
    const item = $("menu-offline");
    item.hidden = false;
    const label = offlineOn() ? "Stop keeping notes on this device" : "Keep notes on this device";
    const plain = !appKeepable() && !core.SHARED_ORIGIN;
    item.replaceChildren(
      label,
      ...(plain ? [el("small", {}, "Works in an open page; " + NEEDS_HTTPS)] : []),
    );
  }

  function wireOffline() {
    $("menu-offline").addEventListener(
      "click",
      core.act(() => (offlineOn() ? disableOffline() : enableOffline())),
    );
    window.addEventListener("online", () => core.act(sendOutbox)());
    window.addEventListener("offline", showWaiting);
    if ("BroadcastChannel" in window) {
      store.tabs = new BroadcastChannel("notesvc-outbox");
      store.tabs.onmessage = () => loadOutbox().catch(() => {});
    }
  }

  // What waits on this device (as last read).
  function waiting() {
    return store.items;
  }

  // Whether what waits on this device can go now: something waits, and no send is on its way.
  function canSend() {
    return store.items.length > 0 && !store.sending;
  }

  return {
    askShared,
    canSend,
    forgetOffline,
    keepFile,
    keepOffline,
    letWaitingGo,
    loadOutboxOrSay,
    mirrorChange,
    mirrorGet,
    mirrorPut,
    mirrorRecent,
    mirrorTree,
    offlineMenu,
    offlineOn,
    pendingFile,
    sendOutbox,
    unreachable,
    updateOutbox,
    waiting,
    wipeOffline,
    wireOffline,
  };
})();
