"use strict";
// The toolbar popup: connect once (a pairing link), then Clip page / Clip selection of the
// page you were on.
(() => {
  const $ = (id) => document.getElementById(id);
  const api = clipper.api;

  function say(text, bad) {
    $("msg").textContent = text;
    $("msg").className = bad ? "err" : "";
  }

  // The page to clip: the active tab, or (the popup opened in a tab of its own) the page
  // used last.
  async function pageTab() {
    const [active] = await api.tabs.query({active: true, currentWindow: true});
    if (active && /^https?:/.test(active.url || "")) return active;
    const tabs = (await api.tabs.query({})).filter((t) => /^https?:/.test(t.url || ""));
    tabs.sort((a, b) => (b.lastAccessed || 0) - (a.lastAccessed || 0));
    if (!tabs.length) throw new Error("Open the page you want to keep first.");
    return tabs[0];
  }

  async function render() {
    const conn = await clipper.connection();
    $("connect").hidden = !!conn;
    $("clip").hidden = !conn;
    if (conn)
      $("server").textContent =
        "Connected to " + conn.apiBase.replace(/\/api\/v1$/, "") + " as " + conn.device;
    const {last} = await api.storage.local.get("last");
    if (last && !last.ok && Date.now() - last.at < 60000) say(last.message, true);
  }

  async function clip(mode) {
    say(mode === "selection" ? "Clipping the selection…" : "Clipping the page…");
    try {
      const tab = await pageTab();
      const made = await clipper.clipTab(tab, mode, {
        folder: $("folder").value.trim(),
        fresh: $("fresh").checked,
      });
      say(
        (made.updated ? "Updated " : "Saved as ") +
          made.path +
          (made.images ? " (" + made.images + " images)" : ""),
      );
    } catch (e) {
      say(e.message, true);
    }
  }

  $("connect-go").addEventListener("click", async () => {
    say("Connecting…");
    try {
      await clipper.connect($("link").value, "Web clipper");
      say("Connected.");
      await render();
    } catch (e) {
      say(e.message, true);
    }
  });
  $("clip-page").addEventListener("click", () => clip("page"));
  $("clip-selection").addEventListener("click", () => clip("selection"));
  $("forget").addEventListener("click", async () => {
    await clipper.forget();
    say("Disconnected: this clipper's key is forgotten here (revoke it under Keys and devices).");
    await render();
  });
  render();
})();
