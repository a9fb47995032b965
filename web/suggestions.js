// -- suggestions: an assistant's edits waiting for approval (docs/api.md: Suggestions) ----
// With SERVICE_MCP_WRITE=suggest (or SERVICE_AGENT_WRITE=suggest) an assistant's writes wait
// here: a badge in the bar says how many, a dialog shows each as a diff with Accept and
// Reject. `#suggestion=<id>` (the link an assistant gives) opens that one.

const suggestions = (() => {
  const {$} = core;
  const el = markdown.el;
  let timer = null;

  const KIND = {create: "New note", edit: "Edit", move: "Move", delete: "Delete"};

  function diffView(text) {
    const pre = el("pre", {class: "diff"});
    for (const line of (text || "").split("\n")) {
      if (!line) continue;
      let cls = null;
      if (line.startsWith("+++") || line.startsWith("---") || line.startsWith("@@")) cls = "hunk";
      else if (line.startsWith("+")) cls = "add";
      else if (line.startsWith("-")) cls = "del";
      pre.appendChild(el("span", {class: cls}, line));
    }
    return pre;
  }

  // How many wait: the badge (hidden when none, or on a server without suggestions).
  async function refresh() {
    let total = 0;
    try {
      total = (await core.api("GET", "/suggestions?limit=1")).data.total;
    } catch (e) {
      total = 0;
    }
    const badge = $("suggestions-badge");
    badge.hidden = !total;
    badge.textContent = total === 1 ? "1 suggestion" : total + " suggestions";
  }

  async function decide(s, verb, row) {
    try {
      const r = await core.api("POST", "/suggestions/" + core.enc(s.id) + "/" + verb);
      if (verb === "reject") core.toast("Rejected.");
      else core.toast(r.data.merged ? "Accepted, merged with later changes." : "Accepted.");
      row.remove();
    } catch (e) {
      if (!(e instanceof core.Problem) || e.status !== 409) throw e;
      if (e.error && e.error.conflictPath) {
        core.toast("The note changed there too: the suggestion is kept as " + e.error.conflictPath);
        row.remove();
      } else {
        core.toast(e.message, true); // a move or delete of a note changed since: still open
      }
    }
    await core.loadTree();
    await refresh();
  }

  async function show(only) {
    const {data} = await core.api("GET", "/suggestions?limit=200");
    const shown = data.suggestions.filter((s) => !only || s.id === only);
    const list = el("ul", {class: "list suggestions", id: "suggestion-items"});
    for (const s of shown) {
      const where = s.newPath ? s.path + " → " + s.newPath : s.path;
      const row = el(
        "li",
        {"data-suggestion": s.id},
        el("strong", {}, (KIND[s.kind] || s.kind) + ": " + where),
        el("small", {class: "muted"}, " · " + s.connector.name + " · " + app.when(s.createdAt)),
        diffView(s.diff),
      );
      if (grants.writable()) {
        row.appendChild(
          el(
            "span",
            {class: "actions"},
            el(
              "button",
              {type: "button", class: "primary", onclick: core.act(() => decide(s, "accept", row))},
              "Accept",
            ),
            el(
              "button",
              {type: "button", onclick: core.act(() => decide(s, "reject", row))},
              "Reject",
            ),
          ),
        );
      }
      list.appendChild(row);
    }
    const none = only ? "This suggestion was accepted or rejected already." : "Nothing waits.";
    await app.dialog("Suggestions", shown.length ? list : none, [["cancel", "Close"]]);
  }

  // A link to one suggestion (#suggestion=<id>): shown, and the address cleaned.
  async function fromHash() {
    const m = /^#suggestion=([A-Za-z0-9_-]{1,64})$/.exec(location.hash);
    if (!m) return false;
    history.replaceState(history.state, "", location.pathname + location.search);
    await show(m[1]);
    return true;
  }

  // Once connected: the badge now, and again every minute while the page is seen.
  async function start() {
    await refresh();
    clearInterval(timer);
    timer = setInterval(() => {
      if (document.visibilityState === "visible") refresh();
    }, 60000);
    await fromHash();
  }

  function wireSuggestions() {
    $("suggestions-badge").addEventListener(
      "click",
      core.act(() => show()),
    );
    addEventListener("hashchange", core.act(fromHash));
  }

  return {refresh, show, start, wireSuggestions};
})();
