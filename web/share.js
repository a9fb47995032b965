// The link is {base}/s/<token>; the note comes from {base}/api/v1/shared/<token>. The
// web client's renderer (MARKDOWN_JS) draws it; what a link or an image may reach is
// decided here: pages on the web, and the attachments this note links, nothing else.
// No name of its own: it draws the note as the page loads.
(() => {
  const {el} = markdown;
  const found = location.pathname.match(/^(.*)\/s\/([A-Za-z0-9_-]{1,64})\/?$/);
  const shared = found ? found[1] + "/api/v1/shared/" + found[2] : "";
  let linked = {}; // the note's href as written -> the attachment it names (the server's)

  function attachmentOf(src) {
    const path = Object.prototype.hasOwnProperty.call(linked, src) ? linked[src] : "";
    if (typeof path !== "string" || !/^attachments\//.test(path)) return "";
    return shared + "/attachments/" + path.split("/").map(encodeURIComponent).join("/");
  }

  function link(href, label, ctx, rich) {
    href = href.trim();
    const a = /^(https?:|mailto:)/i.test(href)
      ? el("a", {href, target: "_blank", rel: "noopener noreferrer nofollow"})
      : el("span"); // another note of the owner's: not shared, so the text alone
    if (rich) markdown.inline(label, a, ctx);
    else a.textContent = label;
    return a;
  }

  function wikiLink(target, label, ctx, embed) {
    return el("span", {}, (label || target).trim());
  }

  function image(alt, src, ctx) {
    const url = attachmentOf(src.trim());
    if (!url) return document.createTextNode(alt ? "[image: " + alt + "]" : "[image]");
    return el("img", {src: url, alt: alt || "", loading: "lazy", referrerpolicy: "no-referrer"});
  }

  async function showShared() {
    const say = (text) => {
      document.getElementById("msg").textContent = text;
    };
    if (!shared) return say("This link is not valid.");
    let r;
    let j = null;
    try {
      r = await fetch(shared, {mode: "same-origin", credentials: "omit"});
      j = await r.json();
    } catch (e) {
      return say("The notes server cannot be reached right now.");
    }
    if (r.status === 429) return say("Too many requests: try again in a minute.");
    if (!r.ok || !j || !j.success) {
      return say("Nothing is shared at this link: it may have expired or been revoked.");
    }
    document.title = j.data.title;
    linked = j.data.attachments || {};
    document
      .getElementById("note")
      .replaceChildren(markdown.renderMarkdown(j.data.content, {link, wikiLink, image}));
    document.getElementById("meta").textContent =
      "Shared read-only · last changed " + new Date(j.data.modified).toLocaleString();
    return undefined;
  }
  showShared();
})();
