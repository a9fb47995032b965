"use strict";
// notesvc's service worker (served at ./sw.js beside the page; only where the person turned
// "Keep notes on this device" on, in a secure context). It keeps the app itself for offline
// starts, and takes what the share sheet sends: the notes and the outbox live in IndexedDB,
// where the page reads and writes them; this worker only adds shared items to the outbox.

const APP = "notesvc-app";
const SHELL = [
  "./", "manifest.webmanifest", "icon.svg", "icon-192.png", "icon-512.png", "record.js",
];

self.addEventListener("install", (event) => {
  event.waitUntil(caches.open(APP).then((cache) => cache.addAll(SHELL)));
  self.skipWaiting();
});

self.addEventListener("activate", (event) => event.waitUntil(self.clients.claim()));

self.addEventListener("fetch", (event) => {
  const url = new URL(event.request.url);
  if (url.origin !== self.location.origin) return;
  const here = new URL("./", self.registration.scope).pathname;
  if (event.request.method === "POST" && url.pathname === here + "share-target") {
    event.respondWith(shared(event.request));
    return;
  }
  const shell = SHELL.map((p) => new URL(p, self.registration.scope).pathname);
  if (event.request.method !== "GET" || !shell.includes(url.pathname)) return; // the API
  // the app: the network's when it answers (kept for next time), else the kept copy (also
  // when a relay answers for a server it cannot reach: 502, 503, 504)
  const kept = (answer) =>
    caches.match(event.request, {ignoreSearch: true}).then((k) => k || answer || Response.error());
  event.respondWith(
    fetch(event.request)
      .then((answer) => {
        if (answer.ok) {
          const copy = answer.clone();
          caches.open(APP).then((cache) => cache.put(event.request, copy));
          return answer;
        }
        return answer.status >= 502 && answer.status <= 504 ? kept(answer) : answer;
      })
      .catch(() => kept(null)),
  );
});

// What one share may keep on this device: the server's own limit refuses larger files later.
const MAX_FILES = 10;
const MAX_BYTES = 100 * 1024 * 1024;

// The share sheet's POST: text, a link and images, kept in the outbox for the page to send
// to today's note once the person has said yes there (any web page can post a form to this
// address: nothing it sends goes anywhere unseen).
async function shared(request) {
  const form = await request.formData();
  const text = ["title", "text", "url"]
    .map((name) => String(form.get(name) || "").trim())
    .filter((value, i, all) => value && all.indexOf(value) === i)
    .join(" ");
  let room = MAX_BYTES;
  const given = form.getAll("image").filter((f) => f && f.size);
  const files = given
    .filter((f) => f.size <= room && (room -= f.size) >= 0) // (one too large: the rest may go)
    .slice(0, MAX_FILES);
  const dropped = given.length - files.length;
  const db = await openBox();
  await new Promise((resolve, reject) => {
    const tx = db.transaction("meta", "readwrite");
    const store = tx.objectStore("meta");
    const read = store.get("outbox");
    read.onsuccess = () => {
      const items = read.result || [];
      const id = () => (self.crypto.randomUUID ? self.crypto.randomUUID() : String(Math.random()));
      items.push({
        id: id(),
        kind: "capture",
        key: id(),
        text,
        files,
        dropped,
        at: Date.now(),
        ask: true,
      });
      store.put(items, "outbox");
    };
    tx.oncomplete = resolve;
    tx.onerror = () => reject(tx.error);
  });
  db.close();
  return Response.redirect(new URL("./?shared=1", self.registration.scope).href, 303);
}

function openBox() {
  return new Promise((resolve, reject) => {
    const open = indexedDB.open("notesvc", 1);
    open.onupgradeneeded = () => {
      open.result.createObjectStore("notes", {keyPath: "path"});
      open.result.createObjectStore("meta");
    };
    open.onsuccess = () => resolve(open.result);
    open.onerror = () => reject(open.error);
  });
}
