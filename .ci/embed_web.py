"""Write the browser pages' sources (web/) into notesvc.py, or check that they are there.

    python .ci/embed_web.py           # after editing anything under web/
    python .ci/embed_web.py --check   # CI: exit 1, naming each file, when they differ

notesvc.py ships as one file: each source sits in it as a plain string constant between
two marker lines, `# --- begin web/<file> ---` and `# --- end web/<file> ---`. Nothing at
run time knows web/ exists. Standard library only.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
TARGET = HERE / "notesvc.py"

# file under web/ -> the constant notesvc.py reads it as
SOURCES = {
    "app.html": "WEB_PAGE",
    "app.css": "WEB_CSS",
    "core.js": "WEB_JS_START",
    "paths.js": "PATHS_JS",
    "keys.js": "KEYS_JS",
    "markdown.js": "MARKDOWN_JS",
    "order.js": "ORDER_JS",
    "autosave.js": "AUTOSAVE_JS",
    "drafts.js": "DRAFTS_JS",
    "app.js": "WEB_JS_REST",
    "grants.js": "WEB_GRANTS_JS",
    "devices.js": "WEB_DEVICES_JS",
    "transfer.js": "WEB_TRANSFER_JS",
    "merge.js": "MERGE_JS",
    "outbox.js": "OUTBOX_JS",
    "offline.js": "WEB_OFFLINE_JS",
    "sw.js": "SW_JS",
    "page.css": "PAGE_CSS",
    "share.html": "SHARE_PAGE",
    "share.js": "SHARE_JS",
    "consent.html": "CONSENT_PAGE",
    "consent.js": "CONSENT_JS",
    "landing.html": "RELAY_LANDING_HTML",
}


def block(name: str, constant: str, text: str) -> str:
    """Return the marker block that carries web/<name> as constant."""
    if '"""' in text or text.endswith("\\"):
        raise SystemExit(f'web/{name}: cannot hold """ or end with a backslash')
    # the text starts on the line after the opening quotes (the [1:] drops that newline),
    # so no line of notesvc.py is longer than the file's own
    begin, end = f"# --- begin web/{name} ---\n", f"# --- end web/{name} ---\n"
    return f'{begin}{constant} = r"""\n{text}"""[1:]\n{end}'


def embed(source: str) -> tuple:
    """Return (notesvc.py with every block written anew, names of the blocks that changed)."""
    changed = []
    for name, constant in SOURCES.items():
        begin, end = f"# --- begin web/{name} ---\n", f"# --- end web/{name} ---\n"
        start = source.find(begin)
        stop = source.find(end, start)
        if start < 0 or stop < 0:
            raise SystemExit(f"notesvc.py has no marker lines for web/{name}")
        text = (HERE / "web" / name).read_text(encoding="utf-8")
        new = block(name, constant, text)
        old = source[start : stop + len(end)]
        if new != old:
            changed.append(f"web/{name}")
            source = source[:start] + new + source[stop + len(end) :]
    return source, changed


def main(argv: list) -> int:
    source = TARGET.read_text(encoding="utf-8")
    updated, changed = embed(source)
    if "--check" in argv:
        for name in changed:
            print(f"{name} differs from notesvc.py: run python .ci/embed_web.py", file=sys.stderr)
        return 1 if changed else 0
    if changed:
        TARGET.write_text(updated, encoding="utf-8")
        print("embedded: " + ", ".join(changed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
