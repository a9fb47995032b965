"use strict";
// node --test web/test/: the Markdown renderer (web/markdown.js) on a tiny stand-in DOM.
// It builds nodes, never HTML: whatever a note holds, the page gets elements and text.
const test = require("node:test");
const assert = require("node:assert/strict");

class Node {
  constructor(tag, text) {
    this.tagName = tag;
    this.text = text;
    this.attrs = {};
    this.children = [];
    this.className = "";
    this.listeners = {};
  }
  setAttribute(k, v) {
    this.attrs[k] = String(v);
  }
  getAttribute(k) {
    return k in this.attrs ? this.attrs[k] : null;
  }
  appendChild(c) {
    this.children.push(c);
    return c;
  }
  append(...cs) {
    for (const c of cs) this.appendChild(typeof c === "string" ? new Node("#text", c) : c);
  }
  addEventListener(name, fn) {
    this.listeners[name] = fn;
  }
}
global.document = {
  createElement: (tag) => new Node(tag),
  createTextNode: (text) => new Node("#text", text),
};
// Each page brings its own link(), wikiLink() and image() (in the ctx it renders with):
// these record what was asked.
const link = (href, label) => {
  const a = new Node("a");
  a.setAttribute("href", href);
  a.appendChild(new Node("#text", label));
  return a;
};
const wikiLink = (target, label, ctx, embed) => {
  const a = new Node(embed ? "embed" : "wiki");
  a.setAttribute("target", target);
  a.appendChild(new Node("#text", label || target));
  return a;
};
const image = (alt, src) => {
  const img = new Node("img");
  img.setAttribute("alt", alt);
  img.setAttribute("src", src);
  return img;
};

const {renderMarkdown, resolveRelative} = require("../markdown.js");

// A compact picture of a tree: tag(children) and "text"; attributes that matter in [].
function show(node) {
  if (node.tagName === "#text") return JSON.stringify(node.text);
  const keep = ["href", "src", "alt", "target", "type"].filter((k) => k in node.attrs);
  const attrs = keep.length ? "[" + keep.map((k) => k + "=" + node.attrs[k]).join(" ") + "]" : "";
  const cls = node.className ? "." + node.className.replace(/ /g, ".") : "";
  return node.tagName + cls + attrs + "(" + node.children.map(show).join(" ") + ")";
}
const hooks = {link, wikiLink, image};
const md = (text, ctx) =>
  renderMarkdown(text, {...hooks, ...ctx})
    .children.map(show)
    .join(" ");

test("blocks: headings, paragraphs, rules, quotes, code", () => {
  for (const [text, want] of [
    ["# Title", 'h1("Title")'],
    ["###### six ##", 'h6("six")'],
    ["one\ntwo", 'p("one" br() "two")'],
    ["---", "hr()"],
    ["> said", 'blockquote(p("said"))'],
    ["```js\nlet a = 1;\n```", 'pre(code.lang-js("let a = 1;"))'],
  ]) {
    assert.equal(md(text), want, text);
  }
});

test("HTML in a note stays text", () => {
  for (const text of ["<script>alert(1)</script>", "<img src=x onerror=alert(1)>"]) {
    assert.equal(md(text), "p(" + JSON.stringify(text) + ")");
  }
});

test("inline: strong, emphasis, code, strike-through, highlight, escapes", () => {
  assert.equal(
    md("**b** *i* `c` ~~s~~ ==h== \\*not\\* snake_case_word"),
    'p(strong("b") " " em("i") " " code("c") " " del("s") " " mark("h") " " "*" "not" "*"' +
      ' " snake_case_word")',
  );
});

test("links, wikilinks, embeds and images go through the page's own functions", () => {
  assert.equal(
    md("[a](../b.md) [[Pie|the pie]] ![[photo.png]] ![alt](x.png) https://e.example/x."),
    'p(a[href=../b.md]("a") " " wiki[target=Pie]("the pie") " " embed[target=photo.png]' +
      '("photo.png") " " img[src=x.png alt=alt]() " " a[href=https://e.example/x]' +
      '("https://e.example/x") ".")',
  );
});

