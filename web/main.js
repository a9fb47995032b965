// -- the page starts here: every file before this one only defines -------------------------
// Wire the page's controls, then start: the kept key connects, a pairing link offers to
// join, or the setup (or the key) is asked for.

(() => {
  const {$, state} = core;
  app.wire();
  grants.wireGrants();
  devices.wireDevices();
  people.wirePeople();
  offline.wireOffline();
  capturing.wireCapture();
  suggestions.wireSuggestions();
  const code = new URLSearchParams(location.search).get("relayCode");
  if (new URLSearchParams(location.search).get("share") === "off") {
    // the share sheet reached the server itself: no worker here to keep what was shared
    history.replaceState(history.state, "", location.pathname);
    core.toast(
      "Sharing to notesvc needs “Keep notes on this device” (in the menu): turn it on, " +
        "then share again.",
      true,
    );
  }
  if (code) $("relay-code").value = code;
  const pairing = devices.pairingInUrl();
  if (pairing) {
    // the secret leaves the address bar and the history at once: it is good once
    history.replaceState(history.state, "", location.pathname + location.search);
    $("pair-box").dataset.secret = pairing;
    $("pair-name").placeholder = "the name it was given, or " + devices.deviceGuess();
    $("pair-box").hidden = false;
    if (core.SHARED_ORIGIN) {
      $("pair-msg").textContent =
        "This relay gives all its servers one address, where nothing can be kept: open " +
        "the link on the server's own address instead.";
      $("pair-join").disabled = true;
    }
  }
  if (core.SHARED_ORIGIN) {
    $("shared-origin").hidden = false;
    $("remember").closest("label").hidden = true;
  }
  const kept = core.keptKey();
  state.base = kept ? kept.base : core.getItem("local", "notesvc.base") || "";
  if (!core.ownOrigin(state.base) || /^[a-z]+:/i.test(state.base)) state.base = "";
  // one cut short
  if (core.getItem("local", "notesvc.wipe")) offline.forgetOffline().catch(() => {});
  // A pairing code may name any server: the page waits for a person to connect, and then
  // sends the kept key only if the code resolves to the API base it was kept for.
  if (kept && !code && !pairing) core.connect(false);
  else if (!pairing && !kept && !core.SHARED_ORIGIN) devices.offerSetup();
  else if (!pairing) $("key").focus();
})();
