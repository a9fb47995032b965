"""notesvc: a self-hosted notes server with an HTTP JSON API, in one file.

Run it:   python notesvc.py            (serves ./data on http://0.0.0.0:3000)
Help:     python notesvc.py --help
Embed:    notesvc.create_app(load_config(...)) is a WSGI application.

This file is written by .ci/build.py from the modules in src/notesvc/ (one `# ==
src/notesvc/<module>.py` line starts each) and the pages in web/; docs/contributing.md says
what lives where, and `python .ci/build.py --where LINE` maps a line here to its source.
The build ends this docstring with the outline: the modules, each with its summary.
"""

from __future__ import annotations

__version__ = "0.3.0"

# `python notesvc.py` runs this file as __main__, and CPython keeps a __main__ script's
# whole syntax tree in memory for as long as the script runs: about 30 MB for this file,
# a tenth of a Pi Zero's free memory. So the script hands over at once (exec: the same
# process id, the same open files, the same interpreter options) to an interpreter that
# imports this file as the module `notesvc`, from its cached bytecode when it can (a
# faster start too), and runs main() there. It hands over before the imports below: the
# script's interpreter would import them for nothing (0.1 s of CPU of every start here).
_MAIN_CODE = (
    "import importlib.util as u, os, sys; f = sys.argv[1]; "
    "sys.path[:1] = [os.path.dirname(f)] if sys.path[:1] == [''] else sys.path[:1]; "
    "s = u.spec_from_file_location('notesvc', f); m = sys.modules['notesvc'] = "
    "u.module_from_spec(s); sys.argv = sys.argv[1:]; s.loader.exec_module(m); sys.exit(m.main())"
)


def interpreter_options() -> list:
    """Return the command-line options this interpreter runs with (-I, -E, -s, -S, -P,
    -B, -O, -u, -W and -X), for the interpreter that takes over from the script."""
    import sys

    flags, out = sys.flags, []
    if flags.isolated:
        out.append("-I")
    else:
        out += ["-E"] * bool(flags.ignore_environment) + ["-s"] * bool(flags.no_user_site)
        out += ["-P"] * bool(getattr(flags, "safe_path", False))
    out += ["-S"] * bool(flags.no_site)
    out += ["-B"] * bool(flags.dont_write_bytecode) + ["-O"] * flags.optimize
    out += ["-u"] * bool(getattr(sys.stdout, "write_through", False))
    out += [f"-W{w}" for w in sys.warnoptions]
    out += [f"-X{k}" if v is True else f"-X{k}={v}" for k, v in sys._xoptions.items()]
    return out


# glibc gives each thread that allocates its own malloc arena (up to 8 per core), and each
# arena keeps its own high-water mark of freed memory: waitress's 8 threads searching a
# 100k-note index grew RssAnon from 56 to 102 MB in 2,000 queries, against 64 MB, flat
# through 4,000, with one arena. The GIL serialises nearly every allocation anyway. The
# interpreter that takes over reads it at its start (a setting of the user's own stays).
MALLOC_ARENAS = "1"


def _hand_over() -> None:
    """Exec the interpreter that imports this file as `notesvc` (POSIX; elsewhere the
    script goes on as itself)."""
    import os
    import sys

    if os.name == "posix" and sys.executable:
        sys.stdout.flush()
        here = os.path.abspath(__file__)
        options = interpreter_options()
        os.environ.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENAS)
        argv = [sys.executable, *options, "-c", _MAIN_CODE, here, *sys.argv[1:]]
        os.execv(sys.executable, argv)  # noqa: S606 - this interpreter, this file


if __name__ == "__main__":
    _hand_over()

import logging
import sys

try:
    import bottle  # noqa: F401 - the modules import it from here
except ImportError:  # `python3 notesvc.py` on a machine without bottle: one line, no traceback
    if __name__ != "__main__" and sys.argv[:1] != [globals().get("__file__")]:
        raise  # imported (tests, plugins), not run as the program
    print(
        "notesvc: error: the bottle package is missing; install it with "
        "`sudo apt install python3-bottle python3-waitress` (Debian, Raspberry Pi OS) "
        "or `pip install bottle waitress` in a virtual environment",
        file=sys.stderr,
    )
    sys.exit(2)

try:  # file locks: POSIX only; on other systems the single-process rule is advisory
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

log = logging.getLogger("notesvc")

API = "/api/v1"
KEY_PREFIX = "nsk_"
KEY_HEADER = "X-Service-Key"
