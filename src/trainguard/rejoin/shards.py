"""In-memory snapshots of a sharded model's state, each with a copy on another rank.

A rank of an FSDP2 job holds the only copy of its shard at the current step: when it is lost,
nothing in the survivors' memory can rebuild it at that step. So every ``K`` steps
(``[recovery] snapshot_interval``) each rank copies its shard of the model and optimizer and its
own training state (data position, RNG streams, scheduler: :class:`~trainguard.state.trainstate.TrainState`)
into host memory, and sends that snapshot to its *holder*, the rank ``local_world_size`` further
on (the same local rank on the next node, wrapping around; the next rank on a single node), the
way the node-local tier replicates its files (:mod:`trainguard.checkpoint.local`), here in memory
and from a background thread on a process group of its own (:class:`ShardSnapshots`).

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
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..checkpoint.local import deserialize, serialize
from ..checkpoint.snapshot import Snapshot, copy_pairs

KEEP = 2  # snapshots (and copies held) kept per rank: the buffers of two snapshots alternate


def shard_state(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict[str, Any]:
    """This rank's model and optimizer state as the modules give it (``state_dict()``: the live
    tensors, DTensors as this rank's shards; the optimizer's keyed by parameter index). Read back
    only by the same script's model and optimizer (this process, a replacement, a replica), so
    the fully-qualified-name form of ``get_state_dict`` is not needed: it costs milliseconds per
    call, and on an optimizer that has not stepped yet it initialises the state with a
    zero-gradient ``step()``, which changes the training that follows."""
    state: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        state["optim"] = optimizer.state_dict()
    return state


def load_shard_state(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], state: dict[str, Any]) -> None:
    """Load :func:`shard_state`'s ``state`` into the live model and optimizer (copied in)."""
    model.load_state_dict(state["model"])
    if optimizer is not None:  # its state replaced whole: none if it had not stepped at the snapshot
        optimizer.load_state_dict(state["optim"])


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


@dataclass
class _Own:
    """One of this rank's snapshots: its model and optimizer state in host buffers, its training
    state, which of the two buffer sets holds it, and whether the copy into them is complete."""

    state: Any
    train_state: dict
    index: int
    complete: bool = False


