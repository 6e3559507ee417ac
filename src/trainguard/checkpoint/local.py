"""The node-local checkpoint tier: fast, frequent, replicated to one other place.

Each rank writes its whole state (model and optimizer state dict, its rank state) as one file,
``state.pt``, into its own store under the node-local directory (``/dev/shm``, a local NVMe disk),
in a subdirectory named by the run's id (``RUN_DIR/.run-id``), so runs sharing the directory never
see each other's copies::

    LOCAL/RUNID/rank-00003/step-00001200/{state.pt, manifest.json}        this rank's own copy
    LOCAL/RUNID/replica-rank-00001/step-00001200/{state.pt, manifest.json} a copy held for another node's rank

Every copy goes through the store's commit protocol (temporary directory, manifest with XXH3-128
checksums, atomic rename), so a copy is either complete and verifiable or invisible.

Replication (``[checkpoint.local] replicate``): with several nodes, rank ``r`` sends its file to
rank ``r + local_world_size`` (the same local rank on the next node, wrapping around), which keeps
it as ``replica-rank-r``: losing one node's disk loses no step. With a single node there is no other
node, so the copy goes to the persistent tier's ``local-replicas/rank-r`` instead.

A step is committed by every rank only after all ranks agree that their own and replica copies
were written (one all-reduce); a crash between two ranks' renames leaves the step complete on some
ranks only, and :func:`choose` then does not pick it. On resume every rank lists what it can verify
(:meth:`LocalTier.inventory`); :func:`choose` picks the newest step that every rank can load from
its own copy, a peer's replica or the persistent replica directory, and :meth:`LocalTier.fetch`
moves the bytes (a ``send``/``recv`` from the holding peer when needed).

The file is loaded with ``torch.load(weights_only=True)`` (no arbitrary pickle, unlike NVIDIA's
local checkpoints). The format holds each rank's tensors as they are (replicated states such as
DDP's hold the full model on every rank; a DTensor of FSDP2 is this rank's shard, which loads on the
same world size, tests/test_fsdp2.py); resharding to another world size goes through the persistent tier.
"""

from __future__ import annotations

import io
import os
import shutil
import socket
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .. import dist as tgdist
from . import manifest as mf
from .store import Checkpoint, CheckpointStore

STATE_FILE = "state.pt"


def expand_dir(template: str, rank: int, node: int) -> Path:
    """The local tier's directory: ``template`` with ``{node}``, ``{host}`` and ``{rank}`` filled in
    (``{node}`` lets two "nodes" on one machine, as in tests, keep separate local tiers)."""
    return Path(template.format(node=node, host=socket.gethostname(), rank=rank))


