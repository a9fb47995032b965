// -- the order of lists (pure: no page; node --test web/) -----------------------------------
// The server orders the recent list (newest first) and the tree (folders, then notes, by
// name); the copy on this device (offline) is ordered the same way here. [[Name]] and
// ![[file]] name the first of their name in path order, as the server resolves them.
const noteOrder = (() => {
  // Newest first by `modified` (ISO 8601 strings: their order is their time's); a new list.
  function newestFirst(notes) {
    return notes
      .slice()
      .sort((a, b) => (a.modified < b.modified ? 1 : a.modified > b.modified ? -1 : 0));
  }

  // A folder's listing (as GET /folders/tree?depth=1 has it) from every note path: its
  // folders (each with how many notes it holds, at any depth), then its notes, by name.
  function folderListing(all, folder) {
    const folders = new Map();
    const notes = [];
    for (const path of all) {
      if (!path.startsWith(folder + "/")) continue;
      const rest = path.slice(folder.length + 1).split("/");
      if (rest.length === 1) notes.push({type: "note", name: rest[0], path});
      else folders.set(rest[0], (folders.get(rest[0]) || 0) + 1);
    }
    const byName = (a, b) => a.name.localeCompare(b.name);
    const dirs = [...folders].map(([name, count]) => ({
      type: "folder",
      name,
      path: folder + "/" + name,
      count,
    }));
    return {children: [...dirs.sort(byName), ...notes.sort(byName)]};
  }

  // The first path (in path order) of each name: name(path), in lower case -> path.
  function firstOfEachName(all, name) {
    const first = new Map();
    for (const path of all.slice().sort()) {
      const key = name(path).toLowerCase();
      if (!first.has(key)) first.set(key, path);
    }
    return first;
  }

  return {newestFirst, folderListing, firstOfEachName};
})();

if (typeof module !== "undefined") module.exports = noteOrder;
