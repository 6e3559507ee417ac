"""``python -m trainguard.rejoin.replacement SCRIPT [ARG...]``: run a training script as the
replacement of a lost rank (the launcher starts it; see :mod:`trainguard.launcher.replace`).

The script runs as ``python SCRIPT ARG...`` would run it, with one difference: a
``DistributedDataParallel`` constructed without an explicit ``init_sync`` skips its initial
parameter broadcast from rank 0. The survivors do not take part in a constructor's collectives
(they are past theirs), and the Guard transfers the model from them anyway.
"""

from __future__ import annotations

import functools
import runpy
import sys
from pathlib import Path

from torch.nn.parallel import DistributedDataParallel


def skip_initial_broadcast() -> None:
    """Make ``DistributedDataParallel(...)`` default to ``init_sync=False`` in this process."""
    original = DistributedDataParallel.__init__

    @functools.wraps(original)
    def init(self, *args, init_sync: bool = False, **kwargs):  # type: ignore[no-untyped-def]
        original(self, *args, init_sync=init_sync, **kwargs)

    DistributedDataParallel.__init__ = init  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    """Run ``argv[0]`` (the script) as ``__main__`` with ``sys.argv = argv``.

    Raises:
        SystemExit: 2 without a script (usage); whatever the script raises.
    """
    if not argv:
        print("usage: python -m trainguard.rejoin.replacement SCRIPT [ARG...]", file=sys.stderr)
        raise SystemExit(2)
    skip_initial_broadcast()
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
