"""Run a test's attacker script as another, unprivileged user of this node.

``run_as.py USER SCRIPT ARGS...`` loads ``SCRIPT`` as a module (its imports, torch included,
load now, as root), then drops to ``USER``'s uid and gid and calls the module's
``run([SCRIPT, *ARGS])``. A plain ``su USER -c python ...`` cannot be used where the project's
virtual environment lies under a directory that only root may enter (CI checks out under such
a directory): the other user could not even start the interpreter. What the attack tests need
is a process whose uid is another user's when it connects or opens files, which this gives.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import sys


def main(argv: list[str]) -> int:
    import encodings.idna  # noqa: F401 (socket's lookups load it lazily; the interpreter's files may be root's alone)

    user, script, *args = argv[1:]
    spec = importlib.util.spec_from_file_location("attacker", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    entry = pwd.getpwnam(user)
    os.chdir("/")
    os.setgroups([])
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)
    return module.run([script, *args])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
