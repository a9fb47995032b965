// -- keys, connections and share links (what a grant may do shapes the page) --------------
// The API key holds every scope, and so does an admin device; a scoped key (or a folder
// key or device) sees only what it may use: a read key gets no editing, a folder key only
// its folder (the server filters the rest).
// One name, grants: what the other files call (writable, applyGrant, shownOnce, showKeys).

const grants = (() => {
  const {$, state} = core;
  const {el} = markdown;
  // Whether this grant writes at a path (the open note's by default): not a read key, nor
  // a folder shared with this person to read only.
  function writable(path) {
    if (state.grant && state.grant.scope === "read") return false;
    const at = path === undefined ? state.path : path;
    return !at || people.scopeAt(at) !== "read";
  }

  // Every scope and no folder: the owner's key and devices, and a person's admin device
  // (whose admin is their own devices, keys and apps: people.js tells the two apart).
  function admin() {
    return !state.grant || (state.grant.scope === "admin" && !state.grant.folder);
  }

  const SCOPE_TEXT = {admin: "everything", write: "read and write", read: "read only"};
  function scopeText(g) {
    return (SCOPE_TEXT[g.scope] || g.scope) + (g.folder ? " · only " + g.folder : "");
  }

  // What this grant may do shapes the page; `who` is /auth/verify's answer (person, reach).
  function applyGrant(grant, who) {
    state.grant = grant || null;
    people.applyWho(who || {grant});
    const all = admin();
    const write = writable();
    for (const id of ["edit", "new", "empty-new", "menu-new", "move", "delete"]) {
      $(id).hidden = !write;
    }
    const daily = all || !state.grant.folder || state.grant.folder === "notes/daily";
    $("app").querySelector(".capture").hidden = !write || !daily; // today's note is notes/daily
    $("menu-keys").hidden = !all;
    $("menu-telegram").hidden = !all || !!state.person; // the bot is the server's
    $("menu-tasks").hidden = !all;
    $("menu-import").hidden = !write;
    $("share").hidden = !write;
    if (!write) {
      $("attach").hidden = true;
      $("photo").hidden = true;
    }
    $("app").dataset.scope = state.grant ? state.grant.scope : "admin";
    if (state.grant && state.grant.folder) $("app").dataset.folder = state.grant.folder;
  }

  // The open note's own actions: none that write in a folder shared to read only.
  function noteActions() {
    const w = writable();
    for (const id of ["edit", "move", "delete"]) $(id).hidden = !w;
    $("attach").hidden = !w || !core.features.attachments;
    $("photo").hidden = $("attach").hidden || !matchMedia("(pointer: coarse)").matches; // a camera
  }

  // Copy: the Clipboard API where the page is a secure context, else (plain HTTP on a home
  // network) the selection and the browser's copy command.
  async function copyText(text, what, field) {
    try {
      await navigator.clipboard.writeText(text);
      core.toast(what + " copied");
      return;
    } catch (e) {
      /* no Clipboard API here: the selection instead */
    }
    const box =
      field || el("textarea", {class: "offscreen", readonly: true, "aria-hidden": "true"});
    if (!field) {
      box.value = text;
      ($("dlg").open ? $("dlg") : document.body).append(box);
    }
    box.focus();
    box.select();
    let done = false;
    try {
      done = document.execCommand("copy");
    } catch (e) {
      done = false;
    }
    if (!field) box.remove();
    if (done) core.toast(what + " copied");
    else core.toast("Select it and copy it yourself: this browser did not allow copying", true);
  }

  function shownOnce(label, value, id) {
    const input = el("input", {type: "text", id, readonly: true, spellcheck: "false"});
    input.value = value;
    input.addEventListener("focus", () => input.select());
    return el(
      "div",
      {class: "once"},
      el("label", {for: id}, label),
      input,
      el("button", {type: "button", onclick: () => copyText(value, label, input)}, "Copy"),
    );
  }

  // Who made a grant or a share link (its createdBy): the owner, the command line on the
  // server, or a grant (an admin device) by id, named when it is still listed. Null (made
  // before this was recorded) says nothing.
  function madeByText(by, names) {
    if (!by) return "";
    if (by === "owner") return "made by you";
    if (by === "cli") return "made on the server";
    return names.has(by) ? "made by “" + names.get(by) + "”" : "made by a revoked device";
  }

  // The grants g made, and those they made in turn (what a cascade revoke takes with it).
  function madeBy(id, all) {
    const found = new Set([id]);
    const made = [];
    for (let more = true; more;) {
      more = false;
      for (const g of all) {
        if (g.createdBy && found.has(g.createdBy) && !found.has(g.id)) {
          found.add(g.id);
          made.push(g);
          more = true;
        }
      }
    }
    return made;
  }

  function grantRow(g, list, all, names) {
    const made = madeBy(g.id, all);
    const what = [
      SCOPE_TEXT[g.scope] || g.scope,
      g.folder ? "only " + g.folder : "all notes",
      g.expiresAt ? "expires " + app.when(g.expiresAt) : "never expires",
      g.lastUsedAt ? "used " + core.ago(g.lastUsedAt) : "never used",
      madeByText(g.createdBy, names),
      made.length ? "made " + made.length + " listed here" : "",
    ].filter(Boolean);
    const revoke = core.act(async () => {
      const text = [
        g.kind === "oauth"
          ? "This app is disconnected at once; it must ask you again to come back."
          : g.kind === "device"
            ? "This device is signed out at once, and the share links, calendar feeds, " +
              "unused pairing codes and Telegram chats it made or connected end."
            : "This key stops working at once, and the share links and feeds it made end.",
      ];
      const buttons = [
        ["cancel", "Cancel"],
        ["revoke", "Revoke", made.length ? null : "danger"],
      ];
      if (made.length) {
        text.push(
          el(
            "p",
            {id: "revoke-made"},
            "It made " +
              core.counted(made.length, "key, device or app", "keys, devices or apps") +
              " that keep working unless you revoke them too: " +
              made.map((m) => "“" + m.name + "”").join(", ") +
              ".",
          ),
        );
        buttons.push(["cascade", "Also revoke the " + made.length + " it made", "danger"]);
      }
      const sure = await app.choose("Revoke “" + g.name + "”?", text, buttons);
      if (sure === "revoke") await core.api("DELETE", "/auth/keys/" + core.enc(g.id));
      if (sure === "cascade")
        await core.api("DELETE", "/auth/keys/" + core.enc(g.id) + "?cascade=true");
      await showKeys();
    });
    list.append(
      el(
        "li",
        {"data-grant": g.id},
        el(
          "span",
          {},
          el("strong", {}, g.name),
          el("small", {class: "muted"}, " · " + what.join(" · ")),
        ),
        el(
          "span",
          {class: "actions"},
          el("button", {type: "button", class: "danger", onclick: revoke}, "Revoke"),
        ),
      ),
    );
  }

  const RELAY_HINT = "pair a relay (README: “Away from home: the relay”).";
  function assistantSection(where) {
    const li = (who, text) => el("li", {}, el("strong", {}, who), text);
    const parts = [
      el("h3", {}, "Connect an AI assistant"),
      shownOnce("MCP URL", where.mcpUrl, "mcp-url"),
      el(
        "ol",
        {id: "mcp-steps"},
        li("Claude", ": Settings → Connectors → Add custom connector, paste, Add, Connect."),
        li("ChatGPT", ": Settings → Connectors (developer mode) → Create, paste, OAuth."),
        li("", "Allow it on this server's page (writing needs SERVICE_MCP_WRITE=true)."),
      ),
    ];
    const hint = "They need a public URL: " + RELAY_HINT;
    // (a home address, as on this machine's own page, is no nearer to them)
    if (where.mcpVia === "page" || where.mcpVia === "home")
      parts.push(el("p", {class: "muted", id: "mcp-reach"}, hint));
    return parts;
  }

  async function showKeys(made) {
    const [{data}, shares, where] = await Promise.all([
      core.api("GET", "/auth/keys"),
      core.api("GET", "/shares"),
      core.api("GET", "/auth/devices/addresses"),
    ]);
    const keyList = el("ul", {class: "list", id: "keys-list"});
    const apps = el("ul", {class: "list", id: "connections-list"});
    const deviceList = el("ul", {class: "list", id: "devices-list"});
    const names = new Map(data.keys.map((g) => [g.id, g.name]));
    for (const g of data.keys) {
      const list = g.kind === "oauth" ? apps : g.kind === "device" ? deviceList : keyList;
      grantRow(g, list, data.keys, names);
    }
    if (!keyList.children.length) keyList.append(el("li", {class: "muted"}, "No scoped keys yet."));
    if (!deviceList.children.length)
      deviceList.append(el("li", {class: "muted"}, "No device yet."));
    if (!apps.children.length) {
      apps.append(el("li", {class: "muted"}, "No app is connected (Claude, ChatGPT…)."));
    }
    const links = el("ul", {class: "list", id: "shares-list"});
    for (const s of shares.data.shares) links.append(shareRow(s, showKeys, names));
    if (!links.children.length) links.append(el("li", {class: "muted"}, "No share links."));
    const name = el("input", {type: "text", id: "key-name", placeholder: "family tablet"});
    const scope = el(
      "select",
      {id: "key-scope"},
      el("option", {value: "read"}, "read only"),
      el("option", {value: "write"}, "read and write"),
    );
    const folder = el("input", {type: "text", id: "key-folder", placeholder: "notes/family"});
    const days = el(
      "select",
      {id: "key-days"},
      el("option", {value: "30"}, "in 30 days"),
      el("option", {value: "365"}, "in a year"),
      el("option", {value: ""}, "never"),
    );
    const create = core.act(async () => {
      const body = {name: name.value.trim() || "key", scope: scope.value};
      let f = folder.value.trim().replace(/\/+$/, "");
      if (f) body.folder = f.startsWith("notes") ? f : "notes/" + f.replace(/^\/+/, "");
      if (days.value) body.expiresInDays = Number(days.value);
      const r = await core.api("POST", "/auth/keys", body);
      await showKeys(r.data);
    });
    const form = el(
      "div",
      {class: "new-key"},
      el("h3", {}, "New key"),
      el("label", {for: "key-name"}, "Name"),
      name,
      el("label", {for: "key-scope"}, "It may"),
      scope,
      el("label", {for: "key-folder"}, "Only this folder (optional)"),
      folder,
      el("label", {for: "key-days"}, "Expires"),
      days,
      el("button", {type: "button", id: "key-create", class: "primary", onclick: create}, "Create"),
    );
    const body = [];
    if (made) {
      body.push(
        el("p", {class: "warn"}, "Copy the new key now: it is shown this once."),
        shownOnce("Key “" + made.name + "”", made.key, "new-key"),
      );
    }
    // a tasks app's address, user name and password are one tap away, not sections down
    const tasks = el(
      "button",
      {type: "button", id: "keys-tasks", onclick: core.act(() => devices.showTasks())},
      "Tasks on your phone",
    );
    body.push(
      el(
        "div",
        {class: "row"},
        tasks,
        el("small", {class: "muted"}, "Reminders, DAVx5, Thunderbird; calendar feeds"),
      ),
      el("h3", {}, "Devices"),
      deviceList,
      el(
        "div",
        {class: "row"},
        el(
          "button",
          {
            type: "button",
            id: "add-device",
            class: "primary",
            onclick: core.act(() => devices.addDevice(false)),
          },
          "Add a device",
        ),
        // (a person's devices are theirs: others join as people)
        state.person
          ? null
          : el(
              "button",
              {type: "button", id: "add-folder", onclick: core.act(() => devices.addDevice(true))},
              "Give someone a folder",
            ),
      ),
      el("h3", {}, "Keys"),
      keyList,
      el("h3", {}, "Connected apps"),
      apps,
      ...assistantSection(where.data),
      el("h3", {}, "Share links"),
      links,
      form,
    );
    // opened at its top (the first field, the MCP URL, is sections down), or a new key's field
    const first = made ? body[1].querySelector("input") : tasks;
    await app.dialog("Keys and devices", body, [["cancel", "Close"]], first);
  }

  function shareRow(s, after, names) {
    const revoke = core.act(async () => {
      await core.api("DELETE", "/shares/" + core.enc(s.id));
      core.toast("The link no longer opens " + paths.nameOf(s.path));
      await after();
    });
    return el(
      "li",
      {"data-share": s.id},
      el(
        "span",
        {},
        paths.nameOf(s.path),
        el(
          "small",
          {class: "muted"},
          " · expires " + app.when(s.expiresAt),
          names && s.createdBy ? " · " + madeByText(s.createdBy, names) : "",
        ),
      ),
      el(
        "span",
        {class: "actions"},
        el("button", {type: "button", class: "danger", onclick: revoke}, "Revoke"),
      ),
    );
  }

  async function shareNote(made) {
    if (!state.path) return;
    const path = state.path;
    const {data} = await core.api("GET", "/shares");
    const list = el("ul", {class: "list", id: "share-links"});
    for (const s of data.shares) if (s.path === path) list.append(shareRow(s, () => shareNote()));
    if (!list.children.length) list.append(el("li", {class: "muted"}, "Not shared yet."));
    const days = el(
      "select",
      {id: "share-days"},
      el("option", {value: "1"}, "in a day"),
      el("option", {value: "7", selected: true}, "in a week"),
      el("option", {value: "30"}, "in 30 days"),
      el("option", {value: "365"}, "in a year"),
    );
    const create = core.act(async () => {
      const r = await core.api("POST", "/shares", {path, expiresInDays: Number(days.value)});
      await shareNote(r.data);
    });
    const body = [
      el(
        "p",
        {},
        "Anyone with a link reads this note, formatted, without a key, until it expires " +
          "or you revoke it. Other notes stay private.",
      ),
    ];
    if (made) body.push(shownOnce("Link", made.url, "share-url"));
    if (made && made.homeOnly) {
      const where = new URL(made.url).host;
      const text = "It opens only at home (" + where + "). For one that opens anywhere, ";
      body.push(el("p", {class: "warn", id: "share-home-only"}, text + RELAY_HINT));
    }
    body.push(
      el("label", {for: "share-days"}, "A new link expires"),
      days,
      el(
        "button",
        {type: "button", id: "share-create", class: "primary", onclick: create},
        "Create",
      ),
      el("h3", {}, "Links to this note"),
      list,
    );
    await app.dialog("Share " + (state.title || paths.nameOf(path)), body, [["cancel", "Close"]]);
  }

  function wireGrants() {
    $("menu-keys").addEventListener(
      "click",
      core.act(() => showKeys()),
    );
    $("menu-telegram").addEventListener(
      "click",
      core.act(() => devices.showTelegram()),
    );
    $("menu-tasks").addEventListener(
      "click",
      core.act(() => devices.showTasks()),
    );
    $("share").addEventListener(
      "click",
      core.act(() => shareNote()),
    );
  }
  return {
    RELAY_HINT,
    admin,
    applyGrant,
    noteActions,
    scopeText,
    shownOnce,
    showKeys,
    wireGrants,
    writable,
  };
})();
