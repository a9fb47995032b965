"use strict";
// -- Record: a voice note from the microphone (loaded when Record is first pressed) ---------
// MediaRecorder: WebM/Opus where the browser has it, MP4/AAC on iOS. Stop sends the audio's
// own bytes to POST /capture/voice, which keeps it as an attachment and writes a note with it
// and its transcript. With no connection it waits in the outbox ("Keep notes on this device"
// on), or on this page until the connection is back.

window.notesvcRecorder = (() => {
  const {$} = core;
  const TYPES = ["audio/webm;codecs=opus", "audio/webm", "audio/mp4", "audio/ogg;codecs=opus"];
  let rec = null;
  let chunks = [];
  let stream = null;
  let started = 0;
  let timer = 0;
  const waiting = []; // recordings made with no connection and no outbox: sent when it is back

  function say(text) {
    $("record-msg").textContent = text;
  }

  function panel() {
    if ($("record-box")) return $("record-box");
    const el = markdown.el;
    const stopSave = {
      id: "record-stop",
      type: "button",
      class: "primary",
      onclick: () => stop(true),
    };
    const box = el(
      "div",
      {id: "record-box", class: "record-box", role: "dialog"},
      el("span", {class: "record-dot", "aria-hidden": "true"}, "●"),
      el("span", {id: "record-time", role: "timer"}, "0:00"),
      el("button", stopSave, "Stop and save"),
      el("button", {id: "record-cancel", type: "button", onclick: () => stop(false)}, "Cancel"),
      el("p", {id: "record-msg", role: "status"}, ""),
    );
    box.setAttribute("aria-label", "Record a voice note");
    // its look here, not in the page's CSS (the page keeps its budget; CSSOM, not markup)
    Object.assign(box.style, {
      position: "fixed",
      left: "0",
      right: "0",
      bottom: "0",
      zIndex: "30",
      display: "flex",
      flexWrap: "wrap",
      alignItems: "center",
      gap: "0.6rem",
      padding: "0.8rem 1rem",
      background: getComputedStyle(document.body).backgroundColor || "#fff",
      borderTop: "1px solid #c8ced6",
    });
    box.firstChild.style.color = "#c62828";
    box.lastChild.style.cssText = "flex-basis: 100%; margin: 0";
    document.body.append(box);
    return box;
  }

  function tick() {
    const s = Math.floor((Date.now() - started) / 1000);
    $("record-time").textContent = Math.floor(s / 60) + ":" + String(s % 60).padStart(2, "0");
  }

  async function open() {
    if (rec) return;
    panel().hidden = false;
    $("record-stop").hidden = false;
    $("record-stop").disabled = true;
    $("record-cancel").textContent = "Cancel";
    say("Asking for the microphone…");
    try {
      stream = await navigator.mediaDevices.getUserMedia({audio: true});
    } catch (e) {
      say("No microphone: " + (e.message || e.name) + ". Allow it for this page and try again.");
      return;
    }
    const type = TYPES.find((t) => window.MediaRecorder && MediaRecorder.isTypeSupported(t));
    rec = new MediaRecorder(stream, type ? {mimeType: type} : {});
    chunks = [];
    rec.ondataavailable = (e) => {
      if (e.data && e.data.size) chunks.push(e.data);
    };
    rec.start(1000);
    $("record-box").firstChild.style.visibility = "visible"; // the red dot: recording now
    started = Date.now();
    tick();
    timer = setInterval(tick, 500);
    $("record-stop").disabled = false;
    say("Recording…");
  }

  function stop(keep) {
    const r = rec;
    rec = null;
    clearInterval(timer);
    $("record-box").firstChild.style.visibility = "hidden"; // no longer recording
    if (!r) {
      $("record-box").hidden = true;
      return;
    }
    r.onstop = () => {
      stream.getTracks().forEach((t) => t.stop());
      const blob = new Blob(chunks, {type: (r.mimeType || "audio/webm").split(";")[0]});
      chunks = [];
      if (keep) core.act(save)(blob, app.newId());
      else $("record-box").hidden = true;
    };
    r.stop();
  }

  async function save(blob, key) {
    $("record-stop").disabled = true;
    say("Saving…");
    try {
      const {data} = await core.api("POST", "/capture/voice", blob, {"Idempotency-Key": key});
      say(
        data.transcribed
          ? "Saved to " + paths.nameOf(data.path) + ": “" + (data.transcript || "") + "”"
          : "Saved to " + paths.nameOf(data.path) + " (not transcribed).",
      );
      $("record-stop").hidden = true;
      $("record-cancel").textContent = "Close";
      core.loadRecent().catch(() => {});
    } catch (e) {
      if (!offline.unreachable(e)) {
        say("Not saved: " + e.message);
        return;
      }
      if (offline.offlineOn()) {
        await offline.updateOutbox((items) =>
          outbox.queueVoice(items, blob, key, Date.now(), app.newId),
        );
        say("No connection: the recording waits in the outbox and is sent when it is back.");
        return;
      }
      waiting.push([blob, key]);
      say("No connection: the recording waits on this page (keep it open) until it is back.");
      window.addEventListener("online", () => core.act(sendWaiting)(), {once: true});
    }
  }

  async function sendWaiting() {
    for (const [blob, key] of waiting.splice(0)) await save(blob, key);
  }

  return {open};
})();
