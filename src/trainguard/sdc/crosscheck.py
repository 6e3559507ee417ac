"""Compute one rank's forward on another rank: is its hardware wrong, or its batch?

A step re-run (:mod:`trainguard.sdc.rerun`) that gives every rank the same result again cannot tell a
bad batch from hardware that computes the same wrong number every time. When one rank's loss
alone is wrong (non-finite, or far from the other ranks'), its **partner** (the next rank) computes
that rank's forward too, on the same inputs with the same random numbers and the same parameters
(the replicas are identical), and both fingerprint the output:

* equal: two devices compute the same from that batch: the **data** (or the model);
* different: the suspect's device computes something else than a healthy one: a **persistent**
  fault of the suspect's hardware.

:class:`StepInputs` keeps, for the current step only, the references to the inputs of the model's
first forward and the RNG states just before it (a forward pre-hook on the module inside DDP, so
that the replay runs no collective). :func:`cross_check` is a collective: the suspect sends its
inputs to every rank, the suspect and its partner replay them (``torch.no_grad``, the module's
current train/eval mode), one all-reduce compares the two fingerprints. Models with sharded
parameters (DTensor) have no replicas to replay on: :class:`StepInputs` is off for them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import dist as tgdist
from .replicas import fingerprint

_UNSET = -(1 << 63)


def _map_tensors(obj: Any, fn: Any) -> Any:
    """``obj`` with every tensor inside (lists, tuples, dicts) replaced by ``fn(tensor)``."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_map_tensors(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _float_tensors(obj: Any) -> list[torch.Tensor]:
    """The floating-point tensors inside ``obj`` (a tensor, or lists, tuples, dicts of them)."""
    found: list[torch.Tensor] = []
    _map_tensors(obj, lambda t: found.append(t) if t.is_floating_point() else None)
    return found


class StepInputs:
    """The inputs and RNG states of the model's first forward in the current step.

    Args:
        model: the trained module (DDP-wrapped or plain); the hook goes on the module inside DDP.
    """

    def __init__(self, model: torch.nn.Module):
        self.module = model.module if isinstance(model, DDP) else model
        self.device = next(self.module.parameters()).device
        self.sharded = any(type(p).__name__ == "DTensor" for p in self.module.parameters())
        self.recorded: Optional[tuple[Any, Any, dict[str, torch.Tensor]]] = None
        self._fresh = False
        self._hook = self.module.register_forward_pre_hook(self._record, with_kwargs=True)

    def step_begin(self, step: int) -> None:
        """Step ``step`` (or a run of it again) begins (the Guard's component protocol): the next forward's inputs are recorded (none
        until then: a step without a forward has nothing to replay)."""
        self._fresh, self.recorded = True, None

    def _record(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if self._fresh:
            self._fresh = False
            rng = {"cpu": torch.get_rng_state()}
            if self.device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(self.device)
            self.recorded = (args, kwargs, rng)

    def portable(self) -> Optional[tuple[Any, Any, dict[str, torch.Tensor]]]:
        """The recorded inputs and RNG states with every tensor on the CPU (to send), or ``None``."""
        if self.recorded is None:
            return None
        return _map_tensors(self.recorded, lambda t: t.detach().cpu())

    def replay(self, recorded: tuple[Any, Any, dict[str, torch.Tensor]]) -> int:
        """Run the module's forward on ``recorded`` inputs with its RNG states, without gradients,
        and return the fingerprint of the output's floating-point tensors. The module's buffers
        (batch-norm running statistics) and the RNG states are as before afterwards: the replicas
        stay equal."""
        args, kwargs, rng = recorded
        args, kwargs = _map_tensors((args, kwargs), lambda t: t.to(self.device))
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], self.device)
            with torch.no_grad():
                out = self.module(*args, **kwargs)
                value = fingerprint(_float_tensors(out))
                for b, kept in buffers:
                    b.copy_(kept)
        return value

    def close(self) -> None:
        """Remove the forward pre-hook."""
        self._hook.remove()


def cross_check(inputs: StepInputs, suspect: int, rank: int, world_size: int) -> Optional[list[int]]:
    """The suspect rank's recorded forward, replayed on the suspect and on its partner (rank
    ``suspect + 1`` modulo the world size). A collective: call it on every rank.

    Returns:
        ``[suspect's fingerprint, partner's]``, the same on every rank; ``None`` when the suspect
        recorded no forward in this step (nothing to replay).
    """
    partner = (suspect + 1) % world_size
    recorded = tgdist.broadcast_object(inputs.portable() if rank == suspect else None, src=suspect)
    if recorded is None:
        return None
    slots = [_UNSET, _UNSET]
    if rank in (suspect, partner):
        slots[0 if rank == suspect else 1] = inputs.replay(recorded)
    return [int(v) for v in tgdist.all_reduce_max(slots)]