class ShardSnapshots:
    """One rank's snapshots of its shard and the copies it holds of another rank's.

    :meth:`take` blocks training as long as an asynchronous checkpoint save does: the tensors that
    change outside ``optimizer.step()`` (module buffers) are copied at once; the parameters and
    optimizer states are copied by a background thread while the next forward and backward run
    (an optimizer step pre-hook waits for that copy), which then serializes the snapshot and
    exchanges copies with the holder and the source on a gloo group of its own. The next step
    boundary waits for the exchange (:meth:`settle`).

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
        self.own: dict[int, _Own] = {}  # this rank's snapshots by step
        self.held: list[tuple[int, torch.Tensor]] = []  # (step, bytes) of the source's copies that arrived
        self.group: Any = None  # a gloo group of its own for the copies
        self.bytes = 0  # bytes of the newest snapshot's copy
        self.send_seconds = 0.0  # the newest copy's serialization and exchange (background)
        self._buffers = [Snapshot() for _ in range(KEEP)]
        self._lock = threading.Lock()
        self._copied = threading.Event()
        self._copied.set()
        self._jobs: Optional[queue.Queue] = None  # the background worker's snapshots to copy and send
        self._done = threading.Event()  # the worker finished the snapshot in flight
        self._done.set()
        self._ptrs: Optional[tuple[int, set[int]]] = None  # (optimizer state tensors, their shards' addresses)
        self._error: Optional[BaseException] = None
        self._epoch = 0  # bumped by regroup: a thread of an older group changes nothing
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._before_optimizer_step)

    def _before_optimizer_step(self, *_: Any) -> None:
        """Optimizer step pre-hook: the background copy of the parameters and optimizer states must
        be complete before the step changes them."""
        self._copied.wait()

    def due(self, step: int) -> bool:
        """Whether step ``step``'s boundary takes a snapshot."""
        return step % self.interval == 0

    def regroup(self) -> None:
        """A new group for the copies, on the (new) default group: a collective, called by every
        rank at the same point (the start, the end of a recovery). Snapshots and copies of the
        old group are dropped (a copy still on its way there is ignored)."""
        self._copied.wait()
        with self._lock:
            self._epoch += 1
            self.own.clear()
            self.held.clear()
            self._jobs, self._error, self._ptrs = None, None, None  # a worker still in an old exchange is left behind
            self._done = threading.Event()
            self._done.set()
        self.group = dist.new_group(backend="gloo")

    def forget(self) -> None:
        """Drop every snapshot and copy (call with none in flight: after :meth:`settle`)."""
        with self._lock:
            self.own.clear()
            self.held.clear()

    def take(self, step: int, train_state: dict) -> None:
        """Snapshot step ``step`` (its update applied) and send its copy to the holder in the
        background (see the class). Waits for the previous snapshot's exchange first.

        Raises:
            the previous exchange's error: a peer is gone (the caller recovers).
        """
        self.settle()
        index = 1 - self.own[max(self.own)].index if self.own else 0  # not the newest kept snapshot's buffers
        state, deferred = self._buffers[index].take(shard_state(self.model, self.optimizer), defer=self._in_step())
        own = _Own(state, copy.deepcopy(train_state), index)
        self.own[step] = own
        for old in sorted(self.own)[:-KEEP]:
            del self.own[old]
        if self._jobs is None:  # one worker per group (a daemon: it must not hold the exit in a transfer)
            self._jobs = queue.Queue()
            threading.Thread(
                target=self._work, args=(self._jobs, self._done), name="trainguard-snapshot", daemon=True
            ).start()
        self._copied = threading.Event()
        self._done.clear()
        self._jobs.put((self._epoch, step, own, deferred))

    def _work(self, jobs: queue.Queue, done: threading.Event) -> None:
        """The background worker: each snapshot's copy and exchange, in turn."""
        while True:
            job = jobs.get()
            try:
                self._copy_and_send(*job)
            finally:
                done.set()

    def _in_step(self) -> Callable[[torch.Tensor], bool]:
        """Whether a tensor (by storage address) is a parameter's or an optimizer state's shard:
        those change only in ``optimizer.step()``, so their copy can wait for the background."""
        opt = self.optimizer
        if opt is None:
            return lambda t: False
        states = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        if self._ptrs is None or self._ptrs[0] != len(states):  # kept until the states change (a restore)
            local = [p for g in opt.param_groups for p in g["params"]] + states
            self._ptrs = (len(states), {(t.to_local() if hasattr(t, "to_local") else t).data_ptr() for t in local})
        ptrs = self._ptrs[1]
        return lambda t: t.numel() > 0 and t.data_ptr() in ptrs

    def _copy_and_send(self, epoch: int, step: int, own: _Own, deferred: list) -> None:
        """The background part of :meth:`take`: finish the copy, then exchange the copies."""
        try:
            copy_pairs(deferred)
            own.complete = True
        finally:
            self._copied.set()
        t0 = time.perf_counter()
        try:
            blob = serialize({**own.state, "rank": own.train_state, "step": step})
            incoming = self._exchange(blob)
        except Exception as e:  # a lost peer: settle() raises it at the next boundary
            with self._lock:
                self._error = e if epoch == self._epoch else None
            return
        with self._lock:
            if epoch == self._epoch:
                self.held = [*self.held, (step, incoming)][-KEEP:]
                self.bytes, self.send_seconds = len(blob), time.perf_counter() - t0

    def _exchange(self, blob: bytes) -> torch.Tensor:
        """Send ``blob`` to the holder and receive the source's copy (sizes first)."""
        out, size = torch.tensor([len(blob)], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        for w in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, out, self.to, self.group), dist.P2POp(dist.irecv, size, self.source, self.group)]
        ):
            w.wait()
        payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        incoming = torch.empty(int(size.item()), dtype=torch.uint8)
        for w in dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, payload, self.to, self.group),
                dist.P2POp(dist.irecv, incoming, self.source, self.group),
            ]
        ):
            w.wait()
        return incoming

    def settle(self) -> None:
        """Wait for the snapshot in flight: its copy and its exchange with the holder and the source.

        Raises:
            the exchange's error: a peer is gone.
        """
        self._done.wait()
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def holdings(self) -> dict:
        """What this rank can roll back to: ``{"own": [steps], "held": {source rank: [steps]}}``
        (its own snapshots once copied; the source's copies that arrived, not waited for)."""
        self._copied.wait()  # a local copy: it cannot fail
        with self._lock:
            arrived = [s for s, _ in self.held]
        return {"own": sorted(s for s, o in self.own.items() if o.complete), "held": {self.source: arrived}}

    def copy_of(self, step: int) -> bytes:
        """The copy of the source rank's snapshot of ``step`` (as sent)."""
        with self._lock:
            (buf,) = [b for s, b in self.held if s == step]
        return buf.numpy().tobytes()

    def restore(self, step: int, blob: Optional[bytes] = None) -> dict:
        """Load the snapshot of ``step`` into the model and optimizer: this rank's own, or
        ``blob`` (a copy from the holder, for a replacement); returns its training state."""
        if blob is None:  # a copy of the kept buffers: the optimizer may keep the tensors it is given
            own = self.own[step]
            state, train_state = _clone(own.state), own.train_state
        else:
            state = deserialize(blob)
            train_state = state.pop("rank")
        load_shard_state(self.model, self.optimizer, state)
        self._ptrs = None  # the optimizer's states may be new tensors
        return copy.deepcopy(train_state)
