"""Both sides of a sharded model's in-process recovery, on the new group: with HSDP, move each lost
shard from a surviving replica (nothing is trained again); else agree on the newest snapshot every
rank can roll back to, move the lost ranks' copies to their replacements, load it.

See :mod:`~trainguard.rejoin.shards` for the snapshots and why a sharded model rolls back: the
lost shard exists nowhere at the current step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .. import dist as tgdist
from ..checkpoint.local import deserialize, serialize
from .regroup import RegroupError
from .shards import ShardSnapshots, load_shard_state, newest_common, shard_state


@dataclass(frozen=True)
class RolledBack:
    """Where a rank's recovery of a sharded model took it.

    Attributes:
        step: the snapshot's step (completed steps from now on).
        source: where this rank's shard came from: ``"own memory"`` or ``"rank N's memory"``.
        bytes: bytes of the copy this rank sent or received (0: it only loaded its own).
        train_state: this rank's training state at ``step`` (:class:`~trainguard.state.trainstate.TrainState`'s dict).
    """

    step: int
    source: str
    bytes: int
    train_state: dict


def _device() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _send(blob: bytes, dst: int) -> None:
    dist.send(torch.tensor([len(blob)], dtype=torch.int64, device=_device()), dst)
    dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(_device()), dst)


def _recv(src: int) -> bytes:
    size = torch.zeros(1, dtype=torch.int64, device=_device())
    dist.recv(size, src)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=_device())
    dist.recv(buf, src)
    return buf.cpu().numpy().tobytes()


def roll_back(shards: ShardSnapshots, rank: int, replaced: tuple[int, ...], holdings: Optional[dict]) -> RolledBack:
    """Every rank of the new group, at the same point: roll back to the newest common snapshot (a
    collective on the default group).

    Args:
        rank: this rank.
        replaced: the ranks being replaced (their replacements hold nothing yet).
        holdings: this rank's :meth:`ShardSnapshots.holdings`, taken before the old group was
            destroyed; ``None`` on a replacement.
    Raises:
        RegroupError: no snapshot every rank can roll back to (a lost rank's holder was lost too,
            or its copy never arrived): the group restarts from the newest checkpoint.
    """
    everyone = tgdist.gather_objects(holdings)
    own = {r: set(h["own"]) for r, h in enumerate(everyone) if h is not None}
    held = {r: {int(k): set(v) for k, v in h["held"].items()} for r, h in enumerate(everyone) if h is not None}
    lost = set(replaced)
    step = newest_common(own, held, lost, shards.holder)
    if step is None:
        raise RegroupError(
            f"no in-memory snapshot that every rank can roll back to (lost {sorted(lost)}; held {own}, copies {held})"
        )
    blob, moved, source = None, 0, "own memory"
    for x in sorted(lost):
        h = shards.holder[x]
        if rank == h:
            copy = shards.copy_of(step)
            _send(copy, x)
            moved += len(copy)
        elif rank == x:
            blob = _recv(h)
            moved, source = len(blob), f"rank {h}'s memory"
    return RolledBack(step, source, moved, shards.restore(step, blob))


def from_replicas(
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    rank: int,
    sources: dict[int, int],
    shared: dict,
) -> tuple[Optional[dict], int]:
    """HSDP: each lost rank's replacement takes its shard of the model and optimizer from the
    surviving replica ``sources[lost rank]`` (point-to-point on the default group), with the
    state every rank holds alike (``shared``: on a source, its training state's shared parts).

    Returns:
        ``(shared parts received, bytes)`` on a replacement (its model and optimizer loaded);
        ``(None, bytes sent)`` elsewhere.
    """
    received, moved = None, 0
    for lost, src in sorted(sources.items()):
        if rank == src:
            blob = serialize({**shard_state(model, optimizer), "shared": shared})
            _send(blob, lost)
            moved += len(blob)
        elif rank == lost:
            blob = _recv(src)
            state = deserialize(blob)
            received, moved = state.pop("shared"), len(blob)
            load_shard_state(model, optimizer, state)
    return received, moved