test("lists and tasks: each box knows its line", () => {
  const ticked = [];
  const root = renderMarkdown("- [ ] one\n- [x] two\n1. first", {onTask: (n) => ticked.push(n)});
  assert.equal(root.children.map(show).join(" "), md("- [ ] one\n- [x] two\n1. first"));
  // the box and its text are one label: a tap on the words ticks it
  assert.equal(
    md("- [ ] one *two*\n  three"),
    'ul(li.task(label(input[type=checkbox]() span("one " em("two") br() "three"))))',
  );
  const boxes = [];
  const walk = (n) => {
    if (n.tagName === "input") boxes.push(n);
    (n.children || []).forEach(walk);
  };
  walk(root);
  assert.deepEqual(
    boxes.map((b) => [b.checked, b.disabled, b.attrs["data-line"]]),
    [
      [false, false, "0"],
      [true, false, "1"],
    ],
  );
  boxes[1].listeners.change();
  assert.deepEqual(ticked, [1]);
  // a task is one line: an unindented line after it is a paragraph, not part of the
  // (ticked, greyed) item; an indented one stays with it, and a plain item goes on lazily
  assert.equal(
    md("- [x] passport\nDone."),
    'ul(li.task(label(input[type=checkbox]() span("passport")))) p("Done.")',
  );
  assert.equal(
    md("- [x] passport\n\nDone."),
    'ul(li.task(label(input[type=checkbox]() span("passport")))) p("Done.")',
  );
  assert.equal(md("- milk\nand eggs"), 'ul(li("milk" br() "and eggs"))');
  // without a handler (the share page) the boxes are read-only
  const shown = renderMarkdown("- [x] done", {});
  walk(shown);
  assert.equal(boxes[2].disabled, true);
});

test("ctx.lines: each block and list item names the source lines it was drawn from", () => {
  const text = "---\na: 1\n---\n# T\n\none\ntwo\n\n- [ ] x\n  more\n- y\n\n> q\n\n```\nc\n```";
  const spans = [];
  const walk = (n) => {
    if (n.attrs && "data-end" in n.attrs)
      spans.push(n.tagName + " " + n.attrs["data-line"] + "-" + n.attrs["data-end"]);
    (n.children || []).forEach(walk);
  };
  walk(renderMarkdown(text, {...hooks, lines: true}));
  assert.deepEqual(spans, ["h1 3-3", "p 5-6", "li 8-9", "li 10-10", "p 12-12", "pre 14-16"]);
  walk(renderMarkdown(text, hooks)); // without it (the share page): nothing added
  assert.equal(spans.length, 6);
});

test("tables keep their alignment", () => {
  assert.equal(
    md("| a | b | c |\n|:--|--:|:-:|\n| 1 | 2 |"),
    'div.table(table(thead(tr(th("a") th.al-r("b") th.al-c("c"))) ' +
      'tbody(tr(td("1") td.al-r("2") td.al-c()))))',
  );
});

test("front matter is shown as it is", () => {
  assert.equal(md("---\ntags: [a]\n---\n# T"), 'pre.front("tags: [a]") h1("T")');
});

test("resolveRelative: where a relative link points, never outside notes/ or attachments/", () => {
  for (const [href, from, want] of [
    ["b.md", "notes/a/x.md", "notes/a/b.md"],
    ["../kitchen/pie.md#top", "notes/home/keys.md", "notes/kitchen/pie.md"],
    ["../../attachments/p.png", "notes/a/x.md", "attachments/p.png"],
    ["/notes/z.md", "notes/a/x.md", "notes/z.md"],
    ["%2e%2e/%2e%2e/etc/passwd", "notes/x.md", null],
    ["../../../x.md", "notes/x.md", null],
    ["", "notes/x.md", null],
  ]) {
    assert.equal(resolveRelative(href, from), want, href);
  }
});
