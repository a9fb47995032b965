// -- capture: Record (its code loaded on first use) and the line about text inside files --
// Record needs a secure context (HTTPS, or localhost): elsewhere it names the address that
// has one. record.js is fetched when Record is first pressed (the page stays under its
// budget); the service worker keeps it for offline starts.

const capturing = (() => {
  const {$} = core;
  let facts = null;

  async function capturedFacts() {
    if (!facts) facts = (await core.api("GET", "/capture")).data;
    return facts;
  }

  function loadRecorder() {
    if (window.notesvcRecorder) return Promise.resolve(window.notesvcRecorder);
    return new Promise((resolve, reject) => {
      const s = document.createElement("script");
      s.src = "record.js";
      s.integrity = $("record").dataset.sri;
      s.onload = () => resolve(window.notesvcRecorder);
      s.onerror = () => reject(new Error("Record could not load: check the connection."));
      document.head.append(s);
    });
  }

  async function record() {
    if (!window.isSecureContext || !navigator.mediaDevices) {
      const f = await capturedFacts().catch(() => ({record: {}}));
      const there = f.record.secureUrl;
      core.toast(
        "Recording needs HTTPS" + (there ? ": open " + there : " (this server has none yet)"),
        true,
      );
      return;
    }
    (await loadRecorder()).open();
  }

  // The first search says how far the reader of PDFs and images got (or why it is off).
  async function fileTextLine() {
    const t = (await capturedFacts()).attachmentText;
    const line = $("file-text");
    line.textContent =
      "Text inside files: " +
      (t.enabled ? t.read + " of " + t.files + " read" : "off, " + t.reason) +
      (t.waiting ? ", " + t.waiting + " waiting" : "");
    line.hidden = false;
  }

  function wireCapture() {
    $("record").onclick = core.act(record);
    $("search").addEventListener("focus", () => fileTextLine().catch(() => {}), {once: true});
  }

  return {wireCapture};
})();
