// -- the page starts here: every file before this one only defines -------------------------
// Wire the page's controls, then start: the kept key connects, a pairing link offers to
// join, or the setup (or the key) is asked for.

(() => {
  wire();
  grants.wireGrants();
  wireDevices();
  wireOffline();
  const code = new URLSearchParams(location.search).get("relayCode");
  if (new URLSearchParams(location.search).get("share") === "off") {
    // the share sheet reached the server itself: no worker here to keep what was shared
    history.replaceState(history.state, "", location.pathname);
    toast(
      "Sharing to notesvc needs “Keep notes on this device” (in the menu): turn it on, " +
        "then share again.",
      true,
    );
  }
  if (code) $("relay-code").value = code;
  const pairing = pairingInUrl();
  if (pairing) {
    // the secret leaves the address bar and the history at once: it is good once
    history.replaceState(history.state, "", location.pathname + location.search);
    $("pair-box").dataset.secret = pairing;
    $("pair-name").placeholder = "the name it was given, or " + deviceGuess();
    $("pair-box").hidden = false;
    if (SHARED_ORIGIN) {
      $("pair-msg").textContent =
        "This relay gives all its servers one address, where nothing can be kept: open " +
        "the link on the server's own address instead.";
      $("pair-join").disabled = true;
    }
  }
  if (SHARED_ORIGIN) {
    $("shared-origin").hidden = false;
    $("remember").closest("label").hidden = true;
  }
  const kept = keptKey();
  state.base = kept ? kept.base : getItem("local", "notesvc.base") || "";
  if (!ownOrigin(state.base) || /^[a-z]+:/i.test(state.base)) state.base = "";
  if (getItem("local", "notesvc.wipe")) forgetOffline().catch(() => {}); // one cut short
  // A pairing code may name any server: the page waits for a person to connect, and then
  // sends the kept key only if the code resolves to the API base it was kept for.
  if (kept && !code && !pairing) connect(false);
  else if (!pairing && !kept && !SHARED_ORIGIN) offerSetup();
  else if (!pairing) $("key").focus();
})();
