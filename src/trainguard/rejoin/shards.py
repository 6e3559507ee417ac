"""In-memory snapshots of a sharded model's state, each with a copy on another rank.

A rank of an FSDP2 job holds the only copy of its shard at the current step: when it is lost,
nothing in the survivors' memory can rebuild it at that step. So every ``K`` steps
(``[recovery] snapshot_interval``) each rank copies its shard of the model and optimizer and its
own training state (data position, RNG streams, scheduler: :class:`~trainguard.state.trainstate.TrainState`)
into host memory, and sends that snapshot to its *holder*, the rank ``local_world_size`` further
on (the same local rank on the next node, wrapping around; the next rank on a single node), the
way the node-local tier replicates its files (:mod:`trainguard.checkpoint.local`), here in memory
and from a background transfer on a process group of its own.

On a loss every rank rolls back in memory to the newest snapshot that all survivors hold and whose
copies of the lost ranks arrived (:func:`newest_common`); a lost rank's replacement takes its
shard from its holder's copy. No process restarts, no file is read, at most ``K`` completed steps
are trained again (the copy of the newest snapshot is waited for before the next step counts),
and replaying them from the same data position and RNG streams gives the same bits as a run
without the loss.

Each rank keeps its two newest snapshots and the two newest copies it holds: the newest copy may
still be on its way when a peer is lost, and the one before is then the common one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..checkpoint.io import apply_state, model_optim_state
from ..checkpoint.local import deserialize, serialize
from ..checkpoint.snapshot import Snapshot

KEEP = 2  # snapshots (and copies held) kept per rank: the buffers of two snapshots alternate


def shard_state(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict[str, Any]:
    """This rank's model and optimizer state (:func:`~trainguard.checkpoint.io.model_optim_state`:
    the live tensors, DTensors as shards). An optimizer that has not stepped yet is left out
    (``"optim"`` absent): ``get_state_dict`` would initialise its state with a zero-gradient
    ``step()``, which changes its step count and so the training that follows."""
    return model_optim_state(model, optimizer if optimizer is not None and optimizer.state else None)


def load_shard_state(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], state: dict[str, Any]) -> None:
    """Load :func:`shard_state`'s ``state``; without ``"optim"`` the optimizer goes back to not
    having stepped (its state emptied)."""
    if optimizer is not None and "optim" not in state:
        optimizer.state.clear()
        apply_state(model, None, state)
    else:
        apply_state(model, optimizer, state)


def holder_of(rank: int, world_size: int, local_world_size: int) -> int:
    """The rank that holds ``rank``'s snapshot copy: ``local_world_size`` ranks further on (the
    same local rank on the next node), or the next rank when all ranks share one node."""
    step = local_world_size if world_size > local_world_size else 1
    return (rank + step) % world_size


def newest_common(
    own: dict[int, set[int]], held: dict[int, dict[int, set[int]]], lost: set[int], holder: dict[int, int]
) -> Optional[int]:
    """The newest snapshot step every rank can roll back to, or ``None``.

    Args:
        own: for each surviving rank, the steps of the snapshots it holds of itself.
        held: for each surviving rank, ``{rank whose copy it holds: steps of the copies that arrived}``.
        lost: the ranks being replaced (their own snapshots are gone).
        holder: for each lost rank, the rank holding its copy (:func:`holder_of`).
    Returns:
        The largest step that every survivor holds of itself and whose copy every lost rank's
        holder holds; ``None`` when there is none (a lost rank's holder is lost too, or nothing in
        common: the group restarts from the newest checkpoint instead).
    """
    survivors = [r for r in own if r not in lost]
    if not survivors:
        return None
    steps = set.intersection(*(own[r] for r in survivors))
    for r in lost:
        h = holder[r]
        if h in lost or h not in held:
            return None
        steps &= held[h].get(r, set())
    return max(steps) if steps else None


def _clone(obj: Any) -> Any:
    """``obj`` with every tensor (DTensors too) cloned, dicts and lists rebuilt."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def _arrived(works: list) -> bool:
    """Whether every one of ``works`` completed without error (none is waited for)."""
    if not all(w.is_completed() for w in works):
        return False
    try:
        for w in works:
            w.wait()
    except Exception:  # completed with the lost peer's error: this copy did not arrive
        return False
    return True


@dataclass
class _Copy:
    """A snapshot copy in flight (or arrived) from the rank this one holds."""

    step: int
    buf: torch.Tensor
    works: list = field(default_factory=list)


