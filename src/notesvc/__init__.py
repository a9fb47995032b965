"""notesvc as a package: the modules that .ci/build.py writes into the one file notesvc.py.

Every name a module defines is a name of this package too (`notesvc.create_app`,
`notesvc.Plugin`, `notesvc.channel_sender`, ...), as in notesvc.py, so plugins and embedders
write `import notesvc` whichever form runs. docs/contributing.md says what lives where.
"""

from __future__ import annotations

import importlib

from notesvc.boot import __version__

# The build's order, the order the data flows: each module uses only the ones before it
# (`.ci/build.py` refuses anything else). notesvc.py holds them in this order.
MODULES = (
    "boot",
    "settings",
    "errors",
    "helpers",
    "notes.paths",
    "notes.merge",
    "notes.history",
    "notes.trash",
    "notes.store",
    "notes.tasks",
    "search.text",
    "search.segments",
    "search.persistence",
    "search.helper",
    "search.masks",
    "search.index",
    "search.vectors",
    "search.hybrid",
    "auth",
    "oauth",
    "grants",
    "people",
    "service",
    "providers.base",
    "providers.agent",
    "providers.capture",
    "providers.channels",
    "providers.polling",
    "providers.reminders",
    "providers.embed",
    "providers.reader",
    "plugins",
    "suggestions",
    "tools",
    "mcp_resources",
    "webclip",
    "transfer.plan",
    "transfer.formats",
    "transfer.export",
    "passthrough.wire",
    "passthrough.dns",
    "passthrough.acme",
    "passthrough.front",
    "passthrough.server",
    "audit",
    "web",
    "relay",
    "relay_client",
    "http.route",
    "http.api",
    "http.access",
    "http.mcp_sessions",
    "http.mcp",
    "http.integrations",
    "http.dav",
    "http.caldav",
    "http.feed",
    "http.people",
    "http.capture",
    "http.openapi",
    "http.routes",
    "http.app",
    "cli",
)

for _name in MODULES:
    _module = importlib.import_module(f"notesvc.{_name}")
    globals().update({k: v for k, v in vars(_module).items() if not k.startswith("__")})
del _name, _module


def __getattr__(name: str):
    # `notesvc.app`: built on first use, so importing the package touches no files.
    if name == "app":
        from notesvc.http.app import create_app

        globals()["app"] = create_app()
        return globals()["app"]
    raise AttributeError(name)


__all__ = ["__version__"]
