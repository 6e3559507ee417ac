"""A rank's side of the just-in-time save (:mod:`trainguard.checkpoint.jit`): the last completed
step, written from memory when the group is about to restart.

At every step boundary (the end of ``guard.step_end``, after the boundary's own saves) this rank
keeps what a checkpoint of that step holds besides the parameters and optimizer states: its rank
state, encoded into a node-local slot file (:class:`~trainguard.rejoin.boundary.BoundaryState`,
copy-on-change: tens of microseconds a step) that outlives the process, so the launcher can make a
lost rank's copy from it; a copy of the module's buffers (a forward changes them); and the in-place
version counter of every parameter and optimizer state. The parameters and optimizer states are
not copied: they change only in ``optimizer.step()``.

A save (:meth:`JitSave.save`) is asked for in two ways: the launcher writes ``request.json`` into
the attempt's ``jit`` directory before it restarts the group (a thread of this rank's polls for it
every 20 ms, so a main thread stuck in a collective does not stop it), or this rank's main thread
leaves on a lost peer (the uncaught error; ``Guard.__exit__``). The save checks the version
counters first: a parameter or optimizer state changed since the boundary (the next step's
``optimizer.step()`` began: the state is no longer the boundary's, perhaps torn) gives no copy,
and so does one changed during the copy. An edit through ``.data`` is not counted: the contract is
the asynchronous save's, no in-place edit of parameters outside ``optimizer.step()``; the launcher
also compares the survivors' model files, which replicas hold alike. A save that outlasts its bound
(2 s + 3 × the run's measured checkpoint write time, at most ``[checkpoint.jit] timeout``) is
abandoned before its commit: never half-visible. The outcome goes into ``result-RANK.json`` for
the launcher (:mod:`trainguard.launcher.jit`).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .. import compat
from ..atomic import write_atomic
from ..checkpoint.jit import EARLY, MODEL_FILE, REQUEST, JitStore, result_path
from ..checkpoint.local import serialize
from ..checkpoint.manifest import read_manifest
from ..rejoin.boundary import BoundaryState, decode
from .keeper import equal

POLL_SECONDS = 0.02  # how often the thread looks for the launcher's request


class JitSave:
    """Keeps this rank's part of the last completed step and writes it on request.

    Args:
        directory: the attempt's node-local ``jit`` directory (the launcher's request, this rank's
            result and its boundary slot files).
        store: where copies are committed (:class:`~trainguard.checkpoint.jit.JitStore`).
        rank, world_size: this rank and the group's size (written into the copy's manifest).
        model, optimizer: the script's replicated model and its optimizer (``None``: none).
        rank_state: this rank's rank state now (``Guard.rank_state()``).
        local_state: the parts of it only this rank holds (:data:`~trainguard.rejoin.rank.LOCAL_PARTS`).
        in_progress: the number of the step being run (1-based).
        bound: the seconds a save may take before it is given up (called at the save).
    """

    def __init__(
        self,
        directory: Path,
        store: JitStore,
        rank: int,
        world_size: int,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        rank_state: Callable[[], dict[str, Any]],
        local_state: Callable[[], dict[str, Any]],
        in_progress: Callable[[], int],
        bound: Callable[[], float],
    ):
        self.directory, self.store, self.rank, self.world_size = directory, store, rank, world_size
        self.model, self.optimizer, self.rank_state, self.bound = model, optimizer, rank_state, bound
        self.local_state, self.in_progress = local_state, in_progress
        (directory / EARLY).mkdir(parents=True, exist_ok=True, mode=0o700)
        self.kept = BoundaryState(directory, rank, stable=("rng",))
        # this rank's own parts as the update of a step begins (its last gradient bucket was sent: a
        # peer may complete the step without it), in case it is lost before the step's boundary
        self.early = BoundaryState(directory / EARLY, rank, stable=("rng",))
        self._still: dict[int, bool] = {}  # step -> its own parts did not move between the update and the boundary
        self._early: Optional[tuple[int, dict[str, Any]]] = None  # (step, own parts) as its update began
        self._hook = optimizer.register_step_pre_hook(self._before_update) if optimizer is not None else None
        self.step: Optional[int] = None  # the boundary kept last
        self._params = list(model.parameters())  # (walking the module each step costs ~0.2 ms)
        self._buffer_src = list(model.named_buffers())
        self._tensors: list[torch.Tensor] = []  # parameters and optimizer states, in a fixed order
        self._versions: list[int] = []
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._done: Optional[int] = None  # the step saved (or given up) already
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="trainguard-jit", daemon=True)
        self._thread.start()

    # ---- at each step boundary (main thread) ---------------------------------------------------

    def _before_update(self, *_: Any) -> None:
        """Optimizer step pre-hook: keep this rank's own parts as those of the step's boundary."""
        step = self.in_progress()
        if self.early.step != step:  # (an update retried within the step keeps the first)
            own = self.local_state()
            self._early = (step, own)
            self.early.keep({"step": step, **own})

    def mark(self, completed: int) -> None:
        """``completed`` steps are done and the boundary's work too: keep this rank's part of it (a rank
        lost before this is made of what it kept as its update began). About 0.1 ms.
        Under the save's lock (uncontended but while a save runs): a save never reads half a mark."""
        with self._lock:
            self._mark(completed)

    def _mark(self, completed: int) -> None:
        state = self.rank_state()
        self.kept.keep(state)
        if completed == self.step:
            return
        if self._early is not None and self._early[0] == completed:  # did the loop move its own parts since?
            then = self._early[1]
            self._still = {
                completed: all(k in state and (state[k] is v or equal(state[k], v)) for k, v in then.items())
            }
        self._tensors = self._watched(self._params)
        self._versions = [compat.tensor_version(t) for t in self._tensors]
        self._buffers = {n: b.detach().clone() for n, b in self._buffer_src}
        self.step = completed

    def _watched(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        tensors = list(params)
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return tensors

    def _moved(self) -> bool:
        now = self._watched(list(self.model.parameters()))
        return len(now) != len(self._tensors) or any(
            a is not b or compat.tensor_version(a) != v for a, b, v in zip(now, self._tensors, self._versions)
        )

    # ---- the save (the request thread, or the main thread on its way out) -----------------------

    def save(self, why: str) -> dict[str, Any]:
        """Write this rank's copy of the last completed step (once per step) and its result file.

        Returns:
            The result: ``{"rank", "step", "model": checksum, "seconds", "why"}`` or ``{"rank",
            "none": reason}``. Never raises: a failed save is a result without a copy.
        """
        with self._lock:
            step = self.step
            if self._done is not None and self._done == step:
                return self._read_result()
            t0 = time.monotonic()
            try:
                result = self._save(step, t0 + self.bound(), why)
            except Exception as e:  # noqa: BLE001 (a disk error, a state that will not serialize)
                result = {"none": f"{type(e).__name__}: {e}"}
            result = {"rank": self.rank, **result, "seconds": round(time.monotonic() - t0, 4)}
            write_atomic(result_path(self.directory, self.rank), json.dumps(result))
            self._done = step
            return result

    def _save(self, step: Optional[int], deadline: float, why: str) -> dict[str, Any]:
        if step is None:
            return {"none": "no step completed in this attempt"}
        if self._moved():
            return {"none": f"the parameters or optimizer states changed since step {step} (its update began)"}
        state = {"model": self._model_state()}
        if self.optimizer is not None:
            state["optim"] = self.optimizer.state_dict()
        data = serialize(_to_host(state))
        if self._moved():
            return {"none": f"the parameters or optimizer states changed during the copy of step {step}"}
        if time.monotonic() > deadline:
            return {"none": f"the copy took longer than its bound ({self.bound():.1f} s)"}
        rank_state = decode(self.kept.kept[step])
        meta = {"world_size": self.world_size, "rank": self.rank, "reason": why}
        ckpt = self.store.write(self.rank, step, data, rank_state, meta, deadline=deadline)
        checksum = read_manifest(ckpt.path)["files"][MODEL_FILE]["xxh3_128"]
        # whether a lost rank's parts kept as its update began are its boundary's (the same loop did not move them here)
        still = self._still.get(step, False)
        return {"step": step, "model": checksum, "path": str(ckpt.path), "why": why, "still_after_update": still}

    def _model_state(self) -> dict[str, Any]:
        """The module's state dict with its buffers as kept at the boundary (not as the next step's
        forward left them)."""
        sd = self.model.state_dict()
        return {k: self._buffers.get(k, v) for k, v in sd.items()}

    def _read_result(self) -> dict[str, Any]:
        try:
            return json.loads(result_path(self.directory, self.rank).read_text())
        except (OSError, ValueError):
            return {"rank": self.rank, "none": "the result of the earlier save is unreadable"}

    def _watch(self) -> None:
        request = self.directory / REQUEST
        while not self._stop.wait(POLL_SECONDS):
            if request.exists():
                self.save("the launcher restarts the group")
                return

    # ---- leaving -------------------------------------------------------------------------------

    def close(self, failed: bool = False) -> None:
        """Stop the request thread; ``failed``: this rank leaves on a failure, its slot files stay
        (the launcher makes its copy from them)."""
        self._stop.set()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if not failed:
            self.kept.close()
            self.early.close()


def _to_host(state: Any) -> Any:
    """``state`` with every CUDA tensor copied to host memory on a stream of its own (the main
    stream may be blocked by a collective that never returns)."""
    tensors = []

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor) and v.is_cuda:
            tensors.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(state)
    if not tensors:
        return state
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        host = {id(t): t.to("cpu", non_blocking=True) for t in tensors}
    stream.synchronize()

    def swap(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and id(v) in host:
            return host[id(v)]
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(swap(x) for x in v)
        return v

    return swap(state)