def serialize(state: dict[str, Any]) -> bytes:
    """``torch.save`` of ``state`` into memory (the bytes written locally and sent to the replica)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def deserialize(data: bytes) -> dict[str, Any]:
    """Inverse of :func:`serialize`, with ``weights_only=True``."""
    return torch.load(io.BytesIO(data), weights_only=True)


class LocalTier:
    """One rank's view of the node-local tier.

    Args:
        root: this node's local directory (already expanded).
        replica_root: where a single-node run keeps its replicas (the persistent store's
            ``local-replicas``); ``None``: no replication.
        keep_last: copies kept per store (own and replicas).
        rank, world_size, local_world_size: this rank's place (``LOCAL_WORLD_SIZE`` ranks per node).
        run_id: the run's identity (its run directory) written into every copy's manifest; copies of
            another run (a local directory shared by several runs) are never used.
        on_invalid: ``on_invalid(checkpoint, reason)`` for each copy that fails verification.
    """

    def __init__(
        self,
        root: Path,
        replica_root: Optional[Path],
        keep_last: int,
        rank: int,
        world_size: int,
        local_world_size: int,
        run_id: str,
        on_invalid: Optional[Callable[[Checkpoint, str], None]] = None,
    ):
        self.root, self.rank, self.world, self.run_id = root, rank, world_size, run_id
        self.own = CheckpointStore(root / f"rank-{rank:05d}", keep_last=keep_last, on_invalid=on_invalid)
        multi_node = world_size > local_world_size
        self.send_to: Optional[int] = None
        self.recv_from: Optional[int] = None
        self.replica: Optional[CheckpointStore] = None  # the store this rank writes replicas into
        if replica_root is not None and multi_node:
            self.send_to = (rank + local_world_size) % world_size
            self.recv_from = (rank - local_world_size) % world_size
            self.replica = CheckpointStore(root / f"replica-rank-{self.recv_from:05d}", keep_last, on_invalid)
        elif replica_root is not None:
            self.replica = CheckpointStore(replica_root / f"rank-{rank:05d}", keep_last, on_invalid)
        self.keep_last = keep_last
        self._verified_own: set[int] = set()

    def clean_stale(self) -> None:
        """Remove temporary directories of interrupted writes (at start, before any save)."""
        for store in filter(None, (self.own, self.replica)):
            store.clean_stale()

    # ------------------------------------------------------------------------------------------
    # writing (in the background writer, a collective on the checkpoint group)

    def write(
        self, step: int, state: dict[str, Any], meta: dict, group: Any = None, refuse: Optional[str] = None
    ) -> tuple[int, Optional[str]]:
        """Write this rank's copy and its replica, agree with all ranks, then commit both.

        ``refuse``: why this rank's copy must not be committed (the collectives still run; every
        rank gets it as the error).

        Returns:
            (bytes written by this rank, ``None`` or the first error of any rank). On an error no
            rank commits this step and the older copies stay.
        """
        error: Optional[str] = refuse
        data = serialize(state)
        own_tmp = rep_tmp = None
        try:
            own_tmp = self._write_tmp(self.own, step, data)
        except OSError as e:
            error = f"rank {self.rank}: local tier write to {self.own.root} failed: {e}"
        received = self._exchange(data, group)
        if self.replica is not None and error is None:
            try:
                rep_tmp = self._write_tmp(self.replica, step, received if self.send_to is not None else data)
            except OSError as e:
                error = f"rank {self.rank}: replica write to {self.replica.root} failed: {e}"
        errors = tgdist.gather_objects(error, group=group)
        first = next((e for e in errors if e), None)
        for store, tmp in ((self.own, own_tmp), (self.replica, rep_tmp)):
            if store is None or tmp is None:
                continue
            if first is None:
                store.commit(
                    tmp, step, mf.describe_files(tmp, [STATE_FILE]), {**meta, "rank": self.rank, "run": self.run_id}
                )
                store.apply_retention()
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        return len(data), first

    @staticmethod
    def _write_tmp(store: CheckpointStore, step: int, data: bytes) -> Path:
        tmp = store.begin(step)
        with open(tmp / STATE_FILE, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if store.path_for(step).exists():  # a leftover of an earlier attempt at this step
            shutil.rmtree(store.path_for(step))
        return tmp

    def _exchange(self, data: bytes, group: Any) -> bytes:
        """Send ``data`` to ``send_to`` and receive the replica from ``recv_from`` (multi-node only)."""
        if self.send_to is None:
            return b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        peer_size = torch.zeros(1, dtype=torch.int64)
        _pairwise([(size, self.send_to)], [(peer_size, self.recv_from)], group)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        incoming = torch.empty(int(peer_size.item()), dtype=torch.uint8)
        _pairwise([(payload, self.send_to)], [(incoming, self.recv_from)], group)
        return incoming.numpy().tobytes()

    # ------------------------------------------------------------------------------------------
    # resuming

    def inventory(self, verify: str) -> dict[str, Any]:
        """What this rank can load: ``{"own": [steps], "held": {rank: [steps]}}``, verified copies only.

        ``held`` maps a rank to the steps of its copies kept here: a peer's replica (multi-node) or
        this rank's own replica in the persistent tier (single node).
        """
        held: dict[int, list[int]] = {}
        if self.replica is not None:
            owner = self.recv_from if self.send_to is not None else self.rank
            held[owner] = _verified_steps(self.replica, verify, self.world, self.run_id)
        own = _verified_steps(self.own, verify, self.world, self.run_id)
        self._verified_own = set(own)  # fetch() reads its own copy only if it verified
        return {"own": own, "held": held}

    def fetch(self, step: int, plan: list[int], group: Any = None) -> bytes:
        """The bytes of this rank's copy at ``step``, following ``plan`` (from :func:`choose`):
        ``plan[r]`` is the rank that holds rank ``r``'s copy. A collective on ``group``."""
        sends, recvs = [], []
        for owner, holder in enumerate(plan):
            if holder == self.rank and owner != self.rank:
                data = (self.replica.path_for(step) / STATE_FILE).read_bytes()  # type: ignore[union-attr]
                sends.append((torch.tensor([len(data)], dtype=torch.int64), owner, data))
        mine: Optional[bytes] = None
        if plan[self.rank] == self.rank:
            source = self.own if step in self._verified_own else self.replica
            mine = (source.path_for(step) / STATE_FILE).read_bytes()  # type: ignore[union-attr]
        else:
            recvs.append(plan[self.rank])
        if not sends and not recvs and not any(h != o for o, h in enumerate(plan)):
            return mine  # type: ignore[return-value]
        size = torch.zeros(1, dtype=torch.int64)
        _pairwise([(s, dst) for s, dst, _ in sends], [(size, src) for src in recvs], group)
        incoming = torch.empty(int(size.item()), dtype=torch.uint8)
        _pairwise(
            [(torch.frombuffer(bytearray(d), dtype=torch.uint8), dst) for _, dst, d in sends],
            [(incoming, src) for src in recvs],
            group,
        )
        return mine if mine is not None else incoming.numpy().tobytes()


