"""``python -m trainguard.rejoin.replacement [--spare ID] SCRIPT [ARG...]``: run a training script
as the replacement of a lost rank (the launcher starts it; see :mod:`trainguard.launcher.replace`).

The script runs as ``python SCRIPT ARG...`` would run it, with these differences:

* a ``DistributedDataParallel`` constructed without an explicit ``init_sync`` skips its initial
  parameter broadcast from rank 0: the survivors do not take part in a constructor's collectives
  (they are past theirs), and the Guard transfers the model from them anyway;
* ``--spare ID`` (a warm spare, started before any failure): the script runs up to its
  ``torch.distributed.init_process_group`` call, or to its first read of a variable that names
  the rank (:data:`RANK_VARIABLES`: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ... through
  ``os.environ`` or ``os.getenv``), whichever comes first, and waits there until the launcher
  assigns it a rank; it then takes that rank's environment (``RANK``, ``LOCAL_RANK``, the
  generation's store, ...) and goes on. Imports and everything the script does before that point
  are done in advance; whatever the script reads of its rank is the assigned rank's value (a data
  shard chosen by ``RANK``, ``torch.cuda.set_device(LOCAL_RANK)``);
* the script's own collectives complete on this process alone until the Guard has joined the
  survivors (:mod:`trainguard.rejoin.catch`): a barrier or a broadcast of a seed before the loop,
  which the survivors passed long ago, cannot pair with their recovery's collectives;
* in ``init_process_group`` a process that joins a generation says it is ready first: the ranks
  of a group that grows (a spare, a node that arrives) meet it only once it has started.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import compat
from ..events import EventLog
from ..launch_env import RANK_VARIABLES, RECOVERY_KEY, RUN_DIR, LaunchEnv
from ..outcomes import BadInput
from .auth import Seal, report_forged
from .catch import CATCH, LOCAL
from .protocol import RecoveryStore, connect, parse_address, spare_store_from_environ, wait_for_assignment

# what this module replaced process-wide, put back by undo() (the replacement's script has ended)
_undo: list[Callable[[], None]] = []


def undo() -> None:
    """Put back everything this module replaced that is still replaced (``DistributedDataParallel.__init__``,
    ``torch.distributed.init_process_group``, ``os.environ``'s class), the latest first; safe to call twice."""
    while _undo:
        _undo.pop()()


def skip_initial_broadcast() -> None:
    """Make ``DistributedDataParallel(...)`` default to ``init_sync=False`` in this process (until :func:`undo`)."""
    original = DistributedDataParallel.__init__
    _undo.append(lambda: setattr(DistributedDataParallel, "__init__", original))

    @functools.wraps(original)
    def init(self, *args, init_sync: bool = False, **kwargs):  # type: ignore[no-untyped-def]
        original(self, *args, init_sync=init_sync, **kwargs)

    DistributedDataParallel.__init__ = init  # type: ignore[method-assign]


def _report_forged(key: str) -> None:
    """A spare or a replacement refused a forged value: a ``security`` event in the run's log."""
    report_forged(EventLog(os.environ[RUN_DIR]), key)


class Assignment:
    """A warm spare's rank, taken once from the launcher: at the script's first read of a
    :data:`RANK_VARIABLES` variable (:meth:`watch_environ`) or at ``init_process_group``."""

    def __init__(self, spare_id: int):
        self.spare_id = spare_id
        self.store = spare_store_from_environ()
        self.seal = Seal(bytes.fromhex(os.environ.get(RECOVERY_KEY, "")))
        self.taken = False
        self._environ_class = type(os.environ)

    def take(self) -> None:
        """Block until the launcher assigns this spare a rank, and take that rank's environment
        (once; later calls return at once)."""
        if self.taken:
            return
        self.taken = True
        os.environ.__class__ = self._environ_class  # stop watching
        os.environ.update(wait_for_assignment(self.store, self.spare_id, self.seal, _report_forged))

    def watch_environ(self) -> None:
        """Make ``os.environ`` (and so ``os.getenv``) take the assignment before it answers a
        read of a :data:`RANK_VARIABLES` variable."""
        original, take = self._environ_class, self.take

        class Watched(original):  # type: ignore[misc, valid-type]
            def __getitem__(self, key: str) -> str:
                if key in RANK_VARIABLES:
                    take()
                return original.__getitem__(self, key)

        os.environ.__class__ = Watched
        _undo.append(self._stop_watching)

    def _stop_watching(self) -> None:
        if type(os.environ) is not self._environ_class:
            os.environ.__class__ = self._environ_class


def join_at_init(spare_id: Optional[int]) -> None:
    """Wrap this process's first ``init_process_group`` call: a warm spare (``spare_id``) takes
    its assignment from the launcher (at the latest there: see :class:`Assignment`); then a
    process that joins a generation (``TRAINGUARD_JOIN``) says it is ready
    (:meth:`~.protocol.RecoveryStore.ready`): the ranks of a group that grows meet it only then."""
    original = dist.init_process_group
    assignment = Assignment(spare_id) if spare_id is not None else None
    if assignment is not None:
        assignment.watch_environ()

    @functools.wraps(original)
    def init(*args, **kwargs):  # type: ignore[no-untyped-def]
        if assignment is not None:
            assignment.take()
        launch = LaunchEnv.from_environ()
        if launch.join is not None and launch.recovery_store:
            seal = Seal(launch.recovery_key or b"")
            store = RecoveryStore(
                connect(*parse_address(launch.recovery_store)), launch.recovery_group, seal, _report_forged
            )
            store.ready(launch.join, int(os.environ["RANK"]))
        dist.init_process_group = original
        return original(*args, **kwargs)

    dist.init_process_group = init
    _undo.append(lambda: setattr(dist, "init_process_group", original) if dist.init_process_group is init else None)


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
    if not argv:
        print("usage: python -m trainguard.rejoin.replacement [--spare ID] SCRIPT [ARG...]", file=sys.stderr)
        raise BadInput("no script given")
    skip_initial_broadcast()
    # imported lazily otherwise, after the spare was assigned: the rank-side stack, and torch._dynamo,
    # which DistributedDataParallel's constructor imports (0.7 s on this machine)
    compat.preload_dynamo()

    import trainguard.guard  # noqa: F401

    join_at_init(spare)
    CATCH.install()
    CATCH.mode = LOCAL  # until the Guard joined the survivors
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:  # the script has ended: nothing stays replaced (the Guard's close() put its own back)
        CATCH.uninstall()
        undo()


if __name__ == "__main__":
    main(sys.argv[1:])
