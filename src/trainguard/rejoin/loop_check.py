"""After an in-process recovery: do every rank's optimizer hyperparameters still agree?

A step done again on the survivors runs the script's loop body twice for one step. A loop that
keeps its own counters (timm's ``num_updates`` and ``batch_idx``, a scheduler the Guard was not
given) moves them on over the interrupted attempt, while the replacement computes them afresh
from the step it starts at. The redo check (:mod:`.redo_check`) sees the batch; it does not see a
learning rate set from ``num_updates + 1``. Under data parallelism every replica must apply the
same update: a survivor whose learning rate differs from its replacement's trains another model
from then on, silently (no collective notices), and its later logging collectives no longer line
up with the replacement's (a hang, a second replacement, the same again).

So at the first completed step after a meeting (:meth:`LoopCheck.check`, before the rank tells the
launcher of that step: the progress rule), each rank writes its :func:`loop_state` (every
optimizer param group's hyperparameters, the scheduler's counters) to the recovery store and reads
the others'. All alike: the recovery goes on. Any difference: the recovery fails
(:class:`LoopDiverged`, said on the console and in the recovery store, naming the value), the
rank exits and the launcher restarts the group from the newest checkpoint, where every rank
computes its counters from the same step. One store round trip per rank, once per recovery.

A rank whose state does not arrive within :data:`WAIT` is not compared (rank-local work at the
step's end, such as rank 0's evaluation, can keep it): the launcher's settle bound covers a rank
that never completes the step. But a rank that waits all along in one of the script's collectives
(:meth:`~.align.Alignment.waiting`, :data:`STUCK` seconds) while this one ended the step is in a
collective this rank never ran in it: a loop whose own counter decides when it all-reduces a
logged loss (timm's ``batch_idx``) is one step off on the survivors after a step done again, and
the two would pair that collective with the next step's, hanging until the settle bound (30 s).
The recovery fails then, at once (:class:`CollectivesParted`).
"""

from __future__ import annotations

import json
import math
import numbers
import time
from typing import Any, Optional

from .. import console
from .protocol import RecoveryStore
from .regroup import RegroupError

# seconds a rank waits for another's loop state: the step's last collective lines the ranks up,
# so they end it within milliseconds of each other, unless one does work of its own after it
WAIT = 5.0
# what the check compares, as recovery_finished's ``verified`` names it, by the prefix of its keys
VERIFIED = (
    ("optimizer hyperparameters", "group "),
    ("scheduler", "scheduler."),
    ("parameters", "replica.parameters"),
    ("optimizer state", "replica.optimizer state"),
)
STUCK = 1.0  # seconds another rank stays in one collective after this one ended the step: it is not in it
POLL = 0.05  # seconds between two looks at the other rank


class LoopDiverged(RegroupError):
    """The ranks' optimizer hyperparameters differ after an in-process recovery (see the module's
    doc): the recovery failed, the launcher restarts the group."""


class CollectivesParted(LoopDiverged):
    """Another rank waits in a collective that this rank, which ended the step, never ran in it
    (see the module's doc): the recovery failed, the launcher restarts the group."""


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it exactly (floats by ``repr``), or ``None`` when it is not a
    hyperparameter (a tensor of many values, an object)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        v = float(value)
        return repr(v) if math.isnan(v) or math.isinf(v) else v
    if hasattr(value, "numel") and value.numel() == 1:  # a 0-dim tensor learning rate
        return _plain(value.item())
    if isinstance(value, (tuple, list)) and all(isinstance(v, numbers.Real) for v in value):
        return [_plain(v) for v in value]
    return None


def loop_state(optimizer: Any, scheduler: Any = None) -> dict[str, Any]:
    """What every data-parallel rank must hold alike after a step: each param group's
    hyperparameters (``lr``, ``betas``, ``weight_decay`` …; every key but ``params`` whose value
    is a number, a string or a tuple of numbers) as ``group N.key``, and the scheduler's
    ``last_epoch`` and ``_step_count`` (a scheduler without ``state_dict`` adds nothing: its effect
    shows in the groups' ``lr``). ``{}`` without an optimizer. Values are exact (floats compared
    bitwise)."""
    state: dict[str, Any] = {}
    for i, group in enumerate(getattr(optimizer, "param_groups", None) or []):
        for key in sorted(k for k in group if k != "params"):
            value = _plain(group[key])
            if value is not None:
                state[f"group {i}.{key}"] = value
    sd = scheduler.state_dict() if scheduler is not None and hasattr(scheduler, "state_dict") else {}
    for key in ("last_epoch", "_step_count"):
        if key in sd and _plain(sd[key]) is not None:
            state[f"scheduler.{key}"] = _plain(sd[key])
    return state


