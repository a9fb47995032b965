"""`python -m notesvc` and the `notesvc` command: the same start as `python3 notesvc.py`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from notesvc.boot import MALLOC_ARENAS, interpreter_options

# the interpreter that takes over: the package from the folder that holds it (not a
# notesvc.py in the working folder), the arguments as given
_PACKAGE_MAIN = (
    "import sys; sys.path.insert(0, sys.argv[1]); sys.argv = sys.argv[2:]; "
    "from notesvc.cli import main; sys.exit(main())"
)


def run() -> int:
    """Hand over, as notesvc.py does, to an interpreter started under MALLOC_ARENA_MAX=1
    (the same process id, options and arguments) and run main() there; a setting of the
    user's own stays."""
    if os.name == "posix" and sys.executable and "MALLOC_ARENA_MAX" not in os.environ:
        sys.stdout.flush()
        os.environ["MALLOC_ARENA_MAX"] = MALLOC_ARENAS
        folder = str(Path(__file__).resolve().parent.parent)
        argv = [sys.executable, *interpreter_options(), "-c", _PACKAGE_MAIN, folder, *sys.argv]
        os.execv(sys.executable, argv)  # noqa: S606 - this interpreter, this package
    from notesvc.cli import main

    return main()


if __name__ == "__main__":
    sys.exit(run())
