// -- people: who is signed in, the owner's People, Share… on a folder, Shared with me ------
// A household on one server (docs/api.md: People). The owner (the server key, the owner's
// devices) sees everything and adds people; a person sees their home and the folders
// shared with them, and shares folders of their home. /auth/verify says who is signed in
// (`person`, `reach`); the tree's top level for a person is their home, then the folders
// shared with them with who shared them (GET /shared).
// One name, people: what the other files call (applyWho, scopeAt, fillTop, label, ...).

const people = (() => {
  const {$, state} = core;
  const {el} = markdown;
  const SCOPE = {write: "can edit", read: "view only"};
  let known = []; // the owner's people (GET /people): whom a folder may be shared with
  state.shared = []; // the folders shared with this person: [{path, scope, sharedBy}]
  state.shares = []; // this one's own folders that are shared: [{path, members}]

  const inside = (path, folder) => path === folder || path.startsWith(folder + "/");

  // The owner of the server: no person, every scope, no folder of its own.
  function owner() {
    return !state.person && grants.admin();
  }

  // From /auth/verify (or what this device kept of it): the menu's who-am-I and the owner's
  // People; a person's tree opens at their home.
  function applyWho(v) {
    const g = v.grant;
    state.person = v.person || null;
    state.shared = (v.reach || []).filter((r) => r.sharedBy);
    state.shares = [];
    known = [];
    loaded = null;
    let name = "Owner";
    let what = g ? g.name || "a key" : "the server key";
    if (state.person) name = state.person.name;
    else if (!grants.admin()) [name, what] = [g.name || "A key", grants.scopeText(g)];
    $("who").replaceChildren(
      el("small", {}, "Signed in as"),
      " ",
      el("strong", {}, name),
      " · " + what,
    );
    $("menu-people").hidden = !owner();
    if (state.person && core.getItem("session", "notesvc.expanded") === null)
      state.expanded.add(state.person.home); // the first time: their home open
  }

  // Before the tree is drawn: the owner's people (homes labelled, folders shareable; read
  // once a sign-in), and what is shared (GET /shared): with a person, and of one's own.
  let loaded = null;
  async function refresh() {
    const load = async () => {
      if (owner()) known = (await core.api("GET", "/people")).data.people;
    };
    loaded = loaded || load().catch(() => {}); // (out of reach: no labels)
    await loaded;
    if (!state.person && !known.length) return; // no one to share with: nothing shared
    try {
      const {data} = await core.api("GET", "/shared");
      [state.shared, state.shares] = [data.folders, data.shares || []];
    } catch (e) {
      if (!offline.unreachable(e)) throw e; // out of reach: what this device knew
    }
  }

  // The scope a person holds at a path: write in their home, a share's beyond; null where
  // this page cannot tell (the server decides).
  function scopeAt(path) {
    if (!state.person) return null;
    if (inside(path, state.person.home)) return "write";
    const held = state.shared.filter((r) => inside(path, r.path)).map((r) => r.scope);
    return held.includes("write") ? "write" : held[0] || null;
  }

  // A person's top level: their home ("My notes"), then the folders shared with them (each
  // one not inside another), with who shared it. Returns false for the owner's whole tree.
  async function fillTop(ul) {
    if (!state.person || (state.grant && state.grant.folder)) return false;
    const home = core.treeItem({type: "folder", name: "My notes", path: state.person.home});
    const tops = state.shared.filter(
      (f) => !state.shared.some((o) => o !== f && inside(f.path, o.path)),
    );
    const shared = tops.map((f) =>
      core.treeItem({type: "folder", name: paths.nameOf(f.path), path: f.path}),
    );
    const head = el("li", {class: "list-head", id: "shared-head"}, "Shared with me");
    ul.replaceChildren(home.li, ...(shared.length ? [head] : []), ...shared.map((i) => i.li));
    await Promise.all([home, ...shared].filter((i) => i.expand).map((i) => i.expand()));
    return true;
  }

  // The line under a folder's name: who shared it with this person; else whose home it
  // is (for the owner) and whom it is shared with.
  function label(path) {
    const f = state.shared.find((r) => r.path === path);
    if (f) return "Shared by " + f.sharedBy.name + " · " + SCOPE[f.scope];
    const p = known.find((k) => k.home === path);
    const s = sharedOwn(path);
    const names = s && s.members.map((m) => m.name).join(", ");
    return [p && p.name + "'s home", s && "Shared with " + names].filter(Boolean).join(" · ");
  }
  function sharedOwn(path) {
    return state.shares.find((r) => r.path === path);
  }

  // Who may share a folder from here: the owner (any folder, once there are people), a
  // person (a folder of their home, with a key that writes).
  function mayShare(path) {
    // (a person's home itself is not offered: one tap would share all their notes)
    const home = state.person && state.person.home;
    if (home) return grants.writable(path) && path.startsWith(home + "/");
    return owner() && known.length > 0 && path !== "notes";
  }

  // The open note's line under its title: who shared its folder with this person, or whom
  // the folder holding it is shared with.
  function noteLine(path) {
    const f = state.shared.find((r) => inside(path, r.path));
    const own = state.shares.filter((r) => inside(path, r.path)).pop(); // the deepest
    const line = $("note-shared");
    line.textContent = f
      ? "Shared by " + f.sharedBy.name + (f.scope === "read" ? " · view only" : "")
      : own
        ? "Shared with " + own.members.map((m) => m.name).join(", ")
        : "";
    line.hidden = !line.textContent;
    // its folder's Share… in the note's menu too (as the tree's people icon)
    const folder = path.slice(0, path.lastIndexOf("/"));
    const item = $("share-folder");
    item.hidden = !mayShare(folder);
    item.textContent = "Share “" + paths.nameOf(folder) + "” with people…";
    item.onclick = core.act(() => shareFolder(folder));
  }

  // In the recent list: the initial of who shared the note's folder with this person.
  function mark(path) {
    const f = state.shared.find((r) => inside(path, r.path));
    if (!f) return null;
    const by = "Shared by " + f.sharedBy.name;
    const initial = [...f.sharedBy.name][0].toUpperCase();
    return el("span", {class: "avatar", role: "img", title: by, "aria-label": by}, initial);
  }

  // A round badge with a person's initial, before their name.
  function avatar(name) {
    return el("span", {class: "avatar", "aria-hidden": "true"}, [...name][0].toUpperCase());
  }

  // -- Share…: a folder's members as chips, each with its scope; more people below ----------

  async function shareFolder(path) {
    const url = "/folders/" + core.enc(path) + "/members";
    const {data} = await core.api("GET", url);
    const own = data.members.filter((m) => !m.inherited);
    const put = core.act(async (members) => {
      const wanted = members.map((m) => ({person: m.person, scope: m.scope}));
      await core.api("PUT", url, {members: wanted});
      core.toast(
        members.length ? "Shared with " + members.map((m) => m.name).join(", ") : "Not shared",
      );
      core // its label and the open note's line follow
        .loadTree()
        .then(() => state.path && noteLine(state.path))
        .catch(() => {});
      return shareFolder(path);
    });
    const chips = el("ul", {class: "chips", id: "share-members"});
    for (const m of data.members) {
      const chip = el("li", {"data-person": m.person}, avatar(m.name), el("strong", {}, m.name));
      if (m.inherited) {
        chip.append(el("small", {}, SCOPE[m.scope] + " · from " + paths.nameOf(m.from)));
      } else {
        const scope = scopeSelect(m.scope, "Scope of " + m.name);
        scope.addEventListener("change", () =>
          put(own.map((o) => (o === m ? {...o, scope: scope.value} : o))),
        );
        const drop = () => put(own.filter((o) => o !== m));
        chip.append(
          scope,
          el(
            "button",
            {
              type: "button",
              class: "plain",
              "aria-label": "Stop sharing with " + m.name,
              onclick: drop,
            },
            "×",
          ),
        );
      }
      chips.append(chip);
    }
    if (!chips.children.length)
      chips.append(el("li", {class: "muted"}, "Not shared yet: only you see it."));
    const free = (data.candidates || []).filter((c) => !own.some((m) => m.person === c.id));
    const who = el("select", {id: "share-person", "aria-label": "Person"});
    who.append(...free.map((c) => el("option", {value: c.id}, c.name)));
    const scopeNew = scopeSelect("write", "What they may do");
    scopeNew.id = "share-scope";
    const add = () =>
      put([...own, {person: who.value, name: who.selectedOptions[0].text, scope: scopeNew.value}]);
    const body = [
      el(
        "p",
        {},
        "The people you share it with see this folder and everything in it, on all their " +
          "devices and apps. Taking someone off cuts them off at once.",
      ),
      chips,
      ...(free.length
        ? [
            el("h3", {}, "Share with"),
            el(
              "div",
              {class: "row"},
              who,
              scopeNew,
              el(
                "button",
                {type: "button", id: "share-add", class: "primary", onclick: add},
                "Share",
              ),
            ),
          ]
        : [
            el(
              "p",
              {class: "muted"},
              (data.candidates || []).length
                ? "Everyone here has it now."
                : "No one else lives on this server yet.",
            ),
          ]),
    ];
    if (state.person)
      body.push(
        el("p", {class: "muted"}, "The server's owner can read every note: they run the machine."),
      );
    return app.dialog("Share “" + paths.nameOf(path) + "”", body, [["cancel", "Done"]]);
  }

  function scopeSelect(value, what) {
    const s = el(
      "select",
      {"aria-label": what},
      ...Object.entries(SCOPE).map(([k, t]) => el("option", {value: k}, t)),
    );
    s.value = value;
    return s;
  }

  // -- People (the owner): add one (a code for their first device), their devices, rename,
  // remove -------------------------------------------------------------------------------

  async function showPeople() {
    const [listed, grantsNow] = await Promise.all([
      core.api("GET", "/people"),
      core.api("GET", "/auth/keys"),
    ]);
    known = listed.data.people;
    const list = el("ul", {class: "list", id: "people-list"});
    for (const p of known) {
      const theirs = grantsNow.data.keys.filter((g) => g.person === p.id);
      const act = (text, fn, cls) =>
        el(
          "button",
          {type: "button", class: cls || null, onclick: core.act(() => fn(p, theirs))},
          text,
        );
      const used = p.lastUsedAt ? " · used " + core.ago(p.lastUsedAt) : "";
      const held = el("ul", {class: "held"});
      for (const g of theirs) {
        const revoke = core.act(async () => {
          const sure = await app.choose("Revoke “" + g.name + "”?", "It stops working at once.", [
            ["cancel", "Cancel"],
            ["revoke", "Revoke", "danger"],
          ]);
          if (sure === "revoke") await core.api("DELETE", "/auth/keys/" + core.enc(g.id));
          await showPeople();
        });
        const kind = {device: "device", oauth: "app"}[g.kind] || "key";
        held.append(
          el(
            "li",
            {},
            el("span", {}, g.name, el("small", {class: "muted"}, " · " + kind)),
            el("button", {type: "button", class: "plain", onclick: revoke}, "Revoke"),
          ),
        );
      }
      list.append(
        el(
          "li",
          {"data-person": p.id},
          el(
            "span",
            {class: "who"},
            avatar(p.name),
            el("strong", {}, p.name),
            el(
              "small",
              {class: "muted"},
              p.home + " · " + core.counted(p.devices, "device") + used,
            ),
          ),
          el(
            "span",
            {class: "actions"},
            act("Add a device", addDevice),
            act("Rename", rename),
            act("Remove", remove, "danger"),
          ),
          theirs.length ? held : null,
        ),
      );
    }
    if (!known.length) list.append(el("li", {class: "muted"}, "No one yet: it is only you."));
    const name = el("input", {
      type: "text",
      id: "person-name",
      maxlength: "64",
      autocomplete: "off",
    });
    const body = [
      el(
        "p",
        {},
        "Each person has a folder of their own and sees only it and the folders shared with " +
          "them. You see every note: you run the server.",
      ),
      list,
      el("h3", {}, "Add a person"),
      el("label", {for: "person-name"}, "Name (their folder's name too)"),
      el(
        "div",
        {class: "row"},
        name,
        el(
          "button",
          {
            type: "button",
            id: "person-add",
            class: "primary",
            onclick: core.act(() => addPerson(name, body)),
          },
          "Add",
        ),
      ),
    ];
    name.addEventListener(
      "keydown",
      (e) => e.key === "Enter" && core.act(() => addPerson(name, body))(),
    );
    core.loadTree().catch(() => {}); // homes are labelled, folders shareable
    return app.dialog("People", body, [["cancel", "Close"]], known.length ? undefined : name);
  }

  async function addPerson(name, body) {
    let made;
    try {
      made = (await core.api("POST", "/people", {name: name.value.trim()})).data;
    } catch (e) {
      if (e instanceof core.Problem && (e.status === 401 || e.status === 429)) throw e;
      devices.dialogProblem(body, e);
      return app.dialog("People", body, [["cancel", "Close"]], name);
    }
    const who = made.person.name;
    const intro = who + "'s phone scans this, or opens the link: it joins as " + who + ".";
    return devices.showPairing(made.pairing, showPeople, who + "'s first device", intro);
  }

  async function addDevice(p) {
    const {data} = await core.api("POST", "/people/" + core.enc(p.id) + "/pairings", {
      name: p.name + "'s device",
      scope: "admin",
    });
    return devices.showPairing(
      data,
      showPeople,
      "A device for " + p.name,
      p.name + " scans this with the new device's camera.",
    );
  }

  async function rename(p) {
    const input = el("input", {type: "text", id: "person-rename", maxlength: "64"});
    input.value = p.name;
    const body = [el("label", {for: "person-rename"}, "Name (their folder keeps its name)"), input];
    for (;;) {
      if (
        (await app.dialog(
          "Rename " + p.name,
          body,
          [
            ["cancel", "Cancel"],
            ["save", "Rename", "primary"],
          ],
          input,
        )) !== "save"
      )
        return showPeople();
      try {
        await core.api("PATCH", "/people/" + core.enc(p.id), {name: input.value.trim()});
        return showPeople();
      } catch (e) {
        if (e instanceof core.Problem && (e.status === 401 || e.status === 429)) throw e;
        devices.dialogProblem(body, e);
      }
    }
  }

  async function remove(p, theirs) {
    const phones = theirs.filter((g) => g.kind === "device").length;
    const others = theirs.length - phones;
    const more = others ? " and " + core.counted(others, "key or app", "keys and apps") : "";
    const text = [
      (theirs.length
        ? p.name +
          "'s " +
          core.counted(phones, "device") +
          more +
          " stop working at once, " +
          "with the share links, calendar feeds and chats they made or linked."
        : p.name + " has not joined from a device yet: the code to join stops working.") +
        " Folders shared with " +
        p.name +
        " are no longer shared.",
      el(
        "p",
        {id: "remove-stays"},
        p.name + "'s notes stay in " + p.home + ", where you still see them.",
      ),
    ];
    const sure = await app.choose("Remove " + p.name + "?", text, [
      ["cancel", "Cancel"],
      ["remove", "Remove " + p.name, "danger"],
    ]);
    if (sure === "remove") {
      const {data} = await core.api("DELETE", "/people/" + core.enc(p.id));
      core.toast(
        p.name +
          " removed: " +
          core.counted(data.revoked.length, "device, key or app", "devices, keys and apps") +
          " ended",
      );
    }
    return showPeople();
  }

  function wirePeople() {
    $("menu-people").addEventListener(
      "click",
      core.act(() => showPeople()),
    );
  }

  return {
    applyWho,
    fillTop,
    label,
    mark,
    mayShare,
    noteLine,
    refresh,
    scopeAt,
    shareFolder,
    sharedOwn,
    wirePeople,
  };
})();
