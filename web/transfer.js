// -- bring notes in, take them all out (docs/api.md: Import) --------------------------------------
// Import: choose a file, see what the server would do (a dry run), then say yes. Export: a
// zip of every note and file this key sees, downloaded with its progress shown.
// No name of its own: nothing else calls it (it wires its menu items itself).

(() => {
  const {$, state} = core;
  const {el} = markdown;
  const IMPORT_TYPES = ".zip,.enex,.jex,.json,.md,.txt";

  function mb(bytes) {
    return (bytes / 1048576).toFixed(bytes < 10485760 ? 1 : 0) + " MB";
  }

  // POST the file to /import (multipart), reporting the upload's progress; resolves the
  // report, rejects with a Problem as api() does.
  function sendImport(file, into, dryRun, progress) {
    const url = state.base + "/import";
    if (!state.base || !core.ownOrigin(url) || (state.key && state.keyBase !== state.base)) {
      return Promise.reject(new core.Problem(0, "REFUSED", "Refused: the API is not this page's."));
    }
    const form = new FormData();
    form.append("dryRun", dryRun ? "true" : "false");
    if (into) form.append("into", into);
    form.append("file", file, file.name);
    return new Promise((resolve, reject) => {
      const x = new XMLHttpRequest();
      x.open("POST", url);
      x.setRequestHeader("X-Service-Key", state.key);
      x.upload.onprogress = (e) => {
        if (e.lengthComputable) progress(e.loaded, e.total);
      };
      x.upload.onload = () => progress(-1, file.size);
      x.onerror = () => reject(new core.Problem(0, "NETWORK", "Cannot reach the server."));
      x.onload = () => {
        let j = null;
        try {
          j = JSON.parse(x.responseText);
        } catch (e) {
          /* not JSON */
        }
        if (x.status < 300 && j && j.success) return resolve(j.data);
        const err = (j && j.error) || {code: "HTTP_" + x.status, message: "HTTP " + x.status};
        reject(new core.Problem(x.status, err.code, err.message));
      };
      x.send(form);
    });
  }

  // A file over what this address takes: say where a larger one goes.
  function tooLarge(e) {
    if (!(e instanceof core.Problem) || e.status !== 413) return e;
    const hint =
      " A larger file goes in on the server's own address (at home), or on the server with: " +
      "python3 notesvc.py import FILE";
    return new core.Problem(413, e.code, e.message + hint);
  }

  function importSummary(r) {
    const verb = r.dryRun ? "Would bring in " : "Brought in ";
    const lines = [
      el(
        "p",
        {id: "import-summary"},
        verb +
          core.counted(r.created, "note") +
          " and " +
          core.counted(r.attachments, "file") +
          " into " +
          r.into +
          ".",
      ),
    ];
    if (r.renamed) {
      const get = r.renamed === 1 ? " gets" : " get";
      lines.push(
        el("p", {}, r.renamed + get + " a free name (“ 2”): nothing is ever overwritten."),
      );
    }
    if (r.skipped.length) {
      const list = el("ul", {id: "import-skipped", class: "skipped"});
      for (const s of r.skipped.slice(0, 20)) list.append(el("li", {}, s.source + ": " + s.reason));
      if (r.skipped.length > 20)
        list.append(el("li", {}, "… and " + (r.skipped.length - 20) + " more"));
      lines.push(el("p", {}, r.skipped.length + " left out:"), list);
    }
    return lines;
  }

  async function showImport() {
    const input = el("input", {type: "file", id: "import-file", accept: IMPORT_TYPES});
    const home = state.person ? state.person.home : "notes"; // a person's go to their home
    const into = el("input", {type: "text", id: "import-into", placeholder: home + "/imported/…"});
    const body = [
      el(
        "p",
        {},
        "From Google Keep (a Takeout zip), Evernote (.enex), Notion (the export zip), Obsidian " +
          "(the vault as a zip), Joplin (.jex), or any zip of Markdown. You see what would " +
          "happen before anything is written.",
      ),
      el("label", {for: "import-file"}, "File"),
      input,
      el("label", {for: "import-into"}, "Into folder (optional)"),
      into,
    ];
    for (;;) {
      const go = await app.dialog("Import notes", body, [
        ["cancel", "Cancel"],
        ["check", "Check", "primary"],
      ]);
      if (go !== "check") return;
      const file = input.files && input.files[0];
      if (!file) {
        devices.dialogProblem(body, "Choose a file first.");
        continue;
      }
      const folder = into.value.trim();
      let report;
      const status = el(
        "p",
        {id: "import-progress", role: "status"},
        "Checking " + file.name + "…",
      );
      app.dialog("Import notes", [status], [["cancel", "Cancel"]]);
      try {
        report = await sendImport(file, folder, true, (sent, total) => {
          status.textContent =
            sent < 0 ? "Reading the archive…" : "Sending " + mb(sent) + " of " + mb(total) + "…";
        });
      } catch (e) {
        devices.dialogProblem(body, tooLarge(e));
        continue;
      }
      const yes = await app.dialog("Import notes", importSummary(report), [
        ["cancel", "Cancel"],
        ["import", "Import " + core.counted(report.created, "note"), "primary"],
      ]);
      if (yes !== "import") return;
      const doing = el("p", {id: "import-progress", role: "status"}, "Sending…");
      app.dialog("Importing…", [doing], [["cancel", "Hide"]]);
      let done;
      try {
        done = await sendImport(file, folder, false, (sent, total) => {
          doing.textContent =
            sent < 0
              ? "Writing the notes…"
              : "Sending " +
                mb(sent) +
                " of " +
                mb(total) +
                " (" +
                Math.round((100 * sent) / total) +
                " %)…";
        });
      } catch (e) {
        await app.dialog(
          "Import notes",
          [el("p", {class: "err", role: "alert"}, tooLarge(e).message)],
          [["ok", "OK"]],
        );
        return;
      }
      await core.loadTree();
      await app.dialog("Imported", importSummary(done), [["ok", "OK", "primary"]]);
      return;
    }
  }

  async function exportAll() {
    const status = el("p", {id: "export-progress", role: "status"}, "Preparing the zip…");
    app.dialog("Export all notes", [status], [["cancel", "Hide"]]);
    const got = await core.api("GET", "/export.zip", undefined, undefined, {
      blob: true,
      progress: (n) => (status.textContent = "Downloading… " + mb(n)),
    });
    const a = el("a", {
      href: URL.createObjectURL(got.blob),
      download: "notesvc-export-" + new Date().toISOString().slice(0, 10) + ".zip",
    });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 60000);
    status.textContent = "Saved " + mb(got.blob.size) + ": every note, picture and file, as a zip.";
  }

  function wireTransfer() {
    $("menu-import").addEventListener("click", core.act(showImport));
    $("menu-export").addEventListener("click", core.act(exportAll));
  }
  wireTransfer();
})();
