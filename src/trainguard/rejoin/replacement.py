"""``python -m trainguard.rejoin.replacement [--spare ID] SCRIPT [ARG...]``: run a training script
as the replacement of a lost rank (the launcher starts it; see :mod:`trainguard.launcher.replace`).

The script runs as ``python SCRIPT ARG...`` would run it, with these differences:

* a ``DistributedDataParallel`` constructed without an explicit ``init_sync`` skips its initial
  parameter broadcast from rank 0: the survivors do not take part in a constructor's collectives
  (they are past theirs), and the Guard transfers the model from them anyway;
* ``--spare ID`` (a warm spare, started before any failure): the script runs up to its
  ``torch.distributed.init_process_group`` call and waits there until the launcher assigns it a
  rank; it then takes that rank's environment (``RANK``, ``LOCAL_RANK``, the generation's store, ...)
  and goes on. Imports and everything the script does before ``init_process_group`` are done in
  advance, so that code must not depend on the rank;
* in ``init_process_group`` a process that joins a generation says it is ready first: the ranks
  of a group that grows (a spare, a node that arrives) meet it only once it has started.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from pathlib import Path
from typing import Optional

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..launch_env import LaunchEnv
from ..outcomes import BadInput
from .protocol import RecoveryStore, connect, parse_address, spare_store_from_environ, wait_for_assignment


def skip_initial_broadcast() -> None:
    """Make ``DistributedDataParallel(...)`` default to ``init_sync=False`` in this process."""
    original = DistributedDataParallel.__init__

    @functools.wraps(original)
    def init(self, *args, init_sync: bool = False, **kwargs):  # type: ignore[no-untyped-def]
        original(self, *args, init_sync=init_sync, **kwargs)

    DistributedDataParallel.__init__ = init  # type: ignore[method-assign]


def join_at_init(spare_id: Optional[int]) -> None:
    """Wrap this process's first ``init_process_group`` call: a warm spare (``spare_id``) waits
    there for the launcher's assignment and takes the assigned rank's environment first; then a
    process that joins a generation (``TRAINGUARD_JOIN``) says it is ready
    (:meth:`~.protocol.RecoveryStore.ready`): the ranks of a group that grows meet it only then."""
    original = dist.init_process_group
    spares = spare_store_from_environ() if spare_id is not None else None

    @functools.wraps(original)
    def init(*args, **kwargs):  # type: ignore[no-untyped-def]
        if spares is not None:
            os.environ.update(wait_for_assignment(spares, spare_id))
        launch = LaunchEnv.from_environ()
        if launch.join is not None and launch.recovery_store:
            store = RecoveryStore(connect(*parse_address(launch.recovery_store)), launch.recovery_group)
            store.ready(launch.join, int(os.environ["RANK"]))
        dist.init_process_group = original
        return original(*args, **kwargs)

    dist.init_process_group = init


def main(argv: list[str]) -> None:
    """Run ``argv[0]`` (the script) as ``__main__`` with ``sys.argv = argv``.

    Raises:
        BadInput: no script (the usage line is printed first; exit code 2); whatever the script raises.
    """
    spare: Optional[int] = None
    if argv[:1] == ["--spare"]:
        if len(argv) < 3 or not argv[1].isdigit():
            argv = []
        else:
            spare, argv = int(argv[1]), argv[2:]
    if argv:
        join_at_init(spare)
    if not argv:
        print("usage: python -m trainguard.rejoin.replacement [--spare ID] SCRIPT [ARG...]", file=sys.stderr)
        raise BadInput("no script given")
    skip_initial_broadcast()
    # imported lazily otherwise, after the spare was assigned: the rank-side stack, and torch._dynamo,
    # which DistributedDataParallel's constructor imports (0.7 s on this machine)
    import torch._dynamo  # noqa: F401

    import trainguard.guard  # noqa: F401

    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
