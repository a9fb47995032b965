const app = (() => {
  const {$, state} = core;
  const {el} = markdown;
  function link(href, label, ctx, rich) {
    href = href.trim();
    let a;
    if (/^(https?:|mailto:)/i.test(href)) {
      a = el("a", {href, target: "_blank", rel: "noopener noreferrer"});
    } else {
      const path = /^[a-z][a-z0-9+.-]*:|^\/\/|^#/i.test(href)
        ? null
        : markdown.resolveRelative(href, ctx.from);
      if (path && path.startsWith("attachments/") && core.features.attachments) {
        a = attachmentLink(path, path);
      } else if (!path || !path.startsWith("notes/") || !path.endsWith(".md")) {
        a = el("span"); // another scheme, or nothing this page can open: the text alone
      } else {
        a = el("a", {
          href: "#",
          "data-note": path,
          onclick: (e) => {
            e.preventDefault();
            core.act(() => openNote(path))();
          },
        });
      }
    }
    if (rich) markdown.inline(label, a, ctx);
    else a.textContent = label;
    return a;
  }

  function wikiLink(target, label, ctx, embed) {
    const name = target.split("#")[0].trim();
    if (paths.isAttachmentName(name) && core.features.attachments) {
      const found = findAttachment(name, ctx.from);
      const shown =
        label && !/^\d+(x\d+)?$/.test(label.trim()) ? label.trim() : paths.fileName(name);
      if (embed && IMAGE_EXT.test(name)) return attachmentImage(found, shown);
      const a = attachmentLink(found, name);
      a.textContent = shown;
      return a;
    }
    return el(
      "a",
      {
        href: "#",
        "data-wiki": name,
        onclick: (e) => {
          e.preventDefault();
          core.act(() => openWiki(name, ctx.from))();
        },
      },
      (label || target).trim(),
    );
  }

  function image(alt, src, ctx) {
    // Images load only from this server (the CSP allows no other); others show as a link.
    if (/^(https?:)/i.test(src)) return link(src, alt ? "image: " + alt : src, ctx);
    const path = /^[a-z][a-z0-9+.-]*:|^\/\//i.test(src)
      ? null
      : markdown.resolveRelative(src, ctx.from);
    // an attachment, or a file beside the note (a vault's image, put there over WebDAV)
    const beside = path && path.startsWith("notes/") && !/\.md$/i.test(path);
    if (!path || !(path.startsWith("attachments/") || beside) || !core.features.attachments) {
      return document.createTextNode(alt ? "[image: " + alt + "]" : "[image]");
    }
    if (!IMAGE_EXT.test(path)) {
      const a = attachmentLink(path, path);
      a.textContent = alt || paths.fileName(path);
      return a;
    }
    return attachmentImage(Promise.resolve(path), alt || paths.fileName(path));
  }

  const IMAGE_EXT = /\.(png|jpe?g|gif|webp|avif|bmp|ico|svg)$/i;
  const MEDIA_EXT = /\.(mp3|m4a|aac|ogg|oga|opus|wav|flac|weba|mp4|m4v|mov|webm)$/i;
  const VIDEO_EXT = /\.(mp4|m4v|mov|webm)$/i;

  function attachmentImage(found, alt) {
    const img = el("img", {alt, loading: "lazy"});
    Promise.resolve(found)
      .then((path) => {
        if (!path) throw new Error("not found");
        img.dataset.attachment = path;
        return attachmentUrl(path);
      })
      .then(
        (url) => {
          img.src = url;
        },
        () => img.replaceWith(document.createTextNode("[image not found: " + alt + "]")),
      );
    return img;
  }

  // A link to an attachment: audio and video play in the page, other files are downloaded
  // (never opened as a page of this origin).
  function attachmentLink(found, name) {
    const a = el("a", {href: "#", class: MEDIA_EXT.test(name) ? "file media" : "file"});
    if (typeof found === "string") a.dataset.attachment = found;
    a.addEventListener("click", (e) => {
      e.preventDefault();
      core.act(() => openAttachment(found, a))();
    });
    return a;
  }

  async function openAttachment(found, a) {
    const path = await found;
    if (!path) throw new Error("There is no attachment of that name.");
    if (MEDIA_EXT.test(path)) {
      const url = await attachmentUrl(path);
      const player = el(VIDEO_EXT.test(path) ? "video" : "audio", {controls: true, class: "media"});
      player.src = url;
      player.setAttribute("aria-label", paths.fileName(path));
      a.replaceWith(player);
      player.play().catch(() => {});
      return;
    }
    const {blob} = await core.api("GET", "/attachments/" + core.enc(path), undefined, undefined, {
      blob: true,
    });
    const url = URL.createObjectURL(new Blob([blob], {type: "application/octet-stream"}));
    const save = el("a", {href: url, download: paths.fileName(path), hidden: true});
    document.body.append(save);
    save.click();
    save.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  }

  // ![[photo.jpg]] names a file: a path, else the first attachment of that name (as the
  // server resolves it), from one listing of the attachments kept for a minute.
  let attachmentNames = null;
  let attachmentNamesAt = 0;
  async function findAttachment(name, from) {
    if (name.includes("/")) {
      const path = name.replace(/^\/+/, "");
      return path.startsWith("attachments/") || path.startsWith("notes/")
        ? path
        : "attachments/" + path;
    }
    if (!attachmentNames || Date.now() - attachmentNamesAt > 60000) {
      attachmentNamesAt = Date.now();
      attachmentNames = (async () => {
        const listed = [];
        for (let offset = 0; offset < 20000; offset += 1000) {
          const {data} = await core.api("GET", "/attachments?limit=1000&offset=" + offset);
          listed.push(...data.attachments.map((x) => x.path));
          if (offset + 1000 >= data.total) break;
        }
        return noteOrder.firstOfEachName(listed, paths.fileName);
      })();
    }
    const names = await attachmentNames.catch(() => new Map());
    // not among the attachments: the file beside the note (how a vault keeps its images)
    return names.get(name.toLowerCase()) || (from ? markdown.folderOf(from) + "/" + name : null);
  }

  // An attachment needs the key, which an <img src> cannot send: fetch it, show it as a blob.
  // A blob: URL is a document of this origin when opened alone, so only a picture, a sound or
  // a video keeps its type; an SVG (which may hold script) is shown from a data: URL instead,
  // whose document, opened alone, has no origin of its own to read.
  const attachmentUrls = new Map();
  function attachmentUrl(path) {
    if (!attachmentUrls.has(path)) {
      const kept = offline.pendingFile(path); // put in offline: shown from this device
      const url = kept
        ? Promise.resolve(inertUrl(kept, path))
        : core
            .api("GET", "/attachments/" + core.enc(path), undefined, undefined, {blob: true})
            .then((r) => inertUrl(r.blob, path));
      url.catch(() => attachmentUrls.delete(path));
      attachmentUrls.set(path, url);
    }
    return attachmentUrls.get(path);
  }

  function inertUrl(blob, path) {
    const type = (blob.type || "").toLowerCase().split(";")[0].trim();
    if (type === "image/svg+xml" || /\.svg$/i.test(path)) {
      return new Promise((resolve, reject) => {
        const reader = new FileReader(); // a relay sends an SVG as octet-stream: say what it is
        reader.onload = () => resolve(reader.result);
        reader.onerror = () => reject(reader.error);
        reader.readAsDataURL(new Blob([blob], {type: "image/svg+xml"}));
      });
    }
    const passive = /^(image|audio|video)\/[a-z0-9.+-]+$/.test(type) && !/(xml|html)/.test(type);
    const safe = passive ? blob : new Blob([blob], {type: "application/octet-stream"});
    return URL.createObjectURL(safe);
  }

  // [[Name]] resolves as the server does: a path, else the first note of that file name.
  async function openWiki(name, from) {
    let target = name.replace(/\.md$/i, "");
    if (target.includes("/")) {
      target = target.replace(/^\/+/, "");
      return openNote((target.startsWith("notes/") ? target : "notes/" + target) + ".md");
    }
    const {data} = await core.api(
      "GET",
      "/search?limit=100&q=" + core.enc(target.replace(/["*()-]/g, " ")),
    );
    const hits = data.results.map((h) => h.path);
    const found = noteOrder.firstOfEachName(hits, paths.nameOf).get(target.toLowerCase());
    if (found) return openNote(found);
    const guess = (from ? markdown.folderOf(from) : "notes") + "/" + target + ".md";
    for (const path of new Set([guess, "notes/" + target + ".md"])) {
      try {
        await core.api("GET", "/notes/" + core.enc(path));
        return openNote(path);
      } catch (e) {
        if (e.status !== 404) throw e;
      }
    }
    const choice = await choose("No note named “" + target + "”", "Create " + guess + "?", [
      ["create", "Create it", "primary"],
      ["cancel", "Cancel"],
    ]);
    if (choice === "create") await createNote(guess);
    return undefined;
  }

  // -- dialogs ---------------------------------------------------------------------------------

  let dialogDone = null;
  function dialog(title, body, buttons, initial) {
    const d = $("dlg");
    if (dialogDone) dialogDone("cancel"); // one dialog at a time: the one open gives way
    $("dlg-title").textContent = title;
    $("dlg-body").replaceChildren(
      ...(Array.isArray(body) ? body : [body]).map((b) =>
        typeof b === "string" ? el("p", {}, b) : b,
      ),
    );
    return new Promise((resolve) => {
      dialogDone = (value) => {
        dialogDone = null;
        if (d.open) d.close();
        resolve(value);
      };
      $("dlg-buttons").replaceChildren(
        ...buttons.map(([value, label, cls]) =>
          el(
            "button",
            {
              type: "button",
              class: cls || null,
              "data-value": value,
              onclick: () => dialogDone(value),
            },
            label,
          ),
        ),
      );
      d.showModal();
      const focus =
        initial ||
        d.querySelector("#dlg-body input") ||
        d.querySelector("button.primary") ||
        d.querySelector("button");
      if (focus) focus.focus();
    });
  }
  function choose(title, text, buttons) {
    return dialog(title, text, buttons);
  }

  // -- the open note -----------------------------------------------------------------------------

  const editor = () => $("editor");
  function dirty() {
    return (state.path !== null || state.blank) && editor().value !== state.saved;
  }

  function updateDirty() {
    const s = $("status");
    if (dirty()) {
      s.replaceChildren(
        el("span", {"aria-hidden": "true"}, "● "),
        el("span", {class: "word"}, "Unsaved"),
      );
      s.className = "dirty";
    } else if (s.className === "dirty") {
      s.textContent = "";
      s.className = "";
    }
  }

  // Drafts on this device (web/drafts.js): each belongs to one note; a note not created yet
  // keeps its own under its new name ("new:" and its create's key), until the server (or the
  // outbox) has its text.
  const NEW_NOTE = drafts.NEW_NOTE;
  function draftKey(path) {
    return drafts.key(state.base, path);
  }
  const draftName = () => drafts.nameFor(state.blank, state.path, state.newKey);
  function readDraft(path) {
    return drafts.parse(core.getItem("local", draftKey(path)));
  }
  function keepDraft() {
    clearTimeout(draftTimer);
    const name = draftName();
    const step = drafts.onKeep(name, dirty(), !!state.key);
    if (step === "keep") {
      core.setItem("local", draftKey(name), drafts.record(editor().value, state.etag, Date.now()));
    } else if (step === "drop") {
      core.removeItem("local", draftKey(name));
    }
  }
  let draftTimer = 0;
  function scheduleDraft() {
    clearTimeout(draftTimer);
    draftTimer = setTimeout(keepDraft, 300);
  }
  function dropDraft() {
    const name = draftName();
    if (name) core.removeItem("local", draftKey(name));
    $("draft").hidden = true;
  }

  // Before the page leaves a note: what was typed is saved now (autosave may not have run
  // yet). Only when that fails does it ask; resolve to true when it is fine to go on.
  async function confirmLeave() {
    if (!dirty()) return true;
    clearTimeout(saveTimer);
    let why = "";
    try {
      if (await save(false)) return true;
    } catch (e) {
      why = " " + ((e.error && e.error.message) || "The server could not be reached.");
    }
    if (!dirty()) return false; // kept as a conflict copy: the page says where
    const choice = await choose("Not saved", "“" + state.title + "” could not be saved." + why, [
      ["retry", "Try again", "primary"],
      ["discard", "Discard changes"],
      ["cancel", "Stay"],
    ]);
    if (choice === "retry") return confirmLeave();
    if (choice === "discard") {
      dropDraft();
      editor().value = state.saved;
      updateDirty();
      return true;
    }
    return false;
  }

  // Put new text in the editor where the cursor stays on the words it was at (a change
  // elsewhere in the note moves it only by what was put in or taken out before it).
  function replaceText(text) {
    const ed = editor();
    const old = ed.value;
    if (old === text) return;
    const [a, b] = [ed.selectionStart, ed.selectionEnd];
    const [p, q] = merge.commonEnds(old, text);
    const at = (i) =>
      i <= p ? i : i >= old.length - q ? i + text.length - old.length : text.length - q;
    ed.value = text;
    if (document.activeElement === ed) ed.setSelectionRange(at(a), at(b));
  }

  // A textarea holds lines ending in \n only: a note written with \r\n is shown with \n and
  // saved back with \r\n, so opening it changes nothing.
  const toEditor = (text) => text.replace(/\r\n?/g, "\n");
  function fromEditor(text) {
    return state.crlf ? text.replace(/\n/g, "\r\n") : text;
  }

  function showNote(rec) {
    const again = rec.path === state.path; // the same note, newer: the cursor stays
    state.path = rec.path;
    state.etag = rec.etag;
    state.known = rec.etag; // the server's, whatever a draft's base (state.etag) says
    state.crlf = rec.content.includes("\r\n");
    state.saved = toEditor(rec.content);
    state.title = rec.title || paths.nameOf(rec.path);
    if (again) replaceText(state.saved);
    else editor().value = state.saved;
    $("title").textContent = state.title;
    $("path").textContent = rec.path; // in the note's menu, not under the title
    $("modified").textContent = "Edited " + core.ago(rec.modified);
    $("empty").hidden = true;
    $("note-bar").hidden = false;
    $("conflict").hidden = true;
    $("draft").hidden = true;
    $("status").textContent = "";
    $("status").className = "";
    $("about").disabled = false;
    $("about-label").textContent = "About this note: " + state.title;
    people.noteLine(rec.path); // "Shared by Ann"
    grants.noteActions(); // none that write in a folder shared to read only
    core.setItem("session", "notesvc.open", rec.path);
  }

  async function openNote(path, opts) {
    opts = opts || {};
    if (path !== state.path && !(await confirmLeave())) return false;
    let data;
    try {
      data = (await core.api("GET", "/notes/" + core.enc(path))).data;
      // the copy takes what the server has
      if (offline.offlineOn()) offline.mirrorPut(data).catch(() => {});
    } catch (e) {
      data = offline.unreachable(e) && offline.offlineOn() ? await offline.mirrorGet(path) : null;
      if (!data) throw e;
    }
    await featuresRead.catch(() => {}); // its embeds are shown as what this server offers
    showNote(data);
    const draft = readDraft(data.path);
    const step = drafts.onOpen(draft, state.saved);
    if (step === "restore") {
      editor().value = draft.content;
      state.etag = draft.etag || data.etag; // a save meets the conflict if the note moved on
      $("draft-text").textContent = drafts.notice(draft, data.etag);
      $("draft").hidden = false;
      setEditing(true);
    } else {
      if (step === "drop") dropDraft();
      setEditing(!!opts.edit);
    }
    updateDirty();
    core.showPane("note");
    loadBacklinks(data.path);
    loadRelated(data.path); // after the note shows, never before it
    core.reveal(data.path).catch(() => {});
    return true;
  }

  function closeNote() {
    state.path = null;
    state.blank = false;
    state.etag = null;
    state.known = null;
    state.saved = "";
    state.crlf = false;
    editor().value = "";
    $("note-bar").hidden = true;
    $("title").textContent = "";
    $("path").textContent = "";
    $("modified").textContent = "";
    $("view").replaceChildren();
    $("view").hidden = true;
    editor().hidden = true;
    $("editor-tools").hidden = true;
    $("backlinks").hidden = true;
    $("conflict").hidden = true;
    $("draft").hidden = true;
    $("status").textContent = "";
    $("status").className = "";
    $("empty").hidden = false;
    $("about").checked = false;
    $("about").disabled = true;
    $("about-label").textContent = "About this note";
    core.removeItem("session", "notesvc.open");
    core.markCurrent();
  }

  // Editing or reading: no Save anywhere (typing is saved by itself; the status says so).
  function setEditing(on) {
    state.editing = on;
    editor().hidden = !on;
    $("editor-tools").hidden = !on || !grants.writable();
    $("view").hidden = on;
    $("edit").textContent = on ? "Done" : "Edit";
    $("edit").setAttribute("aria-pressed", String(on));
    if (!on) renderView();
  }

  function renderView() {
    const onTask = grants.writable() ? toggleTask : null; // a read key ticks nothing
    const view = markdown.renderMarkdown(editor().value, {
      from: state.path,
      onTask,
      link,
      wikiLink,
      image,
      lines: true, // each block's source lines: a tap opens the editor there
    });
    $("view").replaceChildren(...view.childNodes);
    if (related && related.path === state.path) $("view").append(related.box);
  }

  // -- lists in the editor and taps on the view (the text logic is web/lists.js) -------------

  // Make `edit` ({from, to, insert, start, end}) with the browser's own editing, so Undo
  // takes it back and its input event reaches autosave; where that is refused, by hand.
  function applyEdit(edit) {
    const ed = editor();
    const want = lists.apply(ed.value, edit);
    ed.focus();
    ed.setSelectionRange(edit.from, edit.to);
    let done = edit.from === edit.to && !edit.insert;
    try {
      if (!done && edit.insert) done = document.execCommand("insertText", false, edit.insert);
      else if (!done) done = document.execCommand("delete");
    } catch (e) {
      done = false;
    }
    if (ed.value !== want) {
      if (done) ed.value = want;
      else ed.setRangeText(edit.insert, edit.from, edit.to);
      ed.dispatchEvent(new Event("input"));
    }
    ed.setSelectionRange(edit.start, edit.end);
  }

  function toggleChecklist() {
    const ed = editor();
    applyEdit(lists.toggleTask(ed.value, ed.selectionStart, ed.selectionEnd));
  }

  // Enter on a list line continues the list; on an empty item it ends it. (keydown, and for
  // keyboards that send no key, beforeinput: one of them, as the first one prevents the other.)
  function enterInList(e) {
    if (e.isComposing) return;
    const ed = editor();
    const edit = lists.onEnter(ed.value, ed.selectionStart, ed.selectionEnd);
    if (!edit) return;
    e.preventDefault();
    applyEdit(edit);
  }
  function editorKey(e) {
    if (e.key === "Enter" && !e.shiftKey && !e.ctrlKey && !e.metaKey && !e.altKey) {
      enterInList(e);
    } else if ((e.ctrlKey || e.metaKey) && e.shiftKey && e.code === "Digit9") {
      e.preventDefault();
      toggleChecklist();
    }
  }

  // What the block shows before the point (x, y): its text, a line break as "\n".
  function textBefore(block, x, y) {
    let node = null;
    let offset = 0;
    if (document.caretPositionFromPoint) {
      const p = document.caretPositionFromPoint(x, y);
      if (p) [node, offset] = [p.offsetNode, p.offset];
    } else if (document.caretRangeFromPoint) {
      const r = document.caretRangeFromPoint(x, y);
      if (r) [node, offset] = [r.startContainer, r.startOffset];
    }
    if (!node || !block.contains(node)) return "";
    const range = document.createRange();
    range.setStart(block, 0);
    range.setEnd(node, offset);
    const part = range.cloneContents();
    for (const br of part.querySelectorAll("br")) br.replaceWith("\n");
    return part.textContent;
  }

  // A tap on a note's text opens the editor with the caret at that place (Keep, Apple Notes:
  // tap and type). A box stays a tick; links, pictures, Related and a selection are theirs.
  function editAtTap(e) {
    if (!state.path || state.editing || !grants.writable() || e.button) return;
    if (e.target.closest("a, button, input, label, img, summary, audio, video, .related")) return;
    const sel = window.getSelection();
    if (sel && !sel.isCollapsed && $("view").contains(sel.anchorNode)) return;
    const text = editor().value;
    const block = e.target.closest("[data-line]");
    const at =
      block && $("view").contains(block)
        ? lists.caretFor(
            text,
            Number(block.dataset.line),
            Number(block.dataset.end),
            textBefore(block, e.clientX, e.clientY),
          )
        : text.length; // below the last block: at the end
    setEditing(true);
    const ed = editor();
    // near the caret's line first (a guess: wrapped lines count as one), then the browser
    // brings the caret itself into view
    const lineHeight = parseFloat(getComputedStyle(ed).lineHeight) || 22;
    const line = text.slice(0, at).split("\n").length - 1;
    ed.scrollTop = Math.max(0, line * lineHeight - ed.clientHeight / 3);
    ed.focus();
    ed.setSelectionRange(at, at);
  }

  // A checkbox ticked in the formatted view changes its line; saved at once (with If-Match)
  // unless there are other unsaved changes, which it then joins.
  async function toggleTask(n, box) {
    const lines = editor().value.split("\n");
    const line = lines[n] || "";
    const flipped = line.replace(
      /^(\s*(?:[-*+]|\d{1,9}[.)])\s+)\[([ xX])\]/,
      (_, lead, mark) => lead + (mark === " " ? "[x]" : "[ ]"),
    );
    if (flipped === line) {
      box.checked = !box.checked;
      return;
    }
    lines[n] = flipped;
    editor().value = lines.join("\n");
    if (!(await core.act(() => save(false))())) {
      const now = editor().value.split("\n"); // not saved: that tick is undone, nothing else
      if (now[n] === flipped) now[n] = line;
      editor().value = now.join("\n");
      updateDirty();
      renderView();
    }
  }

  // The banner over a note: "gone" (deleted or moved elsewhere while edited here: reload or
  // keep mine) or "copy" (both changed the same lines: where this edit was kept).
  function showConflict(gone, copy) {
    $("conflict-text").textContent = gone
      ? "This note was deleted or moved elsewhere."
      : "Someone changed the same lines meanwhile. This is their version; yours is kept, " +
        "whole, as “" +
        paths.nameOf(copy) +
        "”.";
    $("conflict").dataset.copy = copy || "";
    for (const id of ["reload", "overwrite"]) $(id).hidden = !gone;
    for (const id of ["open-copy", "conflict-ok"]) $(id).hidden = !!gone;
    $("conflict").hidden = false;
    if (!gone) return;
    $("status").textContent = "Not saved";
    $("status").className = "bad";
  }

  // A write of this page's own is under way: the feed's news of the open note waits for it
  // (the news may be that very write), then the note is looked at once.
  async function writing(fn) {
    state.writes = (state.writes || 0) + 1;
    try {
      return await fn();
    } finally {
      state.writes--;
      if (!state.writes && state.recheck) {
        state.recheck = false;
        checkOpenNote().catch(() => {});
      }
    }
  }

  // One save at a time, in order: each starts from the version the one before it made.
  let saveChain = Promise.resolve();
  async function save(force) {
    if (!state.path && !state.blank) return false;
    const run = saveChain.then(() => writing(() => saveNow(force)));
    saveChain = run.catch(() => {});
    return run;
  }

  function newId() {
    return crypto.randomUUID ? crypto.randomUUID() : String(Date.now()) + Math.random();
  }

  // Save the editor's text: through merge, from the version it was loaded as (what changed
  // elsewhere meanwhile is merged in; overlapping changes keep this edit as a conflict copy).
  // A new note's first save creates it, named from its first line. `force`: keep mine.
  async function saveNow(force) {
    const content = editor().value;
    if (state.blank) return createFromText(content);
    // not sent yet
    if (state.path.startsWith("new:")) return offline.keepOffline(state.path, content);
    if (content === state.saved && !force) return true;
    const path = state.path;
    let r;
    try {
      if (force) {
        r = await core.api("PUT", "/notes/" + core.enc(path), {content: fromEditor(content)});
        r = {data: {note: r.data, merged: false}};
      } else {
        r = await core.api("POST", "/notes/" + core.enc(path) + "/merge", {
          base: state.etag,
          content: fromEditor(content),
          clientName: deviceName(),
        });
      }
    } catch (e) {
      if (offline.unreachable(e) && offline.offlineOn()) return offline.keepOffline(path, content);
      if (e.status === 409 && e.error && e.error.conflictPath)
        return clashed(e.error, path, content);
      if (e.status === 404 && force) {
        // gone: keep mine
        r = await core.api("POST", "/notes", {path, content: fromEditor(content)});
        r = {data: {note: r.data, merged: false}};
        core.loadTree().catch(() => {});
      } else if (e.status === 404) {
        showConflict(true);
        return false;
      } else {
        throw e;
      }
    }
    if (path === state.path) saved(r.data.note, content);
    return true;
  }

  // The server has `note`; the editor sent `sent`. What was merged in shows in the editor,
  // without losing what was typed since (merged here too, three ways).
  function saved(note, sent) {
    const theirs = toEditor(note.content);
    let kept = false;
    if (theirs !== sent) {
      const now = editor().value;
      const m = now === sent ? {text: theirs} : merge.merge3(sent, theirs, now);
      kept = !!m.conflict; // typed here over what was merged in: the editor keeps it, unsaved
      if (!kept) replaceText(m.text);
      if (!state.editing) renderView();
    }
    // kept: the next save starts from the version this one started from, so the server
    // merges the other change in again (or keeps a copy), never writes over it
    if (!kept) state.etag = note.etag;
    state.known = note.etag;
    savedHere.set(note.path, Date.now());
    state.saved = theirs;
    state.title = note.title || state.title;
    $("title").textContent = state.title;
    $("path").textContent = note.path;
    $("modified").textContent = "Edited " + core.ago(note.modified);
    offline.mirrorPut(note);
    if (editor().value === state.saved) dropDraft();
    $("conflict").hidden = true;
    $("status").textContent = "Saved";
    $("status").className = "";
    updateDirty();
    if (kept) scheduleSave(); // the next save merges it on the server (a copy if it overlaps)
    if (!state.editing) renderView();
  }

  // Both changed the same lines: the note keeps the other change; this edit is kept whole
  // beside it. Show the note as it is, and say where this edit went.
  async function clashed(err, path, sent) {
    ownCopy(err.conflictPath);
    const now = editor().value;
    if (path === state.path) {
      dropDraft();
      state.saved = now;
      if (now !== sent) {
        // typed on while the save was on its way: the copy holds all of it (or, when the copy
        // cannot be written, this browser keeps it as the note's draft, shown on opening)
        try {
          await core.api("PUT", "/notes/" + core.enc(err.conflictPath), {content: fromEditor(now)});
        } catch (e) {
          core.setItem("local", draftKey(err.path), drafts.record(now, undefined, Date.now()));
        }
      }
      await openNote(err.path);
      showConflict(false, err.conflictPath);
    } else {
      core.toast(
        "“" +
          paths.nameOf(path) +
          "” changed meanwhile: your edit is kept as " +
          paths.nameOf(err.conflictPath),
      );
    }
    core.loadTree().catch(() => {});
    core.loadRecent().catch(() => {});
    return false;
  }

  async function createFromText(content) {
    if (!content.trim()) return true;
    const own = state.grant && state.grant.folder;
    const body = {content};
    if (own) body.folder = own;
    let r;
    try {
      r = await core.api("POST", "/notes", body, {"Idempotency-Key": state.newKey});
    } catch (e) {
      if (offline.unreachable(e) && offline.offlineOn()) return offline.keepOffline(null, content);
      throw e;
    }
    core.removeItem("local", draftKey(drafts.newName(state.newKey))); // the note is made
    state.blank = false;
    mine(r.data.path, "created");
    state.path = r.data.path;
    core.setItem("session", "notesvc.open", state.path);
    // the answer may be an earlier try's (the same key, its answer lost): the editor keeps
    // what was typed since, and saves it through merge from the version that was made
    state.crlf = false;
    saved(r.data, toEditor(r.data.content));
    if (dirty()) scheduleSave();
    core.loadTree().catch(() => {});
    return true;
  }

  // At the start: the new notes a closed tab was writing (their drafts, web/drafts.js) are
  // sent now, each made once (its create's key: an answer lost as the tab closed is not
  // made twice), or handed to the outbox when the server cannot be reached; the list shows
  // them. Without a connection and the outbox, they wait here for the next start.
  async function sendNewDrafts() {
    if (!state.key || !grants.writable()) return;
    const prefix = draftKey("");
    const names = core.itemNames("local", prefix).map((k) => k.slice(prefix.length));
    const queued = offline.offlineOn() ? offline.waiting() : [];
    let made = 0;
    for (const [name, step] of drafts.onStart(names, readDraft, queued)) {
      const draft = readDraft(name);
      if (step === "send") {
        try {
          await createDraft(name, draft);
          made++;
        } catch (e) {
          if (!offline.unreachable(e))
            core.toast("A new note kept here was not sent: " + e.message, true);
          if (!offline.unreachable(e) || !offline.offlineOn()) continue; // kept for later
          const folder = (state.grant && state.grant.folder) || "";
          const once = drafts.createKey(name);
          await offline.updateOutbox((items) =>
            outbox.queueCreate(items, name, folder, draft.content, newId, once),
          );
        }
      } else if (step === "queue") {
        await offline.updateOutbox((items) =>
          outbox.queueSave(items, name, null, draft.content, newId),
        );
      }
      core.removeItem("local", draftKey(name));
    }
    if (made) core.loadTree().catch(() => {}); // (and the recent list)
  }
  async function createDraft(name, draft) {
    const body = {content: draft.content};
    if (state.grant && state.grant.folder) body.folder = state.grant.folder;
    const once = {"Idempotency-Key": drafts.createKey(name)};
    let note = (await core.api("POST", "/notes", body, once)).data;
    mine(note.path, "created");
    if (toEditor(note.content) !== draft.content) {
      // the answer of an earlier try (the tab closed as it went): what was typed since
      // goes through merge
      try {
        const {data} = await core.api("POST", "/notes/" + core.enc(note.path) + "/merge", {
          base: note.etag,
          content: draft.content,
          clientName: deviceName(),
        });
        note = data.note;
      } catch (e) {
        const copied = e.status === 409 && e.error && e.error.conflictPath; // kept as a copy
        if (!copied && !offline.unreachable(e)) throw e;
        // the note is made: the rest is its draft, back when it is opened
        if (!copied)
          core.setItem(
            "local",
            draftKey(note.path),
            drafts.record(draft.content, note.etag, Date.now()),
          );
      }
    }
    if (offline.offlineOn()) offline.mirrorPut(note).catch(() => {});
  }

  // Autosave: a second after the last keystroke, or every 3 s while typing goes on, never
  // more than one request a second; and when the page is hidden (a small note then goes out
  // even as the page closes; a large one waits in this browser for the next visit). A new
  // note waits for its first line to be finished (or five quiet seconds): that line names it.
  let saveTimer = 0;
  let lastSave = 0;
  let dirtySince = 0;
  function scheduleSave() {
    clearTimeout(saveTimer);
    const now = Date.now();
    if (!dirtySince) dirtySince = now;
    const naming = saveTiming.naming(state.blank, editor().value);
    saveTimer = setTimeout(autosave, saveTiming.wait(now, dirtySince, lastSave, naming));
  }
  let saveFailures = 0;
  async function autosave() {
    dirtySince = 0;
    if (!dirty()) return;
    if (state.writes) return scheduleSave(); // one at a time: the next one after this
    lastSave = Date.now();
    $("status").textContent = "Saving…";
    try {
      await save(false);
      saveFailures = 0;
    } catch (e) {
      // Kept in this browser meanwhile; tried again, less and less often; said once.
      keepDraft();
      saveFailures++;
      $("status").textContent = offline.unreachable(e) ? "Not saved: no connection" : "Not saved";
      $("status").className = "bad";
      if (saveFailures === 1 && !offline.unreachable(e) && e.status !== 401)
        core.toast(e.message, true);
      clearTimeout(saveTimer);
      saveTimer = setTimeout(autosave, saveTiming.retry(saveFailures));
      return;
    }
    if (dirty()) scheduleSave(); // typed on meanwhile
  }
  function saveAsThePageHides() {
    const content = editor().value;
    const send = saveTiming.sendsAsThePageHides({
      dirty: dirty(),
      path: state.path,
      blank: state.blank,
      writes: state.writes,
      bytes: new Blob([content]).size,
      key: state.key,
      keyBase: state.keyBase,
      base: state.base,
    });
    keepDraft(); // either way: until the next visit sees it saved
    if (!send) return;
    fetch(state.base + "/notes/" + core.enc(state.path) + "/merge", {
      method: "POST",
      keepalive: true,
      mode: "same-origin",
      credentials: "omit",
      headers: {
        "Content-Type": "application/json",
        "X-Service-Key": state.key,
        "Idempotency-Key": newId(),
      },
      body: JSON.stringify({
        base: state.etag,
        content: fromEditor(content),
        clientName: deviceName(),
      }),
    }).catch(() => {});
  }

  function deviceName() {
    try {
      return JSON.parse(core.getItem("local", "notesvc.device") || "{}").name || "web client";
    } catch (e) {
      return "web client";
    }
  }

  async function reloadTheirs() {
    dropDraft();
    const path = state.path;
    state.saved = editor().value; // nothing to ask about: the person chose theirs
    try {
      await openNote(path);
    } catch (e) {
      if (e.status !== 404) throw e;
      closeNote();
      core.showPane("notes");
      await core.loadTree();
      core.toast(path + " is no longer there");
    }
  }

  // The open note may have changed elsewhere: take the new text when nothing is unsaved,
  // otherwise say so and let the person choose.
  async function checkOpenNote() {
    const path = state.path;
    if (!path || !state.key) return;
    let r;
    try {
      r = await core.api("GET", "/notes/" + core.enc(path));
    } catch (e) {
      if (e.status === 404 && path === state.path) showConflict(true);
      return;
    }
    if (path !== state.path || r.data.etag === state.etag) return;
    if (dirty()) return save(false); // merged with what is typed here
    const editing = state.editing;
    showNote(r.data);
    setEditing(editing);
    updateDirty();
    core.toast("“" + state.title + "” changed elsewhere: this is the new text");
  }

  let lastLook = 0;
  async function lookAgain() {
    // Back to the page after a while: the tree and the open note may have moved on.
    if (Date.now() - lastLook < 10000 || !state.key || $("app").hidden) return;
    lastLook = Date.now();
    await Promise.all([core.loadTree(), checkOpenNote()]);
  }

  // A [[link]] to a note that is not there yet: create it where the link says.
  async function createNote(path) {
    const {data} = await core.api("POST", "/notes", {
      path,
      content: "# " + paths.nameOf(path) + "\n\n",
    });
    mine(data.path, "created");
    await core.loadTree();
    await openNote(data.path, {edit: true});
  }

  // A new note is written first: no path to choose; its first line names it when it is
  // first saved (in notes/inbox, or a folder key's own folder).
  async function newNote() {
    if (!(await confirmLeave())) return;
    closeNote();
    state.blank = true;
    state.newKey = newId(); // its create, sent again after a lost answer, is made once
    $("empty").hidden = true;
    $("note-bar").hidden = false;
    $("title").textContent = "New note";
    $("path").textContent = ""; // (the editor's placeholder: the first line is its title)
    $("modified").textContent = "";
    // Always blank: a new note's draft is its own (sent at the start, or by the outbox).
    // Only the one draft an older page kept for every new note comes back, once, as this
    // note's own.
    const draft = readDraft(NEW_NOTE);
    core.removeItem("local", draftKey(NEW_NOTE));
    if (drafts.restoresNew(draft)) {
      editor().value = draft.content;
      $("draft-text").textContent = drafts.newNotice(draft);
      $("draft").hidden = false;
      keepDraft();
    }
    setEditing(true);
    updateDirty();
    core.showPane("note");
    editor().focus();
  }

  async function moveNote() {
    if (!state.path) return;
    if (dirty() && !(await save(false))) return;
    const input = el("input", {
      type: "text",
      id: "move-path",
      autocomplete: "off",
      spellcheck: "false",
    });
    input.value = state.path.replace(/^notes\//, "").replace(/\.md$/, "");
    const links = el("input", {type: "checkbox", id: "move-links"});
    links.checked = true;
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && dialogDone) dialogDone("move");
    });
    const v = await dialog(
      "Move or rename",
      [
        el("label", {for: "move-path"}, "New name (folders with /)"),
        input,
        el("label", {class: "check"}, links, " Update links to it in other notes"),
      ],
      [
        ["cancel", "Cancel"],
        ["move", "Move", "primary"],
      ],
      input,
    );
    if (v !== "move") return;
    const to = paths.toNotePath(input.value);
    if (to === state.path) return;
    mine(state.path, "moved");
    const {data} = await core.api(
      "PATCH",
      "/notes/" + core.enc(state.path) + "/move",
      {path: to, updateLinks: links.checked},
      {"If-Match": state.etag},
    );
    state.saved = editor().value;
    await openNote(data.path);
    await core.loadTree();
    core.toast("Moved to " + data.path);
  }

  async function deleteNote() {
    if (!state.path) return;
    const v = await choose(
      "Move to trash?",
      "“" + state.title + "” goes to the trash, where it can be restored.",
      [
        ["cancel", "Cancel"],
        ["delete", "Move to trash", "primary"],
      ],
    );
    if (v !== "delete") return;
    const path = state.path;
    mine(path, "deleted");
    try {
      await core.api("DELETE", "/notes/" + core.enc(path), undefined, {"If-Match": state.etag});
    } catch (e) {
      if (e.status === 412) throw new Error("It changed elsewhere: reload it before deleting.");
      throw e;
    }
    dropDraft();
    closeNote();
    core.showPane("notes");
    await core.loadTree();
    core.toast(
      "Moved " + paths.nameOf(path) + " to the trash",
      false,
      core.features.history ? ["Undo", () => undoDelete(path)] : null,
    );
  }

  async function loadBacklinks(path) {
    const box = $("backlinks");
    box.hidden = true;
    let r;
    try {
      r = await core.api("GET", "/plugins/backlinks/" + core.enc(path));
    } catch (e) {
      return;
    } // the plugin may be off
    if (path !== state.path) return;
    const list = r.data.backlinks || r.data.notes || [];
    if (!list.length) return;
    const items = list.map((n) =>
      el(
        "li",
        {},
        el(
          "button",
          {type: "button", class: "link", onclick: core.act(() => openNote(n.path))},
          n.title || n.path,
        ),
      ),
    );
    box.replaceChildren(el("strong", {}, "Linked from"), el("ul", {}, ...items));
    box.hidden = false;
  }

  // Related: the notes nearest the open one in meaning (embeddings on), at the end of its
  // formatted text, where it scrolls with it (a phone keeps its room for the note); kept
  // across renders of the same note. Off, failing or empty: nothing shows.
  let related = null; // {path, box}
  async function loadRelated(path) {
    related = null;
    for (const old of $("view").querySelectorAll(".related")) old.remove();
    await featuresRead.catch(() => {});
    if (!core.features.related) return; // embeddings off: nothing to ask for
    let r;
    try {
      r = await core.api("GET", "/notes/" + core.enc(path) + "/related?limit=5");
    } catch (e) {
      return;
    }
    if (path !== state.path) return;
    const list = (r.data.results || []).filter((n) => n.path !== path).slice(0, 5);
    if (!list.length) return;
    const items = list.map((n) =>
      el(
        "li",
        {},
        el(
          "button",
          {
            type: "button",
            class: "link",
            "data-path": n.path,
            onclick: core.act(() => openNote(n.path)),
          },
          n.title || paths.nameOf(n.path),
        ),
      ),
    );
    const box = el(
      "aside",
      {class: "related", "aria-label": "Related notes"},
      el("h2", {}, "Related"),
      el("ul", {}, ...items),
    );
    related = {path, box};
    $("view").append(box);
  }

  // -- history and the trash (where the server keeps them) ----------------------------------

  function when(iso) {
    const t = Date.parse(iso);
    return t ? new Date(t).toLocaleString() : iso;
  }

  // Why a version was kept, in words.
  const REASONS = {
    updated: "edited",
    merged: "merged with an edit from another device",
    external: "changed outside notesvc",
    moved: "before a move",
    deleted: "before it was deleted",
    restored: "before a restore",
    linksRewritten: "links updated",
    dav: "saved by another app",
  };

  function dayAndTime(iso) {
    const t = new Date(iso);
    const days = Math.round(
      (new Date().setHours(0, 0, 0, 0) - new Date(t).setHours(0, 0, 0, 0)) / 864e5,
    );
    const time = t.toLocaleTimeString([], {hour: "2-digit", minute: "2-digit"});
    if (days === 0) return "Today, " + time;
    if (days === 1) return "Yesterday, " + time;
    return (
      t.toLocaleDateString([], {weekday: "short", day: "numeric", month: "short"}) + ", " + time
    );
  }

  // What changed, word by word; long unchanged stretches shrink to their ends.
  function wordDiffView(before, after) {
    const out = el("p", {class: "words"});
    const parts = merge.wordDiff(before, after);
    parts.forEach((part, i) => {
      if (part.op !== "same") {
        out.append(el(part.op === "add" ? "ins" : "del", {}, part.text));
        return;
      }
      const t = part.text;
      const head = i > 0 ? 80 : 0; // after a change: its context
      const tail = i < parts.length - 1 ? 80 : 0; // before one
      if (t.length <= head + tail + 40) out.append(t);
      else
        out.append(t.slice(0, head), el("span", {class: "gap"}, " … "), t.slice(t.length - tail));
    });
    return out;
  }

  // Neighbouring versions a person cannot tell apart fold into one row: the same content
  // (ETag), or the same reason, size, summary and saver within a minute (autosaves of one
  // burst of typing). Each fold: {v: its newest version, n: how many, from: its oldest}.
  function foldVersions(versions) {
    const like = (a, b) =>
      a.etag === b.etag ||
      (a.reason === b.reason &&
        a.size === b.size &&
        a.summary === b.summary &&
        a.savedBy === b.savedBy &&
        Math.abs(Date.parse(a.savedAt) - Date.parse(b.savedAt)) <= 60000);
    const folds = [];
    for (const v of versions) {
      const last = folds[folds.length - 1];
      if (last && like(last.from, v)) {
        last.n++;
        last.from = v;
      } else folds.push({v, n: 1, from: v});
    }
    return folds;
  }

  // A version's row, under its time: why, who, what changed in a few words, and by how
  // much the change made then (to the next newer version, or to the note) changed its size.
  function versionLine(fold, after) {
    const {v, n} = fold;
    const d = after - fold.from.size;
    const size = (d > 0 ? "+" : d < 0 ? "−" : "±") + paths.sizeText(Math.abs(d));
    const words = [REASONS[v.reason] || v.reason, v.savedBy, v.summary, size];
    if (n > 1) words.unshift(n + " saves");
    return words.filter(Boolean).join(" · ");
  }

  // Restoring writes the version whatever this device holds of the note: text not sent yet
  // (in the editor, or a draft from an earlier visit) is dropped first, asking when there is
  // some; never saved (or merged, or kept as a conflict copy) on the way.
  async function dropUnsent(when) {
    clearTimeout(saveTimer);
    await saveChain;
    if (dirty()) {
      const choice = await choose(
        "Restore this version?",
        "What you wrote in “" +
          state.title +
          "” on this device and did not send yet is dropped, and the note becomes as it was " +
          when +
          ".",
        [
          ["restore", "Drop it and restore", "primary"],
          ["cancel", "Keep writing"],
        ],
      );
      if (choice !== "restore") return false;
    }
    dropDraft();
    editor().value = state.saved;
    state.etag = state.known || state.etag; // a draft's older base goes with it
    updateDirty();
    return true;
  }

  async function restoreVersion(path, id) {
    const url = "/notes/" + core.enc(path) + "/versions/" + core.enc(id) + "/restore";
    try {
      return await core.api("POST", url, undefined, {"If-Match": state.etag});
    } catch (e) {
      if (e.status !== 412) throw e;
      // changed elsewhere meanwhile (that text is kept as a version too): restore over it
      const now = await core.api("GET", "/notes/" + core.enc(path));
      return core.api("POST", url, undefined, {"If-Match": now.data.etag});
    }
  }

  // The history as a timeline: when, why, who, and what changed since, word by word; restore
  // in one tap.
  async function showHistory() {
    if (!state.path) return;
    const path = state.path;
    const {data} = await core.api("GET", "/notes/" + core.enc(path) + "/versions?limit=50");
    const base = "/notes/" + core.enc(path) + "/versions/";
    const list = el("ol", {class: "timeline", id: "versions"});
    const detail = el("div", {id: "version-detail"});
    let after = new Blob([fromEditor(state.saved)]).size; // the note's size now
    for (const fold of foldVersions(data.versions)) {
      const v = fold.v;
      const changes = core.act(async () => {
        const r = await core.api("GET", base + core.enc(v.id));
        const now = editor().value;
        detail.replaceChildren(
          el("h3", {}, "From " + dayAndTime(v.savedAt) + " to now"),
          r.data.content === now
            ? el("p", {}, "The same as now.")
            : wordDiffView(r.data.content, now),
          el("p", {class: "muted"}, "Struck out: only then. Underlined: only now."),
        );
        detail.scrollIntoView({block: "nearest"});
      });
      const view = core.act(async () => {
        const r = await core.api("GET", base + core.enc(v.id));
        detail.replaceChildren(
          el("h3", {}, "As it was " + dayAndTime(v.savedAt)),
          el("pre", {}, r.data.content),
        );
      });
      const restore = core.act(async () => {
        dialogDone("cancel");
        if (path !== state.path || !(await dropUnsent(dayAndTime(v.savedAt)))) return;
        await writing(async () => {
          const r = await restoreVersion(path, v.id);
          dropDraft();
          showNote(r.data);
          setEditing(false);
          updateDirty();
        });
        core.toast("Restored the version of " + dayAndTime(v.savedAt));
      });
      list.append(
        el(
          "li",
          {"data-version": v.id, "data-count": String(fold.n)},
          el(
            "span",
            {class: "when"},
            el("strong", {}, dayAndTime(v.savedAt)),
            el("small", {class: "muted", title: paths.sizeText(v.size)}, versionLine(fold, after)),
          ),
          el(
            "span",
            {class: "actions"},
            el("button", {type: "button", onclick: changes}, "Changes"),
            el("button", {type: "button", onclick: view}, "View"),
            grants.writable() ? el("button", {type: "button", onclick: restore}, "Restore") : null,
          ),
        ),
      );
      after = fold.from.size;
    }
    if (!data.versions.length) list.append(el("li", {class: "muted"}, "No earlier versions yet."));
    // its creation, last (as the server still knows it, and when no older row is left out)
    const made = data.created;
    if (made && data.versions.length === data.total) {
      list.append(
        el(
          "li",
          {id: "version-created"},
          el(
            "span",
            {class: "when"},
            el("strong", {}, dayAndTime(made.at)),
            el("small", {class: "muted"}, ["created", made.by].filter(Boolean).join(" · ")),
          ),
        ),
      );
    }
    await dialog("History of " + state.title, [list, detail], [["cancel", "Close"]]);
  }

  async function restoreFromTrash(item, to) {
    try {
      const r = await core.api(
        "POST",
        "/trash/" + core.enc(item.id) + "/restore",
        to ? {path: to} : undefined,
      );
      return r.data;
    } catch (e) {
      if (e.status !== 409) throw e;
      const input = el("input", {
        type: "text",
        id: "restore-path",
        autocomplete: "off",
        spellcheck: "false",
      });
      input.value = item.path.replace(/(\.\w+)$/, " (restored)$1");
      const v = await dialog(
        "Restore under another name",
        [e.message, el("label", {for: "restore-path"}, "Restore as"), input],
        [
          ["cancel", "Cancel"],
          ["restore", "Restore", "primary"],
        ],
        input,
      );
      return v === "restore" ? restoreFromTrash(item, input.value.trim()) : null;
    }
  }

  async function showTrash() {
    const {data} = await core.api("GET", "/trash?limit=100");
    const list = el("ul", {class: "list", id: "trash-items"});
    const detail = el("div", {id: "trash-detail"});
    for (const item of data.items) {
      const view = core.act(async () => {
        const r = await core.api("GET", "/trash/" + core.enc(item.id));
        detail.replaceChildren(el("h3", {}, item.path), el("pre", {}, r.data.content || ""));
      });
      const restore = core.act(async () => {
        dialogDone("cancel");
        const rec = await restoreFromTrash(item);
        if (!rec) return;
        await core.loadTree();
        core.toast("Restored " + rec.path);
        if (rec.path.startsWith("notes/")) await openNote(rec.path);
      });
      const purge = core.act(async () => {
        await core.api("DELETE", "/trash/" + core.enc(item.id));
        row.remove();
      });
      const row = el(
        "li",
        {"data-trash": item.id},
        el(
          "span",
          {},
          item.path,
          el("small", {class: "muted"}, " · deleted " + when(item.deletedAt)),
        ),
        el(
          "span",
          {class: "actions"},
          item.path.endsWith(".md") ? el("button", {type: "button", onclick: view}, "View") : null,
          grants.writable() ? el("button", {type: "button", onclick: restore}, "Restore") : null,
          state.grant
            ? null
            : el(
                // purging for good is the owner's alone
                "button",
                {
                  type: "button",
                  class: "danger",
                  onclick: purge,
                  "aria-label": "Delete forever: " + item.path,
                },
                "Delete",
              ),
        ),
      );
      list.append(row);
    }
    if (!data.items.length) list.append(el("li", {class: "muted"}, "The trash is empty."));
    await dialog("Trash", [list, detail], [["cancel", "Close"]]);
  }

  // Undo a delete: the newest trash item with that path comes back.
  async function undoDelete(path) {
    const {data} = await core.api("GET", "/trash?limit=50");
    const item = data.items.find((i) => i.path === path);
    if (!item) throw new Error("It is no longer in the trash.");
    const rec = await restoreFromTrash(item);
    if (!rec) return;
    await core.loadTree();
    await openNote(rec.path);
  }

  // -- attachments: a photo, a file, a pasted image ------------------------------------------

  function attachmentPath(file) {
    const now = new Date();
    const stamp = now.toISOString().replace(/[-:]/g, "").replace("T", "-").slice(0, 15);
    const dot = file.name.lastIndexOf(".");
    const ext = (
      dot > 0 ? file.name.slice(dot + 1) : file.type.split("/")[1] || "bin"
    ).toLowerCase();
    const stem =
      (dot > 0 ? file.name.slice(0, dot) : file.name || "file")
        .normalize("NFKD")
        .replace(/[^\w-]+/g, "-")
        .replace(/^-+|-+$/g, "")
        .slice(0, 60) || "file";
    const folder = state.path ? markdown.folderOf(state.path).replace(/^notes\/?/, "") : "";
    return (
      "attachments/" +
      (folder ? folder + "/" : "") +
      stamp +
      "-" +
      stem +
      "." +
      ext.replace(/[^\w]/g, "")
    );
  }

  // PUT the file's bytes; never over another file (If-None-Match: *): a taken name gets -2, -3…
  // `once`: an Idempotency-Key (the outbox's): sent again after a lost answer, the upload is
  // made once. `path`: the name chosen before (a file kept offline: its link is in the note).
  async function upload(file, once, path) {
    path = path || attachmentPath(file);
    for (let n = 1; ; n++) {
      const tried = n === 1 ? path : path.replace(/(\.\w+)$/, "-" + n + "$1");
      const headers = {
        "Content-Type": file.type || "application/octet-stream",
        "If-None-Match": "*",
      };
      if (once) headers["Idempotency-Key"] = once + ":" + n;
      try {
        const r = await core.api("PUT", "/attachments/" + core.enc(tried), file, headers);
        return r.data;
      } catch (e) {
        if (e.status !== 412 || n >= 5) throw e;
      }
    }
  }

  // A photo or file is an edit like typing: uploaded, its link put at the cursor, and the
  // note autosaved on the same schedule. With no connection and the notes kept on this device,
  // the file waits in the outbox (up to OFFLINE_FILE_BYTES) and its link, to the path it will
  // have, goes in at once: the upload is sent before the edit that links it. Otherwise nothing
  // is inserted and the page says so (the text typed meanwhile is kept as always).
  async function attach(files) {
    if (!files.length) return;
    if (state.blank && !(await save(false).catch(() => false))) return;
    if (state.blank) {
      core.toast("Write the note's first line first (it names the note), then add the file.", true);
      return;
    }
    if (!state.path) return;
    if (drafts.isNew(state.path)) {
      core.toast("This note waits to be sent: add files once it is on the server.", true);
      return;
    }
    if (!state.editing) setEditing(true);
    const ed = editor();
    const path = state.path;
    try {
      for (const file of files) {
        const label = (file.name || "image").replace(/[[\]]/g, "");
        core.toast("Uploading " + (file.name || "the image") + "…");
        let data;
        try {
          data = await upload(file);
        } catch (e) {
          if (!offline.unreachable(e)) throw e;
          if (offline.offlineOn()) {
            data = await offline.keepFile(file, attachmentPath(file), path, label);
            if (!data) return;
          }
        }
        if (!data) {
          core.toast(
            "No connection: “" +
              label +
              "” was not added. Files and photos need the server; add it again once " +
              "you are online.",
            true,
          );
          return;
        }
        if (state.path !== path) return; // another note meanwhile: the file is kept, unlinked
        const md =
          (/^image\//.test(data.contentType) ? "!" : "") +
          "[" +
          label +
          "](" +
          paths.relativeTo(path, data.path) +
          ")";
        const at = ed.selectionStart === undefined ? ed.value.length : ed.selectionEnd;
        const before = ed.value.slice(0, at);
        const insert = (before && !before.endsWith("\n") ? "\n" : "") + md + "\n";
        ed.value = before + insert + ed.value.slice(at);
        ed.setSelectionRange(at + insert.length, at + insert.length);
        core.toast(
          data.kept
            ? "No connection: “" + label + "” is kept on this device and sent when it is back"
            : "Attached " + data.path,
        );
      }
    } finally {
      updateDirty();
      scheduleDraft();
      if (dirty() && grants.writable()) scheduleSave(); // saved as typing is
    }
  }

  // -- the change feed: the tree and the open note follow edits made elsewhere ----------------

  let feedRun = 0; // one follower at a time: a new connection starts a new one

  // Stops the follower (the key stopped working: the next connection starts a new one).
  function stopFeed() {
    feedRun++;
  }
  // Notes this page is creating, moving or deleting itself: the feed's report of that very
  // change is no news. Only that kind of change: another device's edit of a note made here
  // a moment ago is news (it once waited out these 30 s).
  const own = new Map();
  function mine(path, kind) {
    own.set(path, kind);
    setTimeout(() => own.get(path) === kind && own.delete(path), 30000);
  }
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
  let treeTimer = 0;
  function treeSoon() {
    clearTimeout(treeTimer);
    treeTimer = setTimeout(() => core.loadTree().catch(() => {}), 300);
  }
  let recentTimer = 0;
  function recentSoon() {
    clearTimeout(recentTimer);
    recentTimer = setTimeout(() => core.loadRecent().catch(() => {}), 1500);
  }

  function cursorAfterGone(e) {
    // A 410 says where the server's changes end: from there on, after listing again.
    const last = e.error && (e.error.last !== undefined ? e.error.last : null);
    if (Number.isInteger(last)) return last;
    const m = /since=(\d+)/.exec(e.message || "");
    return m ? parseInt(m[1], 10) : null;
  }

  async function changeCursor() {
    // A server that knows `since=latest` answers the cursor alone; an older one (behind a
    // relay, say) says 400, and its feed is paged through to its end as before.
    try {
      return (await core.api("GET", "/changes?since=latest")).data.last;
    } catch (e) {
      if (e.status !== 400) throw e;
    }
    let since = 0;
    for (let page = 0; page < 20; page++) {
      let r;
      try {
        r = await core.api("GET", "/changes?wait=0&limit=1000&since=" + since);
      } catch (e) {
        if (e.status === 410) return cursorAfterGone(e);
        throw e;
      }
      since = r.data.last;
      if (!r.data.more) return since;
    }
    return since;
  }

  // Conflict copies this page's own losing edits were kept as: it said so when it made them.
  const ownCopies = new Set();
  function ownCopy(path) {
    ownCopies.add(path);
  }
  // When this page last saved each note: a conflict copy of one is an edit that lost to ours.
  const savedHere = new Map();

  // A conflict copy was made of the open note, or of one saved here lately: the edit that won
  // was this device's, which the server's answer did not say. A quiet word, and the copy.
  function copyMade(c) {
    const lately = Date.now() - (savedHere.get(c.conflictOf) || 0) < 10 * 60000;
    if (c.conflictOf !== state.path && !lately) return;
    // the answer to a losing write of this page's own may still be on its way: wait for it
    const look = () => {
      if (state.writes) return setTimeout(look, 300);
      if (ownCopies.has(c.path)) return;
      core.toast("A conflicting edit was kept as a copy", false, [
        "Open the copy",
        () => openNote(c.path),
      ]);
    };
    setTimeout(look, 300);
  }

  function applyChange(c) {
    if (offline.offlineOn()) offline.mirrorChange(c).catch(() => {});
    if (c.kind === "created" && c.conflictOf) copyMade(c);
    if (c.kind === "updated" || c.kind === "modified")
      recentSoon(); // the recent list's order; the tree is the same
    else treeSoon(); // the tree's names (and the recent list)
    if (!state.path || own.get(c.from || c.path) === c.kind) return;
    if (c.kind === "moved" && c.from === state.path) {
      // Follow it at once (a later change in the same batch may name the new path); unsaved
      // text stays and will be saved there.
      core.removeItem("local", draftKey(state.path));
      state.path = c.path;
      $("path").textContent = c.path;
      $("path").title = c.path;
      core.setItem("session", "notesvc.open", c.path);
      keepDraft();
      loadBacklinks(c.path);
      core.reveal(c.path).catch(() => {});
      if (!dirty()) checkOpenNote().catch(() => {}); // a move may rewrite its links
      core.toast("“" + state.title + "” moved to " + c.path);
    } else if (c.path === state.path) {
      if (c.kind === "deleted" && !dirty()) {
        closeNote();
        core.toast(
          c.path + " was deleted elsewhere",
          false,
          core.features.history ? ["Undo", () => undoDelete(c.path)] : null,
        );
      } else if (c.kind === "deleted") {
        showConflict(true);
      } else if (c.etag !== state.etag) {
        // Perhaps our own write: look when it is done.
        if (state.writes) state.recheck = true;
        else checkOpenNote().catch(() => {});
      }
    }
  }

  async function followChanges() {
    const run = ++feedRun;
    const alive = () => run === feedRun && state.key && !$("app").hidden;
    let since = null;
    let pause = 1000;
    while (alive()) {
      try {
        if (since === null) since = await changeCursor();
        // this server gives no cursor: coming back to the page refreshes
        if (since === null) return;
        const r = await core.api("GET", "/changes?wait=20&limit=1000&since=" + since);
        if (!alive()) return;
        for (const c of r.data.changes) applyChange(c);
        since = r.data.last;
        pause = 1000;
        if (r.data.retryAfter) await sleep(r.data.retryAfter * 1000); // too many feeds waiting
      } catch (e) {
        if (e.status === 401 || e.status === 429) return;
        if (e.status === 410) {
          since = cursorAfterGone(e);
          treeSoon();
          checkOpenNote().catch(() => {});
          continue;
        }
        await sleep(pause); // offline, or the server restarts: try again, less and less often
        pause = Math.min(pause * 2, 30000);
      }
    }
  }

  // What this server offers: its features document, kept with its ETag (a later start costs
  // a 304); a server from before it (behind a relay) answers 404, then its OpenAPI paths say.
  // Read once at start; a note opened before the answer waits for it.
  let featuresRead = Promise.resolve();
  const FEATURES_KEPT = "notesvc.features";
  async function fetchFeatures() {
    const kept = JSON.parse(core.getItem("local", FEATURES_KEPT) || "null");
    const mine = kept && kept.base === state.base && kept.etag ? kept : null;
    const ask = mine ? {"If-None-Match": mine.etag} : undefined;
    try {
      const r = await core.api("GET", "/system/features", undefined, ask);
      if (r.status === 304) return mine.data;
      core.setItem(
        "local",
        FEATURES_KEPT,
        JSON.stringify({base: state.base, etag: r.etag, data: r.data}),
      );
      return r.data;
    } catch (e) {
      if (e.status !== 404) throw e;
    }
    const {json} = await core.api("GET", "/openapi.json", undefined, undefined, {raw: true});
    const routes = Object.keys((json && json.paths) || {});
    const has = (end) => routes.some((p) => p.endsWith(end));
    return {
      history: has("/trash") && has("/versions"),
      attachments: has("/attachments"),
      changes: has("/changes"),
    };
  }
  async function readFeatures() {
    try {
      const offered = await fetchFeatures();
      core.features.history = !!offered.history;
      core.features.attachments = !!offered.attachments;
      core.features.changes = !!offered.changes;
      core.features.related = !!offered.related;
    } catch (e) {
      /* the core only */
    }
    $("menu-trash").hidden = !core.features.history;
    $("history").hidden = !core.features.history;
    grants.noteActions();
  }

  // -- search ----------------------------------------------------------------------------------

  function highlight(text, words) {
    const frag = document.createDocumentFragment();
    const folded = paths.fold(text);
    const marks = [];
    for (const w of words) {
      let at = 0;
      for (;;) {
        const i = folded.indexOf(w, at);
        if (i < 0) break;
        if (i === 0 || !/[\p{L}\p{N}]/u.test(folded[i - 1])) marks.push([i, i + w.length]);
        at = i + 1;
      }
    }
    marks.sort((a, b) => a[0] - b[0]);
    let last = 0;
    for (const [s, e] of marks) {
      if (s < last) continue;
      let end = e; // run on to the end of the word: "key" marks "keys"
      while (end < text.length && /[\p{L}\p{N}]/u.test(text[end])) end++;
      frag.append(text.slice(last, s), el("mark", {}, text.slice(s, end)));
      last = end;
    }
    frag.append(text.slice(last));
    return frag;
  }

  // A snippet is raw Markdown: leave out the marks that only make it harder to read.
  let searchSeq = 0;
  let searchTimer = 0;
  async function runSearch() {
    clearTimeout(searchTimer);
    const q = $("search").value.trim();
    if (!q) {
      endSearch(false);
      return;
    }
    const seq = ++searchSeq;
    $("app").classList.add("searching");
    core.showPane("search");
    const {data} = await core.api("GET", "/search?limit=50&q=" + core.enc(q));
    if (seq !== searchSeq) return;
    const words = paths.queryWords(q);
    $("search-hint").hidden = true;
    $("results-info").textContent =
      core.counted(data.total, "note") +
      " · " +
      (data.tookMs < 10 ? data.tookMs.toFixed(1) : Math.round(data.tookMs)) +
      " ms";
    const line = paths.meaningLine(data, q); // nothing while embeddings are off
    $("search-mode").textContent = line;
    $("search-mode").hidden = !line;
    $("results").replaceChildren(
      ...data.results.map((hit, i) =>
        el(
          "li",
          {},
          el(
            "button",
            {
              type: "button",
              id: "hit-" + i,
              "data-path": hit.path,
              onclick: core.act(() => openNote(hit.path)),
            },
            el("span", {class: "t"}, highlight(hit.title, words)),
            el("span", {class: "p"}, hit.path),
            el("span", {class: "s"}, highlight(paths.plainSnippet(hit.snippet), words)),
          ),
        ),
      ),
    );
    if (!data.results.length)
      $("results").appendChild(el("li", {class: "muted"}, paths.nothingLine(data)));
  }

  function endSearch(focusTree) {
    searchSeq++;
    $("search").value = "";
    $("app").classList.remove("searching");
    $("results").replaceChildren();
    $("results-info").textContent = "";
    $("search-mode").hidden = true;
    $("search-hint").hidden = false;
    if (core.NARROW.matches) core.showPane("notes");
    if (focusTree) {
      const target =
        $("tree").querySelector("button[aria-current=true]") || $("tree").querySelector("button");
      if (target) target.focus();
    }
  }

  function moveInResults(step) {
    const buttons = Array.from($("results").querySelectorAll("button"));
    if (!buttons.length) return;
    const at = buttons.indexOf(document.activeElement);
    const next = at < 0 ? (step > 0 ? 0 : buttons.length - 1) : at + step;
    if (next < 0) {
      $("search").focus();
      return;
    }
    buttons[Math.min(next, buttons.length - 1)].focus();
  }

  // -- quick capture: a line in today's note --------------------------------------------------

  async function capture() {
    const input = $("capture");
    const text = input.value.trim();
    if (!text) return;
    let path;
    try {
      path = await appendToToday(text);
    } catch (e) {
      if (!offline.unreachable(e) || !offline.offlineOn()) throw e;
      const at = Date.now();
      // sent when it can be
      await offline.updateOutbox((items) => outbox.queueCapture(items, text, [], newId, at));
      input.value = "";
      core.toast("Kept on this device: it goes to today's note when the server can be reached");
      return;
    }
    input.value = "";
    core.toast("Added to " + paths.nameOf(path));
    await core.loadTree();
  }

  // Append a timed line to today's note (the daily plugin's); return its path.
  // `text`: the line, or a function of today's path giving it. `once`: an Idempotency-Key
  // (the outbox's): a capture sent again after a lost answer is added once (each attempt has
  // its own key, so an answer kept for one is found again). `at`: when it was captured.
  async function appendToToday(text, once, at) {
    const now = at ? new Date(at) : new Date();
    const stamp =
      String(now.getHours()).padStart(2, "0") + ":" + String(now.getMinutes()).padStart(2, "0");
    for (let attempt = 0; attempt < 3; attempt++) {
      const today = await core.api("POST", "/plugins/daily/today");
      const note = today.data;
      const line = typeof text === "function" ? text(note.path) : text;
      const content =
        note.content + (note.content.endsWith("\n") ? "" : "\n") + "- " + stamp + " " + line + "\n";
      const headers = {"If-Match": note.etag};
      if (once) headers["Idempotency-Key"] = once + ":" + attempt;
      const done = await writing(async () => {
        try {
          await core.api("PUT", "/notes/" + core.enc(note.path), {content}, headers);
        } catch (e) {
          if (e.status === 412) return false; // written meanwhile: read it again
          throw e;
        }
        if (state.path === note.path && !dirty()) await openNote(note.path);
        return true;
      });
      if (done) return note.path;
    }
    throw new Error("Today's note keeps changing; try again.");
  }

  // -- ask -----------------------------------------------------------------------------------

  async function ask() {
    const input = $("chat-input");
    const message = input.value.trim();
    if (!message) return;
    core.setSide(true);
    const log = $("chat-log");
    const about = $("about").checked && state.path;
    log.appendChild(
      el(
        "div",
        {class: "msg me"},
        message,
        about ? el("small", {class: "muted"}, "\nabout " + state.title) : null,
      ),
    );
    const pending = el("div", {class: "msg"}, el("span", {class: "muted"}, "Thinking…"));
    log.appendChild(pending);
    log.scrollTop = log.scrollHeight;
    input.value = "";
    const body = {message, channel: "web"};
    if (about) body.notePath = state.path;
    try {
      const {data} = await core.api("POST", "/agent/chat", body);
      const parts = [
        markdown.renderMarkdown(data.reply || "", {from: state.path, link, wikiLink, image}),
      ];
      if (data.sources && data.sources.length) {
        parts.push(el("div", {class: "hint", "aria-hidden": "true"}, "Sources"));
        parts.push(
          el(
            "ul",
            {class: "sources", "aria-label": "Sources"},
            ...data.sources.map((s) =>
              el(
                "li",
                {},
                el(
                  "button",
                  {
                    type: "button",
                    class: "link",
                    "data-path": s.path,
                    onclick: core.act(() => openNote(s.path)),
                  },
                  s.title || s.path,
                ),
              ),
            ),
          ),
        );
      }
      pending.replaceChildren(...parts);
    } catch (e) {
      pending.replaceChildren(el("span", {class: "err"}, e.message));
    }
    log.scrollTop = log.scrollHeight;
  }

  // -- start: wire the controls, connect with what this tab (or device) remembers ------------

  // A task's link in a phone's Reminders or calendar (its DESCRIPTION): /#task=<uid> opens
  // the note that holds the task's line.
  async function openTaskLink() {
    const m = /^#task=([^#&]{1,255})$/.exec(location.hash);
    if (!m) return false;
    history.replaceState(history.state, "", location.pathname + location.search);
    try {
      const {data} = await core.api("GET", "/tasks/" + core.enc(decodeURIComponent(m[1])));
      await openNote(data.path);
      return true;
    } catch (e) {
      core.toast("That task is no longer in the notes.");
      return false;
    }
  }

  async function start() {
    core.setSide(false);
    offline.offlineMenu();
    const moves = state.moves;
    if (offline.offlineOn()) await offline.loadOutboxOrSay();
    featuresRead = readFeatures();
    await Promise.all([
      core.loadTree(),
      featuresRead.catch((e) => (offline.offlineOn() ? null : Promise.reject(e))),
    ]);
    if (core.features.changes) followChanges();
    suggestions.start().catch(() => {}); // an assistant's edits waiting: the badge
    await sendNewDrafts().catch(() => {}); // what a closed tab was writing goes now
    if (offline.offlineOn()) {
      offline.sendOutbox().catch(() => {}); // what waits goes now
      if (new URLSearchParams(location.search).has("shared")) {
        history.replaceState(history.state, "", location.pathname);
      }
      core.act(offline.askShared)(); // the share sheet's items, once the person says yes
    }
    addEventListener("hashchange", core.act(openTaskLink)); // (a link opened in this tab)
    if (await openTaskLink()) return;
    // What this tab had open comes back, unless the person already went somewhere while the
    // tree and the features loaded (a tap on New note is not undone by the restore).
    if (state.moves !== moves || state.path || state.blank) return;
    const last = core.getItem("session", "notesvc.open");
    // (read before a note opens: opening one shows its pane, and that is kept as the pane)
    const pane = core.getItem("session", "notesvc.pane");
    // a phone reloaded on the list (or search, or ask) stays there: the note waits for a tap
    const onList = core.NARROW.matches && pane && pane !== "note";
    if (last) {
      try {
        if (!onList) await openNote(last);
      } catch (e) {
        closeNote();
      }
    } else if (readDraft(NEW_NOTE) && grants.writable()) {
      await newNote(); // an older page's new note that was never saved: its text is back
    }
    if (core.NARROW.matches) {
      core.showPane(
        pane && (pane !== "note" || state.path) ? pane : state.path ? "note" : "notes",
        true,
      );
      history.replaceState({pane: $("app").dataset.pane}, "");
    }
  }

  function wire() {
    $("connect").addEventListener("click", () => core.connect(true));
    $("key").addEventListener("keydown", (e) => {
      if (e.key === "Enter") core.connect(true);
    });
    $("relay-code").addEventListener("keydown", (e) => {
      if (e.key === "Enter") core.connect(true);
    });
    $("remember").addEventListener("change", () => {
      $("remember-warn").hidden = !$("remember").checked;
    });
    $("logout").addEventListener("click", core.act(core.logout));
    for (const id of ["new", "empty-new", "menu-new"])
      $(id).addEventListener("click", core.act(newNote));
    $("menu-refresh").addEventListener(
      "click",
      core.act(async () => {
        await core.loadTree();
        if (state.path && !dirty()) await openNote(state.path);
      }),
    );
    $("overwrite").addEventListener(
      "click",
      core.act(() => save(true)),
    );
    $("reload").addEventListener("click", core.act(reloadTheirs));
    $("open-copy").addEventListener(
      "click",
      core.act(() => openNote($("conflict").dataset.copy)),
    );
    $("conflict-ok").addEventListener("click", () => ($("conflict").hidden = true));
    $("draft-discard").addEventListener(
      "click",
      core.act(() => {
        if (!state.blank) return reloadTheirs();
        dropDraft(); // a new note's draft: the page starts blank again
        editor().value = "";
        updateDirty();
        return undefined;
      }),
    );
    $("edit").addEventListener("click", () => {
      setEditing(!state.editing);
      if (state.editing) editor().focus();
    });
    $("view").addEventListener("click", editAtTap);
    editor().addEventListener("keydown", editorKey);
    editor().addEventListener("beforeinput", (e) => {
      if (e.inputType === "insertLineBreak" || e.inputType === "insertParagraph") enterInList(e);
    });
    // the toolbar takes no focus: the keyboard stays up, the selection stays as it was
    $("editor-tools").addEventListener("mousedown", (e) => e.preventDefault());
    $("checklist").addEventListener("click", toggleChecklist);
    $("back").addEventListener("click", () => core.showPane("notes"));
    $("move").addEventListener("click", core.act(moveNote));
    $("history").addEventListener("click", core.act(showHistory));
    $("menu-trash").addEventListener("click", core.act(showTrash));
    $("attach").addEventListener("click", () => $("attach-file").click());
    $("photo").addEventListener("click", () => $("attach-photo").click());
    for (const id of ["attach-file", "attach-photo"]) {
      $(id).addEventListener(
        "change",
        core.act(async () => {
          const files = Array.from($(id).files);
          $(id).value = "";
          await attach(files);
        }),
      );
    }
    editor().addEventListener("paste", (e) => {
      const files = Array.from((e.clipboardData && e.clipboardData.files) || []);
      if (!files.length || !core.features.attachments) return;
      e.preventDefault();
      core.act(() => attach(files))();
    });
    editor().addEventListener("drop", (e) => {
      const files = Array.from((e.dataTransfer && e.dataTransfer.files) || []);
      if (!files.length || !core.features.attachments) return;
      e.preventDefault();
      core.act(() => attach(files))();
    });
    $("delete").addEventListener("click", core.act(deleteNote));
    editor().addEventListener("input", () => {
      updateDirty();
      scheduleDraft();
      if (grants.writable()) scheduleSave();
    });
    editor().addEventListener("focus", () => $("app").classList.add("typing"));
    editor().addEventListener("blur", () => $("app").classList.remove("typing"));
    $("search").addEventListener("input", () => {
      clearTimeout(searchTimer);
      searchTimer = setTimeout(core.act(runSearch), 250);
    });
    $("search").addEventListener("keydown", (e) => {
      if (e.key === "Enter") {
        e.preventDefault();
        core.act(runSearch)();
      } else if (e.key === "ArrowDown") {
        e.preventDefault();
        moveInResults(1);
      } else if (e.key === "Escape") {
        e.preventDefault();
        endSearch(true);
      }
    });
    $("search").addEventListener("focus", () => {
      if (core.NARROW.matches && $("search").value) core.showPane("search");
    });
    $("results").addEventListener("keydown", (e) => {
      if (e.key === "ArrowDown") {
        e.preventDefault();
        moveInResults(1);
      } else if (e.key === "ArrowUp") {
        e.preventDefault();
        moveInResults(-1);
      } else if (e.key === "Escape") {
        e.preventDefault();
        endSearch(true);
      }
    });
    $("results-close").addEventListener("click", () => endSearch(true));
    $("capture-add").addEventListener("click", core.act(capture));
    $("capture").addEventListener("keydown", (e) => {
      if (e.key === "Enter") core.act(capture)();
    });
    $("chat-send").addEventListener("click", core.act(ask));
    $("chat-input").addEventListener("keydown", (e) => {
      if (e.key === "Enter") core.act(ask)();
    });
    $("toggle-ask").addEventListener("click", () => {
      const open = $("main").classList.contains("side-closed");
      core.setSide(open);
      if (open) $("chat-input").focus();
    });
    for (const b of document.querySelectorAll(".tabs button")) {
      b.addEventListener("click", () => {
        core.showPane(b.dataset.pane);
        if (b.dataset.pane === "search") $("search").focus();
        if (b.dataset.pane === "ask") $("chat-input").focus();
      });
    }
    $("dlg").addEventListener("cancel", (e) => {
      e.preventDefault();
      if (dialogDone) dialogDone("cancel");
    });
    // Menus close when something is chosen or the click lands elsewhere.
    document.addEventListener("click", (e) => {
      for (const m of document.querySelectorAll("details.menu[open]")) {
        if (!m.contains(e.target) || e.target.closest(".menu-list button")) m.open = false;
      }
    });
    document.addEventListener("keydown", (e) => {
      const typing = /^(INPUT|TEXTAREA|SELECT)$/.test(document.activeElement.tagName);
      if ((e.ctrlKey || e.metaKey) && e.key.toLowerCase() === "s") {
        e.preventDefault();
        if (state.path || state.blank) core.act(() => save(false))();
      } else if (e.key === "/" && !typing && !$("app").hidden && !$("dlg").open) {
        e.preventDefault();
        $("search").focus();
        $("search").select();
      } else if (e.key === "Escape") {
        for (const m of document.querySelectorAll("details.menu[open]")) {
          m.open = false;
          m.querySelector("summary").focus();
        }
      }
    });
    window.addEventListener("beforeunload", (e) => {
      keepDraft();
      if (dirty()) {
        e.preventDefault();
        e.returnValue = "";
      }
    });
    document.addEventListener("visibilitychange", () => {
      if (document.hidden) saveAsThePageHides();
      else core.act(lookAgain)();
    });
    window.addEventListener("popstate", (e) => {
      if (e.state && e.state.pane) core.showPane(e.state.pane, true);
    });
    if (window.visualViewport) window.visualViewport.addEventListener("resize", core.fitViewport);
    core.NARROW.addEventListener("change", () => {
      if (!core.NARROW.matches) $("app").classList.toggle("searching", !!$("search").value.trim());
    });
    new MutationObserver(() =>
      core.setItem("session", "notesvc.pane", $("app").dataset.pane),
    ).observe($("app"), {attributes: true, attributeFilter: ["data-pane"]});
  }

  return {
    appendToToday,
    choose,
    confirmLeave,
    deviceName,
    dialog,
    draftKey,
    editor,
    fromEditor,
    keepDraft,
    newId,
    openNote,
    ownCopy,
    readDraft,
    saved,
    sleep,
    start,
    stopFeed,
    toEditor,
    updateDirty,
    upload,
    when,
    wire,
  };
})();
