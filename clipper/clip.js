"use strict";
// notesvc clipper: what the popup and the background share. Plain files, no build step and
// no remote code: the page is read where it was rendered (with its logins and paywalls), its
// readable part and its images are sent to POST /api/v1/capture/clip, and the server never
// fetches the URL. The clipper connects like a device (a pairing link from Add a device);
// its key stays in this extension's local storage.

const clipper = (() => {
  const api = globalThis.browser || globalThis.chrome;
  const MAX_IMAGE_BYTES = 10_000_000; // the server takes images up to this
  const MAX_IMAGES = 50;
  const INLINE_BUDGET = 12_000_000; // base64 sent inside the clip; larger images go first
  const TYPES = {
    "image/png": "png",
    "image/jpeg": "jpg",
    "image/gif": "gif",
    "image/webp": "webp",
    "image/avif": "avif",
    "image/bmp": "bmp",
  };

  async function connection() {
    return (await api.storage.local.get("connection")).connection || null;
  }

  async function call(conn, method, path, body) {
    const headers = {"X-Service-Key": conn.key};
    let payload = body;
    if (body !== undefined && !(body instanceof FormData)) {
      headers["Content-Type"] = "application/json";
      payload = JSON.stringify(body);
    }
    let r;
    try {
      r = await fetch(conn.apiBase + path, {method, headers, body: payload, credentials: "omit"});
    } catch (e) {
      throw new Error("Cannot reach " + conn.apiBase + ": check the connection.");
    }
    const j = await r.json().catch(() => ({}));
    if (!r.ok || !j.success) {
      const said = j.error ? j.error.message : "The server answered " + r.status + ".";
      const e = new Error(
        r.status === 401
          ? "This clipper's key no longer works (revoked?): connect it again with a new " +
              "link from Add a device. (" + said + ")"
          : said,
      );
      e.status = r.status;
      throw e;
    }
    return j.data;
  }

  // A pairing link from Add a device (…/#pair=<secret>): claimed once for this clipper's key.
  async function connect(link, deviceName) {
    const m = /^(https?:\/\/[^#\s]+?)\/?#pair=([A-Za-z2-7-]{26,40})$/.exec(link.trim());
    if (!m) throw new Error("Paste the whole link from Add a device (it ends in #pair=…).");
    let r;
    try {
      r = await fetch(m[1] + "/api/v1/auth/devices/claim", {
        method: "POST",
        headers: {"Content-Type": "application/json"},
        body: JSON.stringify({secret: m[2], deviceName}),
        credentials: "omit",
      });
    } catch (e) {
      throw new Error("Cannot reach " + m[1] + ": check the address.");
    }
    const j = await r.json().catch(() => ({}));
    if (!r.ok || !j.data)
      throw new Error(j.error ? j.error.message : "The server said " + r.status);
    const conn = {apiBase: j.data.apiBase, key: j.data.key, device: j.data.device.name, home: ""};
    const me = await call(conn, "POST", "/auth/verify").catch(() => ({}));
    conn.home = me.person ? me.person.home : "";
    conn.scope = me.scope || j.data.device.scope;
    await api.storage.local.set({connection: conn});
    return conn;
  }

  async function forget() {
    await api.storage.local.remove("connection");
  }

  // Runs inside the page (scripting.executeScript): its readable part, or the selection,
  // with links and images made absolute, and the images' addresses. Self-contained.
  function readPage(mode) {
    const abs = (u) => {
      try {
        const url = new URL(u, document.baseURI);
        return /^https?:$/.test(url.protocol) ? url.href : "";
      } catch (e) {
        return "";
      }
    };
    const tidy = (original, copy) => {
      const imgs = original.querySelectorAll("img");
      copy.querySelectorAll("img").forEach((img, i) => {
        const from = imgs[i] || img;
        const src = from.currentSrc || from.getAttribute("data-src") || from.getAttribute("src");
        img.setAttribute("src", abs(src || ""));
        img.removeAttribute("srcset");
      });
      copy.querySelectorAll("a[href]").forEach((a) => {
        const href = a.getAttribute("href");
        a.setAttribute("href", href.startsWith("#") ? href : abs(href));
      });
      copy
        .querySelectorAll("script, style, noscript, iframe, form, nav, aside, button")
        .forEach((el) => el.remove());
      return copy;
    };
    let html = "";
    let holder = null;
    const sel = getSelection();
    if (sel && sel.rangeCount && !sel.isCollapsed) {
      const box = document.createElement("div");
      for (let i = 0; i < sel.rangeCount; i++) box.appendChild(sel.getRangeAt(i).cloneContents());
      holder = tidy(box, box);
    }
    const selection = holder ? holder.innerHTML : "";
    if (mode !== "selection") {
      let root = document.querySelector("article") || document.querySelector("main, [role=main]");
      if (!root) {
        let best = null;
        let most = 0;
        for (const el of document.querySelectorAll("div, section")) {
          let n = 0;
          for (const child of el.children) if (child.tagName === "P") n += child.textContent.length;
          if (n > most) [best, most] = [el, n];
        }
        root = most > 200 ? best : document.body;
      }
      holder = tidy(root, root.cloneNode(true));
      html = holder.outerHTML;
    }
    const images = [];
    if (holder) {
      for (const img of holder.querySelectorAll("img")) {
        const src = img.getAttribute("src");
        if (src && !images.includes(src)) images.push(src);
      }
    }
    return {url: location.href, title: document.title, html, selection, images};
  }

  function base64(bytes) {
    let text = "";
    for (let i = 0; i < bytes.length; i += 0x8000) {
      text += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
    }
    return btoa(text);
  }

  // An image as the browser gets it (its cookies for that site go with the request).
  async function image(src) {
    let r;
    try {
      r = await fetch(src, {credentials: "include"});
    } catch (e) {
      return null;
    }
    if (!r.ok) return null;
    const blob = await r.blob();
    const type = (blob.type || "").split(";")[0];
    if (!TYPES[type] || blob.size > MAX_IMAGE_BYTES) return null; // never SVG: it can run
    return {type, bytes: new Uint8Array(await blob.arrayBuffer())};
  }

  // An image too large to go inside the clip: uploaded first, then named by its path.
  async function uploadFirst(conn, src, got) {
    const day = new Date().toISOString().slice(0, 10);
    const home = conn.home ? conn.home.replace(/^notes\//, "") + "/inbox" : "inbox";
    const stem = (src.split(/[?#]/)[0].split("/").pop() || "image").replace(/\.[^.]*$/, "");
    const name = stem.replace(/[^\w-]+/g, "-").slice(0, 60) || "image";
    const form = new FormData();
    form.append("path", "attachments/" + home + "/" + day + "/" + name + "." + TYPES[got.type]);
    form.append("file", new Blob([got.bytes], {type: got.type}), name);
    return (await call(conn, "POST", "/attachments", form)).path;
  }

  async function images(conn, srcs) {
    const out = [];
    let inline = 0;
    for (const src of srcs.slice(0, MAX_IMAGES)) {
      const got = await image(src);
      if (!got) continue; // it stays a link to where it is
      const data = base64(got.bytes);
      if (inline + data.length > INLINE_BUDGET) {
        out.push({src, path: await uploadFirst(conn, src, got)});
        continue;
      }
      inline += data.length;
      out.push({src, data, type: got.type});
    }
    return out;
  }

  async function needed() {
    const conn = await connection();
    if (!conn) throw new Error("Connect the clipper to your server first (its toolbar button).");
    return conn;
  }

  // Clip page or Clip selection of a tab. options: {folder, fresh}
  async function clipTab(tab, mode, options) {
    const conn = await needed();
    const [done] = await api.scripting.executeScript({
      target: {tabId: tab.id},
      func: readPage,
      args: [mode],
    });
    const page = done.result;
    const body = {url: page.url, title: page.title};
    if (mode === "selection") {
      if (!page.selection) throw new Error("Select some of the page first.");
      body.selection = page.selection;
    } else {
      body.html = page.html;
    }
    if (options && options.folder) body.folder = options.folder;
    if (options && options.fresh) body.new = true;
    body.images = await images(conn, page.images);
    return call(conn, "POST", "/capture/clip", body);
  }

  function escape(text) {
    return text.replace(
      /[&<>"]/g,
      (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"})[c],
    );
  }

  // Save link: a note of the link (the server never opens it), saying where it was found.
  async function saveLink(tab, url, text) {
    const conn = await needed();
    const label = escape(text || url);
    const from = tab
      ? '<p>Found on <a href="' + escape(tab.url) + '">' + escape(tab.title || tab.url) + "</a></p>"
      : "";
    const html = '<p><a href="' + escape(url) + '">' + label + "</a></p>" + from;
    return call(conn, "POST", "/capture/clip", {url, title: text || url, html});
  }

  // Save image: the image itself (fetched by this browser), in a note of its own.
  async function saveImage(tab, src) {
    const conn = await needed();
    const from = tab
      ? '<p>From <a href="' + escape(tab.url) + '">' + escape(tab.title || tab.url) + "</a></p>"
      : "";
    const html = '<p><img src="' + escape(src) + '" alt=""></p>' + from;
    const title = "Image from " + (tab ? tab.title || tab.url : src);
    const body = {url: src, title, html, images: await images(conn, [src])};
    return call(conn, "POST", "/capture/clip", body);
  }

  return {api, connection, connect, forget, clipTab, saveLink, saveImage};
})();
