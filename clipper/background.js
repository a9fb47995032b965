"use strict";
// The clipper's background: the context menu (Clip page, Clip selection, Save link, Save
// image). Chromium runs it as a service worker (clip.js imported here); Firefox as a
// background script after clip.js (manifest: background.scripts).
if (typeof clipper === "undefined" && typeof importScripts === "function") importScripts("clip.js");

const menus = clipper.api.contextMenus || clipper.api.menus;

clipper.api.runtime.onInstalled.addListener(() => {
  menus.removeAll(() => {
    menus.create({id: "clip-page", title: "Clip page to notesvc", contexts: ["page"]});
    menus.create({
      id: "clip-selection",
      title: "Clip selection to notesvc",
      contexts: ["selection"],
    });
    menus.create({id: "save-link", title: "Save link to notesvc", contexts: ["link"]});
    menus.create({id: "save-image", title: "Save image to notesvc", contexts: ["image"]});
  });
});

// What a menu item does; the outcome is kept (the popup shows the last one) and shown on
// the toolbar button.
async function onMenu(info, tab) {
  try {
    let made;
    if (info.menuItemId === "save-link")
      made = await clipper.saveLink(tab, info.linkUrl, info.linkText || info.selectionText);
    else if (info.menuItemId === "save-image") made = await clipper.saveImage(tab, info.srcUrl);
    else
      made = await clipper.clipTab(
        tab,
        info.menuItemId === "clip-selection" ? "selection" : "page",
        {},
      );
    await clipper.api.storage.local.set({
      last: {ok: true, path: made.path, updated: made.updated, at: Date.now()},
    });
    if (tab) clipper.api.action.setBadgeText({tabId: tab.id, text: "✓"});
    return made;
  } catch (e) {
    await clipper.api.storage.local.set({last: {ok: false, message: e.message, at: Date.now()}});
    if (tab) clipper.api.action.setBadgeText({tabId: tab.id, text: "!"});
    return null;
  }
}

menus.onClicked.addListener((info, tab) => {
  onMenu(info, tab);
});
