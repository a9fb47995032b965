// -- devices: a phone joins by scanning a code; a new server is set up from its page ------
// A pairing is a one-time secret in a link's fragment (#pair=…), never in a URL a server
// or a log keeps. Claiming it gives this browser a device key of its own, kept (with the
// API base it was given for) on this device only.

const devices = (() => {
  const {$, state} = core;
  const {el} = markdown;
  function pairingInUrl() {
    const m = /^#pair=([A-Za-z2-7-]{26,40})$/.exec(location.hash);
    return m ? m[1] : "";
  }

  function deviceGuess() {
    const ua = navigator.userAgent || "";
    if (/iPhone/.test(ua)) return "iPhone";
    if (/iPad/.test(ua)) return "iPad";
    if (/Android/.test(ua)) return /Mobile/.test(ua) ? "Android phone" : "Android tablet";
    if (/Macintosh/.test(ua)) return "Mac";
    if (/Windows/.test(ua)) return "Windows computer";
    return "Computer";
  }

  // Keep a device key for base: on this device, in the origin's own storage (never on a
  // relay's shared origin, where storage is off).
  function keepDevice(base, claimed) {
    for (const kind of ["session", "local"]) {
      core.removeItem(kind, "notesvc.key");
      core.removeItem(kind, "notesvc.keyFor");
    }
    core.setItem("local", "notesvc.key", claimed.key);
    core.setItem("local", "notesvc.keyFor", base);
    const d = claimed.device || {};
    core.setItem(
      "local",
      "notesvc.device",
      JSON.stringify({id: d.id, name: d.name, scope: d.scope}),
    );
  }

  async function claim(secret, name) {
    const base = new URL("api/v1", location.href).pathname;
    let r;
    try {
      r = await fetch(base + "/auth/devices/claim", {
        method: "POST",
        mode: "same-origin",
        credentials: "omit",
        cache: "no-store",
        headers: {"Content-Type": "application/json"},
        body: JSON.stringify({secret, deviceName: name}),
      });
    } catch (e) {
      throw new Error("Cannot reach the server. Check the connection and try again.");
    }
    const j = await r.json().catch(() => ({}));
    if (r.status === 404) {
      throw new Error(
        "This code was used already or has expired: ask for a new one (another device " +
          "shows it under Keys and devices → Add a device).",
      );
    }
    if (!r.ok || !j.data) {
      throw new Error(j.error ? j.error.message : "The server answered " + r.status + ".");
    }
    return {base, claimed: j.data};
  }

  async function joinWithPairing() {
    const msg = $("pair-msg");
    msg.textContent = "";
    $("pair-join").disabled = true;
    try {
      const secret = $("pair-box").dataset.secret;
      // "": its given name
      const {base, claimed} = await claim(secret, $("pair-name").value.trim());
      keepDevice(base, claimed);
      $("pair-box").hidden = true;
      state.base = base;
      await core.connect(false);
    } catch (e) {
      msg.textContent = e.message || String(e);
    } finally {
      $("pair-join").disabled = false;
    }
  }

  // First run: the setup payload shows the key to this browser (on this machine or its own
  // network): make an admin pairing with it, claim it as this browser's device, link.
  async function setUpServer() {
    const msg = $("setup-msg");
    msg.textContent = "";
    $("setup").disabled = true;
    try {
      const base = new URL("api/v1", location.href).pathname;
      const setup = await (await fetch(base + "/system/setup", {cache: "no-store"})).json();
      const key = setup.data && setup.data.apiKey;
      if (!setup.data || !setup.data.browserSetup || !/^nsk_[A-Za-z0-9_-]{43}$/.test(key || "")) {
        throw new Error("This server is set up already: connect with its key, or scan a code.");
      }
      const name = $("setup-name").value.trim() || deviceGuess();
      state.base = base;
      state.key = key; // the API key, for these two calls only
      state.keyBase = base;
      const pairing = await core.api("POST", "/auth/devices/pairings", {name, scope: "admin"});
      const {claimed} = await claim(pairing.data.secret, name);
      keepDevice(base, claimed);
      state.key = claimed.key;
      await core.api("POST", "/auth/link", {clientName: "web client on " + name});
      $("setup-box").hidden = true;
      await core.connect(false);
      await app.dialog(
        "Keep this key safe",
        [
          el(
            "p",
            {},
            "Your server is ready, and this browser is signed in as “" +
              name +
              "”. " +
              "Other devices join by scanning a code: Keys and devices → Add a device.",
          ),
          el(
            "p",
            {class: "warn"},
            "This is the server's API key. It is shown this once: keep it in a password " +
              "manager. Lost it? On the server, run: python3 notesvc.py rotate-key",
          ),
          grants.shownOnce("API key", key, "setup-key"),
        ],
        [["done", "I have kept it", "primary"]],
      );
    } catch (e) {
      state.key = "";
      state.keyBase = "";
      msg.textContent = e.message || String(e);
    } finally {
      $("setup").disabled = false;
    }
  }

  // A new server opened from where it may not be set up (setupHere.reason): why, and what to do.
  function whyNotSetUpHere(here) {
    const onServer =
      "On the server, run: python3 notesvc.py pair (a code to scan) or " +
      "python3 notesvc.py rotate-key (a key to paste below).";
    const there = here.url ? " (" + here.url + ")" : "";
    const why = {
      remote:
        "This notes server is new, and it is set up only from the server itself or its home " +
        "network, not from here. Open this page there" +
        there +
        ".",
      "loopback-only":
        "This notes server is new, and it is set up only from a browser on the server " +
        "itself. Open this page there.",
      relayed:
        "This notes server is new, and it is never set up through a relay. Open its own " +
        "address on the server or its home network.",
      proxy:
        "This notes server is new, and this page came through a proxy or tunnel it was not " +
        "told to trust (SERVICE_TRUST_PROXY), so it cannot tell where you are. Open this " +
        "page on the server or its home network.",
      window:
        "This notes server is new, and its setup window has passed (SERVICE_SETUP_WINDOW). " +
        "Restart the server and open this page within it.",
      host:
        "This notes server is new. Open this page by the server's address (its IP address, " +
        "localhost or its name), not by this name.",
    }[here.reason];
    return why ? why + " " + onServer : onServer;
  }

  async function offerSetup() {
    try {
      const base = new URL("api/v1", location.href).pathname;
      const r = await fetch(base + "/system/setup", {cache: "no-store", mode: "same-origin"});
      const j = await r.json();
      if (j.data && j.data.browserSetup) {
        $("setup-name").value = deviceGuess();
        $("setup-box").hidden = false;
        $("setup").focus();
      } else if (j.data && !j.data.setupComplete && j.data.setupHere) {
        const why = whyNotSetUpHere(j.data.setupHere).split(/(python3 notesvc\.py [a-z-]+)/);
        // the commands to type on the server, set as code (one tap selects them)
        const parts = why.map((part, i) => (i % 2 ? el("code", {}, part) : part));
        $("setup-why").replaceChildren(...parts);
        $("setup-elsewhere").hidden = false;
      }
    } catch (e) {
      /* not a notes server's own page (a relay's): the key screen as it is */
    }
  }

  // The picture of a pairing or a bot link: the server's QR code, else the link and a code to
  // type (when the server has no QR encoder).
  function pairingView(made, what) {
    const parts = [];
    if (made.qrSvg) {
      const img = el("img", {
        class: "qr",
        id: "pair-qr",
        alt: "QR code of the link to " + what,
        src: "data:image/svg+xml;charset=utf-8," + encodeURIComponent(made.qrSvg),
      });
      parts.push(img);
    }
    parts.push(grants.shownOnce("Link", made.url, "pair-url"));
    if (made.secret) {
      parts.push(
        el(
          "p",
          {class: "muted"},
          "Or open this server's page on the device and type the code: ",
          el("code", {id: "pair-code"}, keys.groupCode(made.secret)),
        ),
      );
    }
    return parts;
  }

  // "Add a device" (any scope; admin is everything) and "Give someone a folder".
  async function addDevice(folderOnly) {
    const name = el("input", {
      type: "text",
      id: "device-name",
      placeholder: folderOnly ? "Anna's phone" : "my tablet",
    });
    const scope = el(
      "select",
      {id: "device-scope"},
      ...(folderOnly ? [] : [el("option", {value: "admin"}, "everything, like this device")]),
      el("option", {value: "write"}, "read and write"),
      el("option", {value: "read"}, "read only"),
    );
    const folder = el("input", {type: "text", id: "device-folder", placeholder: "notes/family"});
    const fields = [
      el("label", {for: "device-name"}, "Name"),
      name,
      el("label", {for: "device-scope"}, "It may"),
      scope,
    ];
    if (folderOnly) fields.push(el("label", {for: "device-folder"}, "Only this folder"), folder);
    for (;;) {
      const go = await app.dialog(folderOnly ? "Give someone a folder" : "Add a device", fields, [
        ["cancel", "Cancel"],
        ["make", "Show the code", "primary"],
      ]);
      if (go !== "make") return grants.showKeys();
      const body = {
        name: name.value.trim() || (folderOnly ? "folder" : "device"),
        scope: scope.value,
      };
      try {
        if (folderOnly) {
          const f = folder.value.trim().replace(/\/+$/, "").replace(/^\/+/, "");
          if (!f) throw new Error("Name the folder to give, e.g. notes/family.");
          body.folder = f.startsWith("notes") ? f : "notes/" + f;
        }
        const {data} = await core.api("POST", "/auth/devices/pairings", body);
        return showPairing(data);
      } catch (e) {
        if (e instanceof core.Problem && (e.status === 401 || e.status === 429)) throw e;
        dialogProblem(fields, e); // in the dialog, which opens again with what was typed
      }
    }
  }

  // Where the link opens (the server's choice)
  const REACH = {
    home: "on your home network",
    relay: "through your relay",
    public: "at its public address",
    page: "at this page's address",
  };
  function reachText(made) {
    if (made.via !== "local") return "It opens this server " + REACH[made.via] + ": " + made.origin;
    return "Only this computer opens " + made.origin + ": start the server with --host 0.0.0.0.";
  }

  // The code to scan, until it is used (or closed); then `after` (the keys screen). `title`
  // and `intro`: a person's first device (people.js) says whose it is.
  async function showPairing(made, after, title, intro) {
    const until = new Date(made.expiresAt);
    const reach = el(
      "p",
      {id: "pair-reach", class: made.via === "local" ? "warn" : "muted"},
      reachText(made),
    );
    const status = el(
      "p",
      {id: "pair-status", role: "status"},
      "Scan it with the other device's camera. It works once, until " +
        until.toLocaleTimeString([], {hour: "2-digit", minute: "2-digit"}) +
        ".",
    );
    const shown = app.dialog(
      title || "Scan to join",
      [intro, ...pairingView(made, "join this server"), reach, status].filter(Boolean),
      [["cancel", "Done"]],
    );
    let watching = true;
    shown.then(() => (watching = false));
    while (watching && Date.now() < until.getTime()) {
      await app.sleep(2000);
      if (!watching) break;
      const {data} = await core.api("GET", "/auth/keys");
      const joined = data.keys.find((g) => g.kind === "device" && g.createdAt >= made.createdAt);
      if (joined) {
        status.textContent = "“" + joined.name + "” joined.";
        status.className = "ok";
        break;
      }
    }
    await shown;
    return (after || grants.showKeys)();
  }

  // -- tasks on a phone: everything a tasks app asks for, in one place ------------------------
  // The CalDAV address a phone opens, a user name, and a password: a device key made for the
  // app (a pairing claimed here at once), shown once, revoked like any device. And the
  // read-only calendar feeds, whose link stays in view, selected, until dismissed.

  const TASK_APPS = {
    iphone: [
      "Reminders on iPhone",
      "Settings → Apps → Reminders → Accounts → Add Account → Other → Add CalDAV Account. " +
        "Asked about SSL on a home address: Continue.",
    ],
    android: [
      "Tasks on Android",
      "DAVx5 → + → Login with URL and user name; then open the list in Tasks.org or jtx Board.",
    ],
    thunderbird: ["Thunderbird", "New Calendar → On the Network: user name and address."],
    other: ["Tasks app", "Add a CalDAV account with these."],
  };

  async function showTasks(made, feed) {
    const [where, feeds] = await Promise.all([
      core.api("GET", "/auth/devices/addresses"),
      core.api("GET", "/auth/feeds"),
    ]);
    const again = core.act(() => showTasks());
    const body = [
      el("p", {}, "Checklists in your notes (- [ ] lines) are tasks in a phone's tasks app."),
      grants.shownOnce("Server address (CalDAV)", where.data.phone.origin + "/dav/", "caldav-url"),
    ];
    if (where.data.phone.via === "local")
      body.push(el("p", {class: "warn"}, reachText(where.data.phone)));
    let first = null;
    if (made) {
      const [name, steps] = TASK_APPS[made.app];
      const password = grants.shownOnce("Password", made.key, "tasks-password");
      body.push(
        grants.shownOnce("User name", "tasks", "tasks-user"),
        password,
        el("p", {class: "warn"}, "The password is shown this once: copy it into " + name + "."),
        el("p", {id: "tasks-steps"}, steps),
        el("p", {class: "muted"}, "“" + name + "” is listed under Devices: revoke it there."),
        el(
          "div",
          {class: "row"},
          el("button", {type: "button", id: "tasks-done", onclick: again}, "Done"),
        ),
      );
      first = password.querySelector("input");
    } else {
      const which = el(
        "select",
        {id: "tasks-app"},
        ...Object.entries(TASK_APPS).map(([k, [name]]) => el("option", {value: k}, name)),
      );
      const connect = core.act(async () => {
        const name = TASK_APPS[which.value][0];
        const pairing = await core.api("POST", "/auth/devices/pairings", {name, scope: "write"});
        const {claimed} = await claim(pairing.data.secret, name);
        await showTasks({app: which.value, key: claimed.key});
      });
      const button = el(
        "button",
        {type: "button", id: "tasks-connect", class: "primary", onclick: connect},
        "Connect a tasks app",
      );
      body.push(
        el("label", {for: "tasks-app"}, "Your tasks app"),
        which,
        el("div", {class: "row"}, button),
      );
      first = button;
    }
    const list = el("ul", {class: "list", id: "feeds-list"});
    for (const f of feeds.data.feeds) {
      const drop = core.act(async () => {
        await core.api("DELETE", "/auth/feeds/" + core.enc(f.id));
        await showTasks();
      });
      const used = f.lastUsedAt ? " · used " + app.when(f.lastUsedAt) : " · not used yet";
      const info = (f.folder ? " · " + f.folder : "") + " · …" + f.hint + used;
      list.append(
        el(
          "li",
          {"data-feed": f.id},
          el("span", {}, el("strong", {}, f.name), el("small", {class: "muted"}, info)),
          el("button", {type: "button", class: "danger", onclick: drop}, "Delete"),
        ),
      );
    }
    if (!list.children.length) list.append(el("li", {class: "muted"}, "No calendar feed."));
    body.push(
      el("h3", {}, "Calendar feed"),
      el("p", {class: "muted"}, "For apps that subscribe to a link (Google Calendar, Outlook)."),
    );
    if (feed) {
      const link = grants.shownOnce("Feed “" + feed.name + "”", feed.url, "feed-url");
      body.push(el("p", {class: "warn"}, "Copy the feed's link now: it is shown this once."), link);
      if (feed.homeOnly) {
        const host = new URL(feed.url).host;
        const text = "It opens only at home (" + host + "): for Google or Outlook, ";
        body.push(el("p", {class: "warn", id: "feed-home-only"}, text + grants.RELAY_HINT));
      }
      body.push(
        el(
          "div",
          {class: "row"},
          el("button", {type: "button", id: "feed-done", onclick: again}, "Done"),
        ),
      );
      first = link.querySelector("input"); // focused and selected: nothing takes the focus away
    }
    const feedName = el("input", {type: "text", id: "feed-name", placeholder: "Google Calendar"});
    const make = core.act(async () => {
      const r = await core.api("POST", "/auth/feeds", {name: feedName.value.trim() || "feed"});
      await showTasks(null, r.data);
    });
    body.push(
      list,
      el(
        "div",
        {class: "row"},
        feedName,
        el("button", {type: "button", id: "feed-create", onclick: make}, "New calendar feed"),
      ),
    );
    return app.dialog("Tasks on your phone", body, [["cancel", "Close"]], first);
  }

  // -- Telegram: paste the bot's token, send it a code, connected ---------------------------

  async function telegramChannels() {
    const {data} = await core.api("GET", "/channels");
    return data.channels.filter((c) => c.provider === "telegram");
  }

  async function showTelegram() {
    const [channel] = await telegramChannels();
    if (!channel) return connectTelegram();
    const bound = channel.boundChat;
    const lines = [
      el(
        "p",
        {},
        el("strong", {}, channel.name),
        channel.enabled ? "" : " (switched off)",
        bound ? " saves what “" + (bound.name || bound.id) + "” sends it." : " waits for a chat.",
      ),
    ];
    if (channel.status && channel.status.ok === false) {
      lines.push(el("p", {class: "err"}, "Telegram: " + channel.status.error));
    }
    const choice = await app.dialog("Telegram", lines, [
      ["close", "Close"],
      ["bind", "Connect another chat"],
      ["toggle", channel.enabled ? "Switch off" : "Switch on"],
      ["remove", "Remove", "danger"],
    ]);
    if (choice === "bind") {
      const {data} = await core.api("POST", "/channels/" + core.enc(channel.id) + "/bind");
      return waitForChat(channel.id, data);
    }
    if (choice === "toggle") {
      await core.api("POST", "/channels/" + core.enc(channel.id) + "/toggle");
      return showTelegram();
    }
    if (choice === "remove") {
      const sure = await app.choose(
        "Remove " + channel.name + "?",
        "The bot stops saving to your notes.",
        [
          ["cancel", "Cancel"],
          ["remove", "Remove", "danger"],
        ],
      );
      if (sure === "remove") {
        await core.api("DELETE", "/channels/" + core.enc(channel.id));
        core.toast("Telegram removed");
      }
    }
    return undefined;
  }

  async function connectTelegram() {
    const token = el("input", {
      type: "text",
      id: "tg-token",
      autocomplete: "off",
      spellcheck: "false",
      placeholder: "123456789:AA…",
    });
    const body = [
      el(
        "ol",
        {},
        el("li", {}, "In Telegram, open @BotFather and send /newbot; give it a name."),
        el("li", {}, "BotFather answers with a token: paste it here."),
      ),
      el("label", {for: "tg-token"}, "Bot token"),
      token,
    ];
    for (;;) {
      const go = await app.dialog("Connect Telegram", body, [
        ["cancel", "Cancel"],
        ["connect", "Connect", "primary"],
      ]);
      if (go !== "connect") return undefined;
      let made;
      try {
        made = await core.api("POST", "/channels/connect/telegram", {botToken: token.value.trim()});
      } catch (e) {
        if (e instanceof core.Problem && (e.status === 401 || e.status === 429)) throw e;
        dialogProblem(body, e); // shown in the dialog, which opens again with the token kept
        continue;
      }
      return waitForChat(made.data.channel.id, made.data);
    }
  }

  // An error of a dialog's own action, shown inside that dialog the next time it opens.
  function dialogProblem(body, e) {
    let p = body.find((b) => b.id === "dlg-error");
    if (!p) {
      p = el("p", {id: "dlg-error", class: "err", role: "alert"});
      body.push(p);
    }
    p.textContent = e && e.message ? e.message : String(e);
  }

  async function waitForChat(id, made) {
    const until = new Date(made.bindUntil);
    const status = el(
      "p",
      {id: "tg-status", role: "status"},
      "Waiting for the first message… (the code works until " +
        until.toLocaleTimeString([], {hour: "2-digit", minute: "2-digit"}) +
        ")",
    );
    const bot = made.link
      ? el("a", {href: made.link, target: "_blank", rel: "noopener"}, "@" + made.bot)
      : "your bot";
    const parts = [el("p", {}, "Open ", bot, " in Telegram and press Start.")];
    if (made.qrSvg) {
      parts.push(
        el("img", {
          class: "qr",
          id: "tg-qr",
          alt: "QR code of the link to the bot",
          src: "data:image/svg+xml;charset=utf-8," + encodeURIComponent(made.qrSvg),
        }),
        el("p", {class: "muted"}, "On a computer? Scan this with your phone's camera."),
      );
    }
    const code = el("code", {id: "tg-code"}, made.bindCode);
    parts.push(el("p", {}, "Or send the bot this code: ", code));
    parts.push(status);
    const shown = app.dialog("Connect Telegram", parts, [["cancel", "Done"]]);
    let watching = true;
    shown.then(() => (watching = false));
    while (watching && Date.now() < until.getTime()) {
      await app.sleep(1500);
      if (!watching) break;
      const {data} = await core.api("GET", "/channels/" + core.enc(id));
      if (data.boundChat) {
        status.textContent = "Connected to " + (data.boundChat.name || data.boundChat.id) + ".";
        status.className = "ok";
        break;
      }
    }
    return shown;
  }

  // A code typed from another device's screen (where no camera can scan it).
  async function joinWithCode() {
    const msg = $("join-msg");
    msg.textContent = "";
    const code = $("join-code")
      .value.replace(/[^A-Za-z2-7]/g, "")
      .toLowerCase();
    if (code.length !== 26) {
      msg.textContent = "A code is 26 letters and digits (groups of four): check it and try again.";
      return;
    }
    $("join").disabled = true;
    try {
      const {base, claimed} = await claim(code, "");
      keepDevice(base, claimed);
      state.base = base;
      await core.connect(false);
    } catch (e) {
      msg.textContent = e.message || String(e);
    } finally {
      $("join").disabled = false;
    }
  }

  function wireDevices() {
    $("setup").addEventListener("click", setUpServer);
    $("pair-join").addEventListener("click", joinWithPairing);
    $("join").addEventListener("click", joinWithCode);
    $("join-code").addEventListener("keydown", (e) => {
      if (e.key === "Enter") joinWithCode();
    });
  }

  return {
    addDevice,
    deviceGuess,
    dialogProblem,
    offerSetup,
    pairingInUrl,
    showPairing,
    showTasks,
    showTelegram,
    wireDevices,
  };
})();
