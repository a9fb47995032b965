// -- autosave: when the open note is saved (pure: no page, no timers; node --test web/) -----
// A second after the last keystroke, or every 3 s while typing goes on, never more than one
// request a second; a failed save is tried again, less and less often. A new note waits for
// its first line to be finished (or five quiet seconds): that line names it. As the page
// hides, a small note goes out at once (a request that outlives the page); a large one waits
// in this browser, as its draft, for the next visit. Times are in milliseconds.
const saveTiming = (() => {
  // Whether a new note's first line is still being written.
  function naming(blank, text) {
    return blank && !/\S[^\n]*\n/.test(text);
  }

  // How long to wait before saving, `now`: typing began at dirtySince (unsaved since), the
  // last save started at lastSave.
  function wait(now, dirtySince, lastSave, isNaming) {
    const due = isNaming ? 5000 : Math.min(1000, dirtySince + 3000 - now);
    return Math.max(due, lastSave + 1000 - now, 0);
  }

  // How long to wait after the n-th failure in a row (n >= 1).
  function retry(failures) {
    return Math.min(60000, 5000 * failures);
  }

  // As the page hides: whether the text also goes to the server now (it is always kept as
  // the draft). Not when nothing is unsaved, no note is open or a new one is being written,
  // a save is on its way (its base would be stale), the text is over 64 KiB (a request that
  // outlives the page is limited), or the key is not the one kept for this server.
  function sendsAsThePageHides(o) {
    if (!o.dirty || !o.path || o.blank || o.writes) return false;
    return o.bytes <= 64 * 1024 && !!o.key && o.keyBase === o.base;
  }

  return {naming, wait, retry, sendsAsThePageHides};
})();

if (typeof module !== "undefined") module.exports = saveTiming;
