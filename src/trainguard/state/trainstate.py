"""The training state a rank saves besides its tensors: one mapping of named ``Stateful`` objects.

A checkpoint holds two things per rank:

* the model and optimizer tensors, through ``torch.distributed.checkpoint`` (sharded, see
  :mod:`trainguard.checkpoint.io`);
* this rank's own state (``rank-NNNNN.pt``, loaded with ``weights_only=True``): the step and a
  :class:`TrainState` — by default ``scheduler``, ``sampler``, ``extra`` (the user's
  ``extra_state``, itself a ``TrainState``), ``instability``, ``oom`` and ``rng``.

Every part is a *Stateful*: an object with ``state_dict()`` and ``load_state_dict(state)`` (the
protocol of ``torch.distributed.checkpoint.stateful.Stateful``, torch's LR schedulers and
optimizers, :class:`~trainguard.sampler.ResumableSampler`). A part absent from a saved state (a
checkpoint written before that part existed) is left as it is on load.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Protocol, runtime_checkable

from .determinism import capture_of, capture_rng, restore_rng, rng_fingerprint


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class RNGState:
    """The random number generators of Python, NumPy, torch (CPU) and CUDA, as one Stateful.

    Copy-on-change: :meth:`state_dict` hands out the same dict while no generator has moved since
    its last call (compared by :func:`~trainguard.state.determinism.rng_fingerprint`, about 10 kB
    of raw bytes), so callers read it and never change it. A loop whose random numbers are drawn
    elsewhere (data loader workers, a generator of its own) then pays a fingerprint per step
    boundary, not a capture, and the step-boundary keep reuses its encoding
    (:class:`~trainguard.rejoin.boundary.BoundaryState`'s ``stable`` keys). A draw from one of
    them (a CUDA generator's dropout on the GPU, say) means a new dict at the next call, in which
    each generator that did not move keeps its entry, the very object: the keep encodes the moved
    one's state alone.
    """

    def __init__(self) -> None:
        self._kept: tuple[Optional[tuple[Any, ...]], Optional[dict[str, Any]]] = (None, None)

    def state_dict(self) -> dict[str, Any]:
        return self.snapshot()[1]

    def snapshot(self) -> tuple[Optional[tuple[Any, ...]], dict[str, Any]]:
        """``(fingerprint, state)``: the generators' :func:`~trainguard.state.determinism.rng_fingerprint`
        (``None`` where it is unavailable) and :meth:`state_dict`, read once (about 10 µs while no
        generator moved)."""
        fingerprint = rng_fingerprint()
        if fingerprint is None:
            return None, capture_rng()
        kept_fingerprint, kept = self._kept
        if kept is None or fingerprint != kept_fingerprint:
            kept = capture_of(fingerprint, (kept_fingerprint, kept) if kept is not None else None)
            self._kept = (fingerprint, kept)
        return fingerprint, kept

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng(state)


class TrainState:
    """Named Stateful parts, saved and loaded as one mapping ``{name: part.state_dict()}``.

    Args:
        parts: ``{name: stateful}``; ``None`` values are skipped (an absent scheduler, say).
    Raises:
        TypeError: a part has no ``state_dict``/``load_state_dict`` (names it).
    """

    def __init__(self, parts: Mapping[str, Optional[Any]]):
        self.parts: dict[str, Any] = {}
        for name, part in parts.items():
            if part is None:
                continue
            if not isinstance(part, Stateful):
                raise TypeError(
                    f"training state {name!r} ({type(part).__name__}) needs state_dict() and load_state_dict()"
                )
            self.parts[name] = part

    def state_dict(self, names: Optional[Iterable[str]] = None) -> dict[str, Any]:
        """``{name: part.state_dict()}`` for every part (``names``: only those of them that exist)."""
        if names is None:
            return {name: part.state_dict() for name, part in self.parts.items()}
        return {name: self.parts[name].state_dict() for name in names if name in self.parts}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load every part whose name is in ``state`` (others are left as they are)."""
        for name, part in self.parts.items():
            if state.get(name) is not None:
                part.load_state_dict(state[name])