def replica_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """What every replica of a DDP ``model`` holds bit for bit after a step: fingerprints
    (:func:`~trainguard.sdc.replicas.fingerprint`, the exact sum of the bytes) of its parameters
    and of the optimizer's state tensors (moments, step counts), as ``replica.parameters`` and
    ``replica.optimizer state``. ``{}`` for any other model: a plain module may differ from rank to
    rank by design, and a sharded one holds a shard each, so neither is compared."""
    from torch.nn.parallel import DistributedDataParallel

    from ..sdc.replicas import fingerprint

    if not isinstance(model, DistributedDataParallel):
        return {}
    params = [p for p in model.parameters()]
    state: dict[str, Any] = {"replica.parameters": fingerprint(params)}
    if optimizer is not None:
        tensors = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                st = optimizer.state.get(p, {})
                tensors += [st[k] for k in sorted(st) if hasattr(st[k], "element_size")]
        state["replica.optimizer state"] = fingerprint(tensors)
    return state


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The keys whose values differ (or that one side lacks), as ``key: mine vs theirs``, sorted."""
    keys = sorted(set(mine) | set(theirs))
    return [f"{k}: {mine.get(k)} vs {theirs.get(k)}" for k in keys if mine.get(k) != theirs.get(k)]


class LoopCheck:
    """The check of one rank (see the module's doc).

    Args:
        store: the recovery store of the group attempt.
        optimizer, scheduler: the Guard's (``None``: nothing to compare).
    """

    def __init__(self, store: RecoveryStore, optimizer: Any, scheduler: Any = None, model: Any = None):
        self.store, self.optimizer, self.scheduler, self.model = store, optimizer, scheduler, model
        self.verified: list[str] = []  # what the last check compared and found alike on every rank it heard from

    def check(self, number: int, rank: int, world_size: int, step: int) -> None:
        """At the end of the first step ``step`` completed after meeting generation ``number``:
        write this rank's :func:`loop_state`, read every other rank's (each within :data:`WAIT`
        seconds), and compare.

        Raises:
            LoopDiverged: a rank's state differs from this one's (the recovery store and the console
                say which values; the launcher restarts the group).
        """
        mine = {**loop_state(self.optimizer, self.scheduler), **replica_state(self.model, self.optimizer)}
        self.verified = []
        if not mine:
            return
        self.store.loop_state(number, rank, json.dumps(mine, sort_keys=True))
        heard = 0
        for other in range(world_size):
            if other == rank:
                continue
            text = self._state_of(number, rank, other, step)
            if text is None:  # not within the wait: the settle bound covers it
                continue
            heard += 1
            diff = differences(mine, json.loads(text))
            if diff:
                self._diverged(number, rank, other, step, diff)
        if heard == world_size - 1:
            self.verified = [what for what, key in VERIFIED if any(k.startswith(key) for k in mine)]

    def _state_of(self, number: int, rank: int, other: int, step: int) -> Optional[str]:
        """Rank ``other``'s loop state, looked for every :data:`POLL` seconds for :data:`WAIT`
        seconds (``None`` then), unless ``other`` stays :data:`STUCK` seconds in one collective.

        Raises:
            CollectivesParted: ``other`` waits in a collective this rank did not run in the step.
        """
        deadline, seen, since = time.monotonic() + WAIT, None, 0.0
        while (text := self.store.loop_state_now(number, other)) is None:
            now = time.monotonic()
            site = self.store.waiting_site(number, other)
            if site != seen:
                seen, since = site, now
            elif site is not None and now - since >= STUCK:
                self._parted(number, rank, other, step, site, now - since)
            if now > deadline:
                return None
            time.sleep(POLL)
        return text

    def _parted(self, number: int, rank: int, other: int, step: int, site: str, seconds: float) -> None:
        """Say that ``other`` waits at ``site``, a collective this rank never ran in step ``step``
        (console, recovery store), and raise :class:`CollectivesParted`."""
        reason = (
            f"rank {other} has waited {seconds:.1f} s in {site}, in step {step}, which rank {rank} ended without "
            "running it: the ranks' loops are not at the same place (a counter of the loop's own, such as a "
            "batch index that decides when to all-reduce a logged loss, moved on over the step done again)"
        )
        self._give_up(number, reason, CollectivesParted)

    def _diverged(self, number: int, rank: int, other: int, step: int, diff: list[str]) -> None:
        """Say the divergence (console, recovery store) and raise :class:`LoopDiverged`."""
        shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
        replicas_only = all(d.startswith("replica.") for d in diff)
        reason = (
            f"rank {rank}: after step {step}, done again in-process, its "
            + ("model" if replicas_only else "optimizer")
            + f" differs from rank {other}'s ({shown}; rank {rank}'s vs rank {other}'s): "
            + (
                "the data-parallel replicas no longer hold the same model (an update the loop applied itself "
                "in the interrupted attempt, a state the Guard was not given)"
                if replicas_only
                else "the loop keeps counters of its own (an update count, a batch index, a scheduler not given "
                "to the Guard) that moved on over the interrupted attempt"
            )
        )
        self._give_up(number, reason, LoopDiverged)

    def _give_up(self, number: int, reason: str, error: type[LoopDiverged]) -> None:
        """Say ``reason`` (console, the recovery store: the launcher restarts the group) and raise ``error``."""
        console.say(f"in-process recovery failed: {reason}; the group restarts from the checkpoint")
        try:
            self.store.give_up(number, reason)
        except Exception as e:  # the launcher's store may be gone: the exit says enough
            console.warn(f"could not tell the launcher why ({e})")
        raise error(reason)
