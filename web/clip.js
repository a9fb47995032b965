"use strict";
// The bookmarklet's page (/clip). It keeps a device key of its own in this origin's storage
// (connected like a device: a pairing link or code). The bookmarklet opens it and hands it
// {url, title, html, selection} by postMessage: only a message from the window that opened
// this one is taken (event.source), for a URL of that window's own origin (event.origin),
// and the page's bytes never carry a key or an image.
(() => {
  const $ = (id) => document.getElementById(id);
  const KEY = "notesvc.clipKey";
  const api = new URL("api/v1", new URL(".", location.href)).pathname;
  const target = location.href.split(/[?#]/)[0];
  let page = null;

  function keyOf() {
    try {
      return localStorage.getItem(KEY);
    } catch (e) {
      return null;
    }
  }
  function show(id, on) {
    $(id).classList.toggle("hidden", !on);
  }
  function say(text, bad) {
    $("msg").textContent = text;
    $("msg").className = bad ? "err" : "";
  }

  async function call(method, path, body, key) {
    const headers = {"Content-Type": "application/json"};
    if (key) headers["X-Service-Key"] = key;
    let r;
    try {
      r = await fetch(api + path, {
        method,
        headers,
        body: JSON.stringify(body),
        mode: "same-origin",
        credentials: "omit",
        cache: "no-store",
      });
    } catch (e) {
      throw new Error("Cannot reach the server. Check the connection and try again.");
    }
    const j = await r.json().catch(() => ({}));
    if (!r.ok) {
      const err = new Error(j.error ? j.error.message : "The server answered " + r.status + ".");
      err.status = r.status;
      throw err;
    }
    return {status: r.status, data: j.data};
  }

  async function connect() {
    const raw = $("pair").value.trim();
    const m = /#pair=([A-Za-z2-7-]{26,40})/.exec(raw);
    const secret = m ? m[1] : raw.replace(/[^A-Za-z2-7]/g, "").toLowerCase();
    if (!secret) return say("Paste the link or type the code first.", true);
    try {
      const {data} = await call("POST", "/auth/devices/claim", {secret, deviceName: "Bookmarklet"});
      localStorage.setItem(KEY, data.key);
      $("pair").value = "";
      say("Connected.");
      render();
    } catch (e) {
      say(e.message, true);
    }
  }

  async function send(selectionOnly) {
    if (!page) return;
    const body = {url: page.url, title: page.title};
    if (selectionOnly) body.selection = page.selection;
    else body.html = page.html;
    const folder = $("folder").value.trim();
    if (folder) body.folder = folder;
    if ($("fresh").checked) body.new = true;
    say("Clipping…");
    try {
      const {status, data} = await call("POST", "/capture/clip", body, keyOf());
      say((status === 201 ? "Saved as " : "Updated ") + data.path);
      setTimeout(() => window.close(), 1500);
    } catch (e) {
      if (e.status === 401) {
        localStorage.removeItem(KEY);
        render();
        return say("This page's key no longer works: connect again.", true);
      }
      say(e.message, true);
    }
  }

  function render() {
    const key = keyOf();
    show("connect", !key);
    show("clip", !!key && !!page);
    show("bookmarklet", !!key);
    if (key && !page) {
      say(window.opener ? "Waiting for the page…" : "Press the bookmarklet on a page to clip it.");
    }
  }

  function bookmarklet() {
    const code =
      "javascript:(function(){var T=" +
      JSON.stringify(target) +
      ',O=new URL(T).origin,w=window.open(T,"notesvc-clip","width=460,height=640");' +
      'if(!w){alert("notesvc: allow pop-ups for this site to clip it");return}' +
      'var s=getSelection(),h="";if(s&&s.rangeCount&&!s.isCollapsed){' +
      'var d=document.createElement("div");' +
      "for(var i=0;i<s.rangeCount;i++)" +
      "d.appendChild(s.getRangeAt(i).cloneContents());h=d.innerHTML}" +
      'var m={type:"notesvc-clip",url:location.href,title:document.title,' +
      "html:document.documentElement.outerHTML,selection:h};" +
      'function f(e){if(e.source===w&&e.origin===O&&e.data==="notesvc-clip-ready"){' +
      'w.postMessage(m,O);removeEventListener("message",f)}}addEventListener("message",f)})();';
    $("bm-link").href = code;
    $("bm-code").value = code;
  }

  window.addEventListener("message", (event) => {
    if (!window.opener || event.source !== window.opener) return; // only the page that opened us
    const d = event.data;
    if (!d || d.type !== "notesvc-clip" || typeof d.url !== "string") return;
    if (typeof d.html !== "string" || typeof d.title !== "string") return;
    // a page speaks for its own address only: another site that opened this page can't
    // have a clip of (and so the note of) https://your-bank.example/ saved in its place
    let origin = null;
    try {
      origin = new URL(d.url).origin;
    } catch (e) {
      return;
    }
    if (origin !== event.origin) return;
    page = {url: d.url, title: d.title, html: d.html, selection: String(d.selection || "")};
    $("page").textContent = (page.title || page.url) + " — " + page.url;
    $("clip-selection").disabled = !page.selection;
    say(page.selection ? "A selection is there too." : "");
    render();
  });
  $("pair-go").onclick = connect;
  $("clip-page").onclick = () => send(false);
  $("clip-selection").onclick = () => send(true);
  $("forget").onclick = () => {
    localStorage.removeItem(KEY);
    render();
  };
  bookmarklet();
  render();
  // the bookmarklet waits for this before it hands the page over (it checks our origin)
  if (window.opener) window.opener.postMessage("notesvc-clip-ready", "*");
})();
