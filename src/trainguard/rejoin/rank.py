"""The rank's side of in-process recovery: noticing a lost peer, waiting for the new generation.

The Guard owns the order of the recovery (it holds the model, the checkpointer and the ping);
this component holds what recovery needs across steps: the recovery store, the step-boundary
state, the failure seen in the current step and the generation this process is in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from ..launch_env import LaunchEnv
from ..sections import RecoverySection
from . import sever
from .abort import CommAbort
from .auth import Seal
from .boundary import BoundaryState, parse_slot
from .boundary import read as read_boundaries
from .notice import LostNodeNotice
from .protocol import Forged, Generation, RecoveryStore, is_peer_failure
from .stores import open_store

# The parts of the training state (Guard.train_state) that only their rank holds: its data position,
# the user's extra state and its RNG streams. A replacement takes them from the lost rank's boundary
# file; the other parts (scheduler, instability statistics, micro-batch size) are the same on every
# rank and come from a survivor.
LOCAL_PARTS = ("sampler", "extra", "rng")


def lost_boundaries(directory: Any, rank: int, store: RecoveryStore) -> tuple[dict[int, dict[str, Any]], str]:
    """A replacement: the boundaries the lost rank ``rank`` kept, ``{step: state}``, and where
    they came from: its file in ``directory`` on this node (``"file"``), else the copy in the
    recovery store (``"recovery store"``: its node was lost; :class:`~.boundary.BoundaryState` ``mirror``).

    Raises:
        FileNotFoundError: neither holds a boundary of that rank.
    """
    try:
        return read_boundaries(directory, rank), "file"
    except FileNotFoundError:
        found = [parse_slot(store.mirrored_boundary(rank, slot)) for slot in (0, 1)]
        kept = dict(f for f in found if f is not None)
        if not kept:
            raise FileNotFoundError(
                f"no step boundary of rank {rank} in {directory} nor in the recovery store"
            ) from None
        return kept, "recovery store"


@dataclass
class PeerFailure:
    """A lost peer noticed in the current step.

    Attributes:
        error: the collective's exception (re-raised if recovery cannot complete).
        during: where it surfaced (``run_step``, ``should_step``, ``stop_check``).
        step: number of the step in progress (the 1-based number; ``guard.step + 1``).
        at: ``time.time()`` when it was caught.
    """

    error: BaseException
    during: str
    step: int
    at: float


class Rejoin:
    """In-process recovery state of one rank (inactive unless ``[recovery] in_process`` and the
    launcher hosts a recovery store).

    Args:
        cfg: the ``[recovery]`` section.
        launch: the launcher's contract (recovery store, boundary directory, ``join``).
        rank: global rank.
        keep_in_memory: keep the step-boundary state in memory even when inactive (a step re-run,
            :mod:`trainguard.sdc.rerun`, restores it).
        declined: why in-process recovery does not apply to this loop (a framework owns the
            group, a sharded model); rank 0 tells the launcher (:meth:`RecoveryStore.decline`).
        on_forged: told the key of a store value that did not carry the launch's seal (refused).
        abort_comms: abort this rank's communicators when the launcher publishes a loss
            (:class:`~.abort.CommAbort`; ``[recovery] in_process = "nccl-experimental"``).
    """

    def __init__(
        self,
        cfg: RecoverySection,
        launch: LaunchEnv,
        rank: int,
        keep_in_memory: bool = False,
        declined: Optional[str] = None,
        on_forged: Forged = lambda key: None,
        abort_comms: bool = False,
    ):
        self.cfg, self.rank = cfg, rank
        offered = bool(cfg.in_process and launch.recovery_store and launch.recovery_key)
        self.declined = declined if offered else None  # why in-process recovery does not apply here
        self.active = offered and declined is None
        self.keeping = self.active or keep_in_memory  # whether keep() keeps the step-boundary state
        self.store: Optional[RecoveryStore] = None
        if offered:
            seal = Seal(launch.recovery_key, launch.recovery_nonce)  # type: ignore[arg-type]
            client = open_store(launch.recovery_store, cfg.timeout)  # type: ignore[arg-type]
            store = RecoveryStore(client, launch.recovery_group, seal, on_forged)
            if self.active:
                self.store = store
            elif rank == 0:  # the launcher restarts the group at once on a lost rank
                store.decline(declined)
        self.dir = launch.recovery_dir
        mirror = self._mirror if self.active and launch.boundary_mirror else None
        # "rng": RNGState hands out the same dict while no generator moved (copy-on-change)
        self.boundary = BoundaryState(self.dir if self.active else None, rank, mirror, stable=("rng",))
        self.joining = self.active and launch.join is not None
        self.generation = launch.join if self.joining else 0
        self.failure: Optional[PeerFailure] = None
        self.group_ports: set[int] = set()  # the ports the group's ranks listen on (see :mod:`.sever`)
        self.notice: Optional[LostNodeNotice] = None  # spare nodes: a silent host's peers cut (see :mod:`.notice`)
        if self.active and launch.spare_nodes:
            self.notice = LostNodeNotice(
                launch.recovery_store,
                launch.recovery_group,
                seal,
                lambda: self.generation,
                self.failed,
                lambda: self.group_ports,
                on_forged,
            )
        self.comm_abort: Optional[CommAbort] = None  # NCCL: the survivors' communicators aborted (see :mod:`.abort`)
        if self.active and abort_comms:
            args = (launch.recovery_store, launch.recovery_group, seal)
            self.comm_abort = CommAbort(*args, lambda: self.generation, lambda: self.group_ports)

    def renumber(self, rank: int) -> None:
        """This process is rank ``rank`` from now on (the group shrank in place): its boundary
        file takes the new number."""
        self.rank = rank
        self.boundary.renumber(rank)

    def _mirror(self, slot: int, data: bytes) -> None:
        self.store.mirror_boundary(self.rank, slot, data)

    def lost_boundaries(self, rank: int) -> tuple[dict[int, dict[str, Any]], str]:
        """A replacement: the boundaries the lost rank ``rank`` kept (:func:`lost_boundaries`)."""
        return lost_boundaries(self.dir, rank, self.store)

    def caught(self, exc: BaseException, during: str, step: int) -> bool:
        """Whether ``exc`` is a lost peer that recovery handles (then it is recorded for
        :meth:`wait_generation`); ``False``: the caller re-raises it."""
        aborted = self.comm_abort is not None and self.comm_abort.aborted()  # any error after it is the loss
        if not self.active or not (is_peer_failure(exc) or aborted):
            return False
        if self.failure is None:
            # without its traceback: the frames would keep the failed collective's work, and with it
            # the group's connections, alive after the group is destroyed, and a surviving peer
            # still waiting in that collective for this rank would never see it end
            self.failure = PeerFailure(exc.with_traceback(None), during, step, time.time())
            sever.cut(self.group_ports)  # the peers still waiting on this rank in that collective see it end
        return True

    def failed(self) -> bool:
        """Whether a lost peer was noticed in the current step."""
        return self.failure is not None

    def keep(self, state: dict[str, Any]) -> None:
        """Keep the step-boundary state (see :class:`~trainguard.rejoin.boundary.BoundaryState`;
        in its file only when active)."""
        if self.keeping:
            self.boundary.keep(state)

    def wait_generation(self) -> Generation:
        """The next generation, once the launcher published it.

        Raises:
            BaseException: the recorded collective error, after ``[recovery] timeout`` seconds
                without a new generation (the process then exits and the launcher falls back).
        """
        assert self.store is not None and self.failure is not None
        gen = self.store.wait(self.generation + 1, self.cfg.timeout)
        if gen is None:
            raise self.failure.error
        self.generation = gen.number
        return gen

    def growth_pending(self) -> int:
        """The number of the next generation if it is published, grows the group in place (see
        :mod:`.shrink`) and its newcomers have started (a cold one takes seconds; the ranks train
        on meanwhile), else 0. One or two store round trips; rank 0 asks at each stop check."""
        if not self.active:
            return 0
        gen = self.store.peek(self.generation + 1)
        return gen.number if gen is not None and gen.grown and self.store.all_ready(gen) else 0

    def grown_generation(self, number: int) -> Generation:
        """Generation ``number``, which the ranks agreed to grow into (rank 0 found it published).

        Raises:
            RuntimeError: it cannot be read within ``[recovery] timeout`` (the launcher is gone).
        """
        assert self.store is not None
        gen = self.store.wait(number, self.cfg.timeout)
        if gen is None:
            raise RuntimeError(f"generation {number} was not published in the recovery store")
        if self.rank == 0:
            self.store.accept(number)
        self.generation = gen.number
        return gen

    def joined_generation(self) -> Generation:
        """A replacement's generation (already published when it was started).

        Raises:
            RuntimeError: it is not published (the launcher is gone).
        """
        assert self.store is not None
        gen = self.store.wait(self.generation, self.cfg.timeout)
        if gen is None:
            raise RuntimeError(f"generation {self.generation} was not published in the recovery store")
        return gen

    def done(self) -> None:
        """The step was recovered: forget the failure."""
        self.failure = None

    def stop_watching(self) -> None:
        """Stop the lost-node watcher (every rank, also one that fails alone and leaves its files)."""
        if self.notice is not None:
            self.notice.stop()
            self.notice = None
        if self.comm_abort is not None:
            self.comm_abort.stop()
            self.comm_abort = None

    def close(self) -> None:
        """Remove this rank's boundary file, stop the lost-node watcher."""
        self.boundary.close()
        self.stop_watching()
