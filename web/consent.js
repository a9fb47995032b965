"use strict";
const $ = (id) => document.getElementById(id);
const ask = new URLSearchParams(location.search);
// This page is {base}/oauth/authorize; the API is {base}/api/v1 on this same origin.
const api = location.pathname.replace(/\/oauth\/authorize\/?$/, "") + "/api/v1";
let facts = null,
  back = "",
  signedIn = "";

function say(text) {
  $("msg").textContent = text;
}

async function load() {
  const params = new URLSearchParams();
  [
    "client_id",
    "redirect_uri",
    "response_type",
    "state",
    "code_challenge",
    "code_challenge_method",
    "scope",
    "resource",
  ].forEach((name) => {
    if (ask.has(name)) params.set(name, ask.get(name));
  });
  let r,
    j = null;
  try {
    r = await fetch(api + "/oauth/consent?" + params, {mode: "same-origin"});
    j = await r.json();
  } catch (e) {
    say("The notes server cannot be reached right now.");
    return;
  }
  if (!r.ok || !j || !j.success) {
    say(j && j.error ? j.error.message : "This request cannot be answered.");
    if (j && j.error && j.error.redirect) {
      back = j.error.redirect;
      $("back").classList.remove("hidden");
    }
    return;
  }
  facts = j.data;
  $("client").textContent = facts.client.name;
  $("client-id").textContent = facts.client.id;
  $("host").textContent = facts.redirectHost;
  if (!facts.writeAllowed) $("write-row").classList.add("hidden");
  else if (facts.scope === "write") $("scope-write").checked = true;
  if (facts.writeAllowed === "suggest") {
    // SERVICE_MCP_WRITE=suggest: its writes wait for you to accept them
    $("write-text").textContent = "read your notes and suggest changes (you accept or reject each)";
  }
  // The web client's key on this origin (session or device), offered only when it was kept
  // for this very server's API: on a relay, every server's consent page has this origin.
  let kept = "",
    device = null;
  try {
    const shared = document.documentElement.dataset.origin === "shared"; // a relay's: keep off
    for (const store of shared ? [] : [sessionStorage, localStorage]) {
      if (!kept && store.getItem("notesvc.keyFor") === api) {
        kept = store.getItem("notesvc.key") || "";
        if (kept.startsWith("nsd_")) device = JSON.parse(store.getItem("notesvc.device") || "null");
      }
    }
  } catch (e) {
    /* storage is off in this browser */
  }
  $("ask").classList.remove("hidden");
  if (kept && device && device.scope === "admin") {
    // This browser is an admin device of this very server: it approves as itself.
    signedIn = kept;
    $("device").textContent = device.name || "this device";
    $("signed-in").classList.remove("hidden");
    $("key-row").classList.add("hidden");
    await asPerson(kept, device);
    $("allow").focus();
    return;
  }
  if (kept && !kept.startsWith("nsd_")) $("key").value = kept;
  $("key").focus();
}

// A person's admin device: "Signed in as <person> · <device>", and the folders offered are
// those of their reach (their home, the folders shared with them), not a path to type.
async function asPerson(key, device) {
  let who = null;
  try {
    const r = await fetch(api + "/auth/verify", {
      method: "POST",
      mode: "same-origin",
      headers: {"X-Service-Key": key},
    });
    who = r.ok ? (await r.json()).data : null;
  } catch (e) {
    /* the owner's page as it was: the server says no to a key it does not take */
  }
  if (!who || !who.person) return;
  const name = (who.grant && who.grant.name) || device.name || "this device";
  $("device").textContent = who.person.name + " · " + name;
  const pick = $("folder-pick");
  for (const r of who.reach || []) {
    const whose = r.sharedBy ? "shared by " + r.sharedBy.name : "your own";
    const option = document.createElement("option");
    option.value = r.path;
    option.textContent = r.path + " (" + whose + (r.scope === "read" ? ", read only)" : ")");
    pick.append(option);
  }
  pick.classList.remove("hidden");
  $("folder").classList.add("hidden");
  $("folder-label").htmlFor = "folder-pick";
  $("folder-label").textContent = "Which of your folders";
}

async function allow() {
  say("");
  const body = {
    clientId: facts.client.id,
    redirectUri: facts.redirectUri,
    codeChallenge: ask.get("code_challenge") || "",
    resource: facts.resource,
    scope: $("scope-write").checked ? "notes:read notes:write" : "notes:read",
  };
  if (ask.get("state")) body.state = ask.get("state");
  const picked = !$("folder-pick").classList.contains("hidden");
  let folder = (picked ? $("folder-pick") : $("folder")).value.trim().replace(/\/+$/, "");
  if (folder) body.folder = folder.startsWith("notes/") ? folder : "notes/" + folder;
  $("allow").disabled = true;
  try {
    const r = await fetch(api + "/oauth/approve", {
      method: "POST",
      mode: "same-origin",
      headers: {
        "Content-Type": "application/json",
        "X-Service-Key": signedIn || $("key").value.trim(),
      },
      body: JSON.stringify(body),
    });
    const j = await r.json().catch(() => null);
    if (r.ok && j && j.success) {
      location.assign(j.data.redirect);
      return;
    }
    say(j && j.error ? j.error.message : "Not allowed.");
  } catch (e) {
    say("The notes server cannot be reached right now.");
  }
  $("allow").disabled = false;
}

$("allow").onclick = allow;
$("key").onkeydown = (e) => {
  if (e.key === "Enter") allow();
};
$("deny").onclick = () => {
  if (facts) location.assign(facts.deny);
};
$("return").onclick = () => {
  if (back) location.assign(back);
};
load();