class ShardSnapshots:
    """One rank's snapshots of its shard and the copies it holds of another rank's.

    Args:
        model, optimizer: the sharded model (DTensor parameters) and its optimizer.
        interval: ``[recovery] snapshot_interval`` (steps between snapshots, >= 1).
        rank, world_size, local_world_size: this rank's place (copies go one node further on).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        interval: int,
        rank: int,
        world_size: int,
        local_world_size: int,
    ):
        self.model, self.optimizer, self.interval = model, optimizer, interval
        self.rank, self.world_size = rank, world_size
        self.to = holder_of(rank, world_size, local_world_size)
        self.source = next(r for r in range(world_size) if holder_of(r, world_size, local_world_size) == rank)
        self.holder = {r: holder_of(r, world_size, local_world_size) for r in range(world_size)}
        self._buffers = [Snapshot() for _ in range(KEEP)]
        self.own: dict[
            int, tuple[Any, dict, int]
        ] = {}  # step -> (model/optim state in host buffers, training state, buffer)
        self.held: list[_Copy] = []  # copies of self.source's snapshots, oldest first
        self._sending: list = []  # the works of this rank's copy in flight
        self.group: Any = None  # a gloo group of its own for the copies
        self.bytes = 0  # bytes of the newest snapshot's copy

    def due(self, step: int) -> bool:
        """Whether step ``step``'s boundary takes a snapshot."""
        return step % self.interval == 0

    def regroup(self) -> None:
        """A new group for the copies, on the (new) default group: a collective, called by every
        rank at the same point (the start, the end of a recovery). Snapshots and copies of the
        old group are dropped."""
        self.own.clear()
        self.held.clear()
        self._sending.clear()
        self.group = dist.new_group(backend="gloo")

    def take(self, step: int, train_state: dict) -> None:
        """Snapshot step ``step`` (its update applied) and send its copy to the holder.

        Copies the shard of the model and optimizer into host buffers (reused), then exchanges
        the copies' sizes with the holder and the source (two tiny messages, waited for) and starts
        the copies themselves (waited for at the next boundary, :meth:`settle`).

        Raises:
            the collective's error: a peer is gone (the caller recovers).
        """
        self.settle()
        index = 1 - self.own[max(self.own)][2] if self.own else 0  # not the newest kept snapshot's buffers
        state, _ = self._buffers[index].take(shard_state(self.model, self.optimizer))
        self.own[step] = (state, copy.deepcopy(train_state), index)
        for old in sorted(self.own)[:-KEEP]:
            del self.own[old]
        blob = serialize({**state, "rank": train_state, "step": step})
        self.bytes = len(blob)
        out = torch.tensor([len(blob)], dtype=torch.int64)
        size = torch.zeros(1, dtype=torch.int64)
        for w in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, out, self.to, self.group), dist.P2POp(dist.irecv, size, self.source, self.group)]
        ):
            w.wait()
        payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        incoming = _Copy(step, torch.empty(int(size.item()), dtype=torch.uint8))
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, payload, self.to, self.group),
                dist.P2POp(dist.irecv, incoming.buf, self.source, self.group),
            ]
        )
        self._sending, incoming.works = [works[0], payload], [works[1]]
        self.held.append(incoming)

    def settle(self) -> None:
        """Wait for the copies in flight (sent and received) to complete.

        Raises:
            the collective's error: a peer is gone.
        """
        for w in self._sending[:1]:
            w.wait()
        self._sending = []
        for c in self.held:
            for w in c.works:
                w.wait()
            c.works = []
        del self.held[:-KEEP]

    def holdings(self) -> dict:
        """What this rank can roll back to: ``{"own": [steps], "held": {source rank: [steps]}}``
        (a copy counts once it arrived; a copy still on its way is checked without waiting)."""
        arrived = [c.step for c in self.held if _arrived(c.works)]
        return {"own": sorted(self.own), "held": {self.source: arrived}}

    def copy_of(self, step: int) -> bytes:
        """The copy of the source rank's snapshot of ``step`` (as sent)."""
        (c,) = [c for c in self.held if c.step == step]
        return c.buf.numpy().tobytes()

    def restore(self, step: int, blob: Optional[bytes] = None) -> dict:
        """Load the snapshot of ``step`` into the model and optimizer: this rank's own, or
        ``blob`` (a copy from the holder, for a replacement); returns its training state."""
        if blob is None:  # a copy of the kept buffers: the optimizer may keep the tensors it is given
            state, train_state, _ = self.own[step]
            state = _clone(state)
        else:
            state = deserialize(blob)
            train_state = state.pop("rank")
        load_shard_state(self.model, self.optimizer, state)
        return copy.deepcopy(train_state)
