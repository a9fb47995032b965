"use strict";
// notesvc's web client: one page, no build step, only the public API.
// Requests, the key included, go only to the origin this page was loaded from: a relayUrl
// in the query string is ignored, and an API base on another origin is never used.
// Text from notes and answers reaches the page as text nodes only (never as HTML).

const core = (() => {
  const $ = (id) => document.getElementById(id);
  const enc = encodeURIComponent;
  const NARROW = window.matchMedia("(max-width: 799px)");

  // -- storage: the key for the session (or this device, if asked); drafts on this device --
  // On a relay's shared origin (a relay without per-server origins, which marks the page)
  // every server's page shares one storage: nothing is kept there at all.

  const SHARED_ORIGIN = document.documentElement.dataset.origin === "shared";

  function storage(kind) {
    if (SHARED_ORIGIN) return null;
    try {
      return kind === "local" ? window.localStorage : window.sessionStorage;
    } catch (e) {
      return null;
    } // storage can be switched off; the page still works
  }
  function getItem(kind, name) {
    const s = storage(kind);
    try {
      return s ? s.getItem(name) : null;
    } catch (e) {
      return null;
    }
  }
  function setItem(kind, name, value) {
    const s = storage(kind);
    try {
      if (s) s.setItem(name, value);
    } catch (e) {
      /* full or refused: not fatal */
    }
  }
  // The names kept in a storage that start with `prefix` (none when it is switched off).
  function itemNames(kind, prefix) {
    const s = storage(kind);
    try {
      return s ? Object.keys(s).filter((name) => name.startsWith(prefix)) : [];
    } catch (e) {
      return [];
    }
  }
  function removeItem(kind, name) {
    const s = storage(kind);
    try {
      if (s) s.removeItem(name);
    } catch (e) {
      /* ignore */
    }
  }

  const state = {
    base: "", // the API base on this origin: /api/v1, or /r/<serverId>/api/v1
    key: "",
    keyBase: "", // the API base the key was given for: it is sent nowhere else
    path: null, // the open note
    etag: null, // the ETag the editor's text was loaded from (sent as If-Match)
    known: null, // the ETag of the open note on the server as last seen (a draft's may be older)
    saved: "", // the note's text as last loaded or saved
    title: "",
    editing: false,
    expanded: new Set(JSON.parse(getItem("session", "notesvc.expanded") || "[]")),
    moves: 0, // panes shown so far: what the page restores at start waits for no one
  };

  // What this server offers beyond the core API (read from its OpenAPI document at start).
  const features = {history: false, attachments: false, changes: false, related: false};

  // -- small DOM helpers -------------------------------------------------------------------

  // "1 note", "3 notes"
  function counted(n, one, many) {
    return n + " " + (n === 1 ? one : many || one + "s");
  }

  function ago(iso) {
    const t = Date.parse(iso);
    if (!t) return "";
    const s = (Date.now() - t) / 1000;
    if (s < 60) return "just now";
    if (s < 3600) return Math.floor(s / 60) + " min ago";
    if (s < 86400) return Math.floor(s / 3600) + " h ago";
    if (s < 2 * 86400) return "yesterday";
    return new Date(t).toLocaleDateString();
  }

  let toastTimer = 0;
  function toast(text, bad, action) {
    const t = $("toast");
    // A modal dialog sits above everything else: a message then shows inside it, not under.
    const host = $("dlg").open ? $("dlg") : document.body;
    if (t.parentNode !== host) host.append(t);
    t.textContent = text;
    if (action) {
      const [label, fn] = action;
      const run = act(fn);
      const done = () => {
        t.hidden = true;
        run();
      };
      t.append(" ", markdown.el("button", {type: "button", class: "plain", onclick: done}, label));
    }
    t.className = bad ? "bad" : "";
    t.setAttribute("role", bad ? "alert" : "status");
    t.hidden = false;
    clearTimeout(toastTimer);
    // An action (Undo) waits 15 s, and longer while a finger or the focus is on it.
    const hide = () => {
      if (t.matches(":hover, :focus-within")) toastTimer = setTimeout(hide, 2000);
      else t.hidden = true;
    };
    toastTimer = setTimeout(hide, action ? 15000 : bad ? 8000 : 3000);
  }

  // -- the API -------------------------------------------------------------------------------

  class Problem extends Error {
    constructor(status, code, message, retryAfter) {
      super(message);
      this.status = status;
      this.code = code;
      this.retryAfter = retryAfter;
    }
  }

  // Read an answer's body, calling progress(bytes so far) as it comes.
  async function readAll(r, progress) {
    if (!r.body || !r.body.getReader) return r.blob();
    const reader = r.body.getReader();
    const parts = [];
    let n = 0;
    for (;;) {
      const {done, value} = await reader.read();
      if (done) break;
      parts.push(value);
      n += value.length;
      progress(n);
    }
    return new Blob(parts, {type: r.headers.get("Content-Type") || ""});
  }

  function ownOrigin(url) {
    return keys.sameOrigin(url, location.href);
  }

  function lockoutMessage(retryAfter) {
    const s = parseInt(retryAfter || "60", 10);
    return "Too many wrong keys from this address: try again in " + s + " s.";
  }

  async function api(method, path, body, headers, opts) {
    opts = opts || {};
    const url = state.base + path;
    if (!state.base || !ownOrigin(url)) {
      throw new Problem(0, "REFUSED", "Refused: the API is not on this page's origin.");
    }
    if (state.key && state.keyBase !== state.base) {
      throw new Problem(0, "REFUSED", "Refused: this key was given for another server.");
    }
    const h = Object.assign({"X-Service-Key": state.key}, headers || {});
    const raw = body instanceof Blob; // an upload goes as it is, with its own type
    if (body !== undefined && !raw) h["Content-Type"] = "application/json";
    let r;
    try {
      r = await fetch(url, {
        method,
        headers: h,
        mode: "same-origin",
        credentials: "omit",
        cache: "no-store",
        body: body === undefined || raw ? body : JSON.stringify(body),
      });
    } catch (e) {
      throw new Problem(
        0,
        "NETWORK",
        "Cannot reach the server. Check the connection and try again.",
      );
    }
    if (opts.blob && r.ok) {
      return {
        blob: opts.progress ? await readAll(r, opts.progress) : await r.blob(),
        status: r.status,
      };
    }
    if (opts.raw && r.ok) return {json: await r.json(), status: r.status};
    // asked with If-None-Match: the copy kept is still good (no body)
    if (r.status === 304) return {data: null, etag: r.headers.get("ETag"), status: 304};
    let j = null;
    try {
      j = await r.json();
    } catch (e) {
      /* not JSON */
    }
    if (r.ok && j && j.success) {
      // the server answers again: what waits on this device goes now
      if (offline.canSend()) offline.sendOutbox().catch(() => {});
      return {data: j.data, etag: r.headers.get("ETag"), status: r.status};
    }
    const err = (j && j.error) || {
      code: "HTTP_" + r.status,
      message: "The server answered " + r.status + ".",
    };
    const retry = r.headers.get("Retry-After");
    const message = r.status === 429 ? lockoutMessage(retry) : err.message;
    const problem = new Problem(r.status, err.code, message, retry);
    problem.error = err; // the envelope's error, with any extra fields (410's resetRequired)
    if (!opts.login && (r.status === 401 || r.status === 429)) {
      toKeyScreen(
        r.status === 401
          ? "The key was not accepted: it may have been rotated. Paste the current key."
          : message,
        r.status,
      );
    }
    throw problem;
  }

  // Run an event handler; show what went wrong instead of failing silently.
  function act(fn) {
    return async (...args) => {
      try {
        return await fn(...args);
      } catch (e) {
        if (e instanceof Problem && (e.status === 401 || e.status === 429)) return undefined;
        toast(e && e.message ? e.message : String(e), true);
        return undefined;
      }
    };
  }

  // -- connecting: the relay code, the key ---------------------------------------------------

  async function resolveBase(code) {
    let r;
    try {
      r = await fetch(new URL("relay/v1/pair/" + enc(code), location.href).pathname, {
        mode: "same-origin",
        credentials: "omit",
        cache: "no-store",
      });
    } catch (e) {
      throw new Error("Cannot reach this address.");
    }
    const j = await r.json().catch(() => ({}));
    if (!r.ok || !j.data) {
      throw new Error(
        j.error && r.status === 404
          ? "The relay code is not known here: open the current connect link from your server."
          : "Pairing failed" + (j.error ? ": " + j.error.message : "."),
      );
    }
    const target = keys.pairTarget(j.data, location.href);
    if (target && target.open) {
      location.assign(target.open); // that server's own page on its relay: its key goes there
      throw new Error("Opening that server's own page…");
    }
    if (!target) throw new Error("Pairing failed.");
    return target.base;
  }

  function relayCodeGiven() {
    return (
      new URLSearchParams(location.search).get("relayCode") ||
      $("relay-code").value ||
      ""
    ).trim();
  }

  // The key kept on this device (session or local storage) and the API base it was given for.
  function keptKey() {
    const pairs = ["session", "local"].map((kind) => [
      getItem(kind, "notesvc.key"),
      getItem(kind, "notesvc.keyFor"),
    ]);
    return keys.keptEntry(pairs, location.href);
  }

  // Connect with the key typed, else the one kept for the same API base (never another's).
  async function connect(typed) {
    const msg = $("login-msg");
    msg.textContent = "";
    $("connect").disabled = true;
    try {
      const code = relayCodeGiven();
      if (code) {
        try {
          state.base = await resolveBase(code);
        } catch (e) {
          if (!state.base) throw e; // an old code: a server this device knows is still there
        }
      }
      if (!state.base) state.base = new URL("api/v1", location.href).pathname;
      state.key = keys.keyFor(state.base, typed ? $("key").value.trim() : "", keptKey());
      state.keyBase = state.key ? state.base : "";
      if (!state.key) {
        msg.textContent = "Paste the API key first.";
        return;
      }
      let v;
      try {
        v = await api("POST", "/auth/verify", undefined, undefined, {login: true});
        setItem("local", "notesvc.grant", JSON.stringify(v.data.grant || null));
        // who is signed in, and what a person reaches: the menu and the tree, offline too
        const {person, reach} = v.data;
        setItem("local", "notesvc.who", JSON.stringify({person, reach}));
      } catch (e) {
        if (offline.unreachable(e) && offline.offlineOn() && state.keyBase === state.base) {
          // out of reach, and this device keeps the notes: open them from the copy
          const grant = JSON.parse(getItem("local", "notesvc.grant") || "null");
          const who = JSON.parse(getItem("local", "notesvc.who") || "{}");
          v = {data: {...who, grant, setupComplete: true}};
        } else if (e.status === 404) {
          state.base = "";
          removeItem("local", "notesvc.base");
          $("relay-box").open = true;
          throw new Error(
            "No notes server answers here. Open your server's connect link, " +
              "or enter its relay code.",
          );
        } else if (e.status === 401) {
          if (!typed) await offline.forgetOffline(); // the key this device kept: no copy stays
          throw new Error(
            "That key was not accepted. Check it and try again " +
              "(a rotated key stops working at once).",
          );
        } else {
          throw e;
        }
      }
      grants.applyGrant(v.data.grant, v.data); // a scoped key, a person: only what it may do
      if (!v.data.setupComplete && !v.data.grant && v.data.linkHere !== false) {
        // Not asked away from the server and its home network (linkHere false; the link
        // would be 403): the key still works, and setup waits for the server's own `pair`
        // or a browser at home.
        await api("POST", "/auth/link", {clientName: "web client"}).catch((e) => {
          if (e.status !== 403) throw e;
        });
      }
      setItem("local", "notesvc.base", state.base);
      if (new URLSearchParams(location.search).has("relayCode")) {
        history.replaceState(history.state, "", location.pathname); // the code has done its job
      }
      const remember = $("remember").checked || getItem("local", "notesvc.key") !== null;
      setItem(remember ? "local" : "session", "notesvc.key", state.key);
      // Beside the key, the API it opens: the consent page offers the key only to that API
      // (on a relay's origin, other servers' consent pages share this storage).
      setItem(remember ? "local" : "session", "notesvc.keyFor", state.base);
      $("key").value = "";
      $("login").hidden = true;
      $("app").hidden = false;
      fitViewport();
      await act(app.start)(); // from here on, a failure is shown in the app, not on the key screen
    } catch (e) {
      msg.textContent = e.message || String(e);
    } finally {
      $("connect").disabled = false;
    }
  }

  function toKeyScreen(message, status) {
    app.keepDraft();
    app.stopFeed();
    // the key stopped working: no copy stays (too many tries is not that: the copy stays)
    if (status === 401) offline.forgetOffline().catch(() => {});
    state.key = "";
    state.keyBase = "";
    for (const kind of ["session", "local"]) {
      removeItem(kind, "notesvc.key");
      removeItem(kind, "notesvc.keyFor");
    }
    $("app").hidden = true;
    $("login").hidden = false;
    $("login-msg").textContent = message || "";
    $("key").focus();
  }

  async function logout() {
    if (!(await app.confirmLeave("Log out"))) return;
    await offline.sendOutbox().catch(() => {}); // what waits goes first, if it can
    if (!(await offline.letWaitingGo("Log out"))) return;
    if (offline.offlineOn()) {
      // the next key on this device starts from nothing of this one's
      removeItem("local", "notesvc.offline");
      await offline.wipeOffline().catch(() => {});
    }
    for (const kind of ["local", "session"]) {
      const s = storage(kind);
      if (!s) continue;
      for (const name of Object.keys(s)) if (name.startsWith("notesvc.")) removeItem(kind, name);
    }
    state.path = null;
    location.reload();
  }

  // -- the page's layout: panes on a phone, a side panel on a desktop ------------------------

  function showPane(name, fromHistory) {
    const pane = $("app");
    if (pane.dataset.pane === name) return;
    pane.dataset.pane = name;
    state.moves++;
    for (const b of document.querySelectorAll(".tabs button")) {
      if (b.dataset.pane === name) b.setAttribute("aria-current", "page");
      else b.removeAttribute("aria-current");
    }
    if (NARROW.matches && !fromHistory) history.pushState({pane: name}, "");
  }

  function fitViewport() {
    // The keyboard on a phone shrinks the visual viewport: keep the bar (and Save) in view.
    const vv = window.visualViewport;
    if (vv) document.documentElement.style.setProperty("--app-h", Math.round(vv.height) + "px");
  }

  // The Ask pane (wide screens): closed while empty; Ask in the bar opens it.
  function setSide(open) {
    $("main").classList.toggle("side-closed", !open);
    $("toggle-ask").setAttribute("aria-expanded", String(open));
  }

  // -- the tree: folders load lazily, one level at a time -------------------------------------

  function treeUrl(folder) {
    return (folder === "notes" ? "/folders/tree" : "/folders/tree/" + enc(folder)) + "?depth=1";
  }

  async function fillFolder(folder, ul) {
    let data;
    try {
      data = (await api("GET", treeUrl(folder))).data;
    } catch (e) {
      if (!offline.unreachable(e) || !offline.offlineOn()) throw e;
      data = await offline.mirrorTree(folder); // out of reach: the copy on this device
    }
    const items = (data.children || []).map(treeItem);
    ul.replaceChildren(...items.map((i) => i.li));
    if (!items.length) {
      const top = folder === "notes" || (state.person && folder === state.person.home);
      ul.appendChild(
        markdown.el(
          "li",
          {class: "empty"},
          top ? "No notes yet: start one with New note." : "Empty folder",
        ),
      );
    }
    await Promise.all(items.filter((i) => i.expand).map((i) => i.expand()));
  }

  function treeItem(node) {
    const li = markdown.el("li");
    if (node.type !== "folder") {
      const b = markdown.el(
        "button",
        {
          type: "button",
          class: "note",
          "data-path": node.path,
          "aria-current": node.path === state.path ? "true" : null,
        },
        paths.nameOf(node.path),
      );
      b.addEventListener(
        "click",
        act(() => app.openNote(node.path)),
      );
      li.appendChild(b);
      return {li};
    }
    // under its name: who shared it, whose home it is (people.js)
    const by = people.label(node.path);
    const b = markdown.el(
      "button",
      {type: "button", class: "dir", "aria-expanded": "false", "data-path": node.path},
      markdown.el("span", {class: "caret", "aria-hidden": "true"}),
      markdown.el("span", {}, node.name, by && markdown.el("small", {class: "by"}, by)),
      node.count === undefined ? null : markdown.el("span", {class: "count"}, String(node.count)),
    );
    if (node.count !== undefined)
      b.setAttribute("aria-label", node.name + ", folder, " + counted(node.count, "note"));
    const sub = markdown.el("ul");
    sub.hidden = true;
    li.append(b, sub);
    if (people.mayShare(node.path)) {
      // (after the folder's list, placed on its row: `.dir + ul` stays the folder's own)
      li.classList.add("shareable");
      const share = () => people.shareFolder(node.path);
      const on = people.sharedOwn(node.path) ? " on" : ""; // (shown: it is shared)
      const attrs = {type: "button", class: "share" + on, title: "Share…", onclick: act(share)};
      const icon = $("t-share").content.firstElementChild.cloneNode(true);
      li.append(markdown.el("button", {...attrs, "aria-label": "Share " + node.name + "…"}, icon));
    }
    const expand = async () => {
      b.setAttribute("aria-expanded", "true");
      sub.hidden = false;
      state.expanded.add(node.path);
      if (node.children) {
        // a server without ?depth sends the whole subtree
        const items = node.children.map(treeItem);
        sub.replaceChildren(...items.map((i) => i.li));
        await Promise.all(items.filter((i) => i.expand).map((i) => i.expand()));
      } else {
        sub.replaceChildren(markdown.el("li", {class: "empty"}, "Loading…"));
        await fillFolder(node.path, sub);
      }
    };
    b.addEventListener(
      "click",
      act(async () => {
        if (b.getAttribute("aria-expanded") === "true") {
          b.setAttribute("aria-expanded", "false");
          sub.hidden = true;
          state.expanded.delete(node.path);
        } else {
          await expand();
        }
        setItem("session", "notesvc.expanded", JSON.stringify([...state.expanded]));
      }),
    );
    return {li, expand: state.expanded.has(node.path) ? expand : null};
  }

  async function loadTree() {
    loadRecent().catch(() => {});
    const ul = markdown.el("ul");
    await people.refresh(); // the owner's people, what is shared: the labels and Share…
    // a person's top level: their home, then what is shared with them
    if (!(await people.fillTop(ul))) await fillFolder("notes", ul);
    const focused =
      $("tree").contains(document.activeElement) && document.activeElement.dataset.path;
    $("tree").replaceChildren(ul);
    markCurrent();
    if (focused) {
      // Refreshed under the keyboard's feet: focus stays on the same entry.
      const again = ul.querySelector('button[data-path="' + CSS.escape(focused) + '"]');
      if (again) again.focus();
    }
    performance.mark("notesvc:tree-shown");
  }

  // The notes by date, newest first: title, a line of the text, when (the way people find
  // what they just wrote; the folders are below it).
  async function loadRecent() {
    let notes;
    try {
      const {data} = await api(
        "GET",
        "/notes?sort=modified&fields=title,preview,modified&limit=30",
      );
      notes = data.notes;
    } catch (e) {
      if (!offline.unreachable(e) || !offline.offlineOn()) throw e;
      notes = await offline.mirrorRecent(30);
    }
    const items = notes.map((n) =>
      markdown.el(
        "li",
        {},
        markdown.el(
          "button",
          {
            type: "button",
            class: "recent-note",
            "data-path": n.path,
            onclick: act(() => app.openNote(n.path)),
          },
          markdown.el("strong", {}, n.title || paths.nameOf(n.path)),
          markdown.el("span", {class: "preview"}, n.preview || ""),
          markdown.el("small", {class: "muted"}, people.mark(n.path), ago(n.modified)),
        ),
      ),
    );
    if (!items.length)
      items.push(markdown.el("li", {class: "muted"}, "No notes yet: start one with New note."));
    $("recent").replaceChildren(...items);
    markCurrent();
  }

  function markCurrent() {
    for (const b of $("recent").querySelectorAll("button.recent-note")) {
      if (b.dataset.path === state.path) b.setAttribute("aria-current", "true");
      else b.removeAttribute("aria-current");
    }
    for (const b of $("tree").querySelectorAll("button.note")) {
      if (b.dataset.path === state.path) b.setAttribute("aria-current", "true");
      else b.removeAttribute("aria-current");
    }
  }

  async function reveal(path) {
    // Open the folders above a note, so the tree shows where it is.
    const parts = path.split("/");
    let changed = false;
    for (let i = 2; i < parts.length; i++) {
      const folder = parts.slice(0, i).join("/");
      if (!state.expanded.has(folder)) {
        state.expanded.add(folder);
        changed = true;
      }
    }
    setItem("session", "notesvc.expanded", JSON.stringify([...state.expanded]));
    if (changed || !$("tree").querySelector('button.note[data-path="' + CSS.escape(path) + '"]'))
      await loadTree();
    else markCurrent();
  }

  return {
    $,
    NARROW,
    Problem,
    SHARED_ORIGIN,
    act,
    ago,
    api,
    connect,
    counted,
    enc,
    features,
    fitViewport,
    getItem,
    itemNames,
    keptKey,
    loadRecent,
    loadTree,
    logout,
    markCurrent,
    ownOrigin,
    removeItem,
    reveal,
    setItem,
    setSide,
    state,
    showPane,
    toast,
    treeItem,
  };
})();