def choose(inventories: list[dict[str, Any]]) -> tuple[Optional[int], list[int]]:
    """The newest step every rank can load, and who holds each rank's copy.

    Args:
        inventories: :meth:`LocalTier.inventory` of every rank, by rank.
    Returns:
        ``(step, plan)`` with ``plan[r]`` the rank that provides rank ``r``'s copy (``r`` itself for
        its own copy or a replica in the shared persistent tier), or ``(None, [])``.
    """
    world = len(inventories)
    holders: dict[int, dict[int, int]] = {}  # step -> {owner rank: holder rank}
    for r, inv in enumerate(inventories):
        for s in inv["own"]:
            holders.setdefault(s, {})[r] = r
    for r, inv in enumerate(inventories):
        for owner, steps in inv["held"].items():
            for s in steps:
                holders.setdefault(s, {}).setdefault(int(owner), r)
    for step in sorted(holders, reverse=True):
        if len(holders[step]) == world:
            return step, [holders[step][r] for r in range(world)]
    return None, []


def _verified_steps(store: CheckpointStore, verify: str, world_size: int, run_id: str) -> list[int]:
    steps = []
    for ckpt in store.committed():
        reason = store.check(ckpt, verify)
        meta = mf.read_manifest(ckpt.path)["meta"] if reason is None else {}
        if reason is None and (meta.get("world_size") != world_size or meta.get("run") != run_id):
            continue  # another world size's copy (ranks do not map) or another run's
        if reason is None:
            steps.append(ckpt.step)
        elif store.on_invalid is not None:
            store.on_invalid(ckpt, reason)
    return steps


def _pairwise(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group: Any) -> None:
    """Post every send and receive at once, then wait for all (no ordering deadlock)."""
    works = [dist.isend(t, dst, group=group) for t, dst in sends] + [
        dist.irecv(t, src, group=group) for t, src in recvs
    ]
    for w in works:
        w.wait()
