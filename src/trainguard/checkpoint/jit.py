"""Just-in-time copies: the last completed step, saved from memory when a group restarts.

When the launcher restarts the group after a lost or hung rank, every survivor still holds the
state of the last completed step (Gupta et al., "Just-In-Time Checkpointing", EuroSys 2024): its
model and optimizer are untouched until the next ``optimizer.step()``, and its own rank state was
kept at that step's boundary. Each survivor writes that state here; the launcher then makes each
lost rank's copy from a survivor's model file (a replicated model: every rank holds the same) and
the rank state the lost rank kept at that boundary in its node-local file. The restarted group
resumes from these copies when every rank has one of the same step, newer than the newest
checkpoint. One directory per rank, under the persistent store (a shared file system, so a
restarted rank finds its copy on any node)::

    CHECKPOINTS/jit/rank-00001/step-00000125/{model.pt, rank.pt, manifest.json}

``model.pt``: ``{"model": model.state_dict(), "optim": optimizer.state_dict()}`` of the module
the script handed the Guard (a replicated model only: DDP or a plain module); ``rank.pt``: the
rank state a checkpoint holds (``Guard.rank_state()``). Both load with ``torch.load(weights_only=True)``.
Each copy goes through the store's commit protocol (temporary directory, manifest with XXH3-128
checksums, atomic rename): complete and verifiable, or invisible. The manifest's ``meta`` names the
run (its id), the world size and, for a composed copy, the survivor it came from.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch

from . import manifest as mf
from .local import deserialize, serialize
from .store import Checkpoint, CheckpointStore

MODEL_FILE = "model.pt"
RANK_FILE = "rank.pt"
DIRNAME = "jit"
# the attempt's node-local jit directory, shared by the ranks and their launcher
REQUEST = "request.json"  # the launcher's request (a rank's thread polls for it)
EARLY = "early"  # the subdirectory of the rank-state slot files kept as each update begins


def result_path(directory: Path, rank: int) -> Path:
    """Where rank ``rank`` writes the outcome of its just-in-time save in the attempt's ``directory``."""
    return directory / f"result-{rank}.json"


class JitStore:
    """The just-in-time copies of one run, under ``root`` (``CHECKPOINTS/jit``).

    Args:
        root: the directory of the copies (one store per rank below it).
    """

    def __init__(self, root: Path):
        self.root = Path(root)

    def of(self, rank: int) -> CheckpointStore:
        """Rank ``rank``'s store (its newest copy only is kept)."""
        return CheckpointStore(self.root / f"rank-{rank:05d}", keep_last=1)

    def _begin(self, store: CheckpointStore, step: int) -> Path:
        self.root.parent.mkdir(exist_ok=True, mode=0o700)  # the checkpoint directory, before its first save
        self.root.mkdir(exist_ok=True, mode=0o700)  # (the store makes its own directory 0700, not its parent)
        return store.begin(step)

    def write(
        self,
        rank: int,
        step: int,
        model_bytes: bytes,
        rank_state: dict[str, Any],
        meta: dict,
        deadline: Optional[float] = None,
    ) -> Checkpoint:
        """Commit rank ``rank``'s copy of ``step``: ``model_bytes`` (a :func:`serialize` of
        ``{"model", "optim"}``) and its rank state. An older copy of the rank goes.

        Args:
            deadline: ``time.monotonic()`` after which the copy is given up instead of committed.
        Raises:
            OSError: a write failed (nothing of this step is visible then).
            TimeoutError: the files were written after ``deadline`` (nothing is visible then).
        """
        store = self.of(rank)
        tmp = self._begin(store, step)
        try:
            _write(tmp / MODEL_FILE, model_bytes)
            _write(tmp / RANK_FILE, serialize(rank_state))
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the copy of step {step} was written after its deadline: given up")
            return self._commit(store, tmp, step, meta)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def compose(self, lost: int, source: Checkpoint, rank_state: dict[str, Any], meta: dict) -> Checkpoint:
        """Commit lost rank ``lost``'s copy of ``source.step``: the survivor's model file of
        ``source`` (a hard link where the file system allows, else a copy) with ``rank_state``,
        the state the lost rank kept at that step's boundary.

        Raises:
            OSError: a write failed (nothing of this step is visible for ``lost`` then).
        """
        store = self.of(lost)
        tmp = self._begin(store, source.step)
        try:
            try:
                os.link(source.path / MODEL_FILE, tmp / MODEL_FILE)
            except OSError:
                shutil.copyfile(source.path / MODEL_FILE, tmp / MODEL_FILE)
            _write(tmp / RANK_FILE, serialize(rank_state))
            return self._commit(store, tmp, source.step, meta)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @staticmethod
    def _commit(store: CheckpointStore, tmp: Path, step: int, meta: dict) -> Checkpoint:
        old = store.path_for(step)
        if old.exists():  # a copy of this step from an earlier failure: replaced (invisible from the rename)
            trash = store.root / f".trash-{old.name}-{time.time_ns()}"
            old.rename(trash)
            shutil.rmtree(trash, ignore_errors=True)
        ckpt = store.commit(tmp, step, mf.describe_files(tmp, [MODEL_FILE, RANK_FILE]), meta)
        store.apply_retention(protect={step})
        return ckpt

    def steps(self, rank: int, verify: str, world_size: int) -> list[int]:
        """The steps of rank ``rank``'s copies that verify and were made for this world size."""
        store, found = self.of(rank), []
        for ckpt in store.committed():
            if store.check(ckpt, verify) is not None:
                continue
            meta = mf.read_manifest(ckpt.path)["meta"]
            if meta.get("world_size") == world_size:
                found.append(ckpt.step)
        return found

    def load(self, rank: int, step: int) -> dict[str, Any]:
        """Rank ``rank``'s copy of ``step``: ``{"model", "optim", "rank"}``."""
        path = self.of(rank).path_for(step)
        state = torch.load(path / MODEL_FILE, weights_only=True)
        state["rank"] = deserialize((path / RANK_FILE).read_bytes())
        return state

    @staticmethod
    def rank_state(ckpt: Checkpoint) -> dict[str, Any]:
        """The rank state of the copy ``ckpt``."""
        return deserialize((ckpt.path / RANK_FILE).read_bytes())

    def path(self, rank: int, step: int) -> Path:
        """Rank ``rank``'s directory of ``step``."""
        return self.of(rank).path_for(step)

    def discard(self, rank: int, keep: Optional[int] = None, newer_than: Optional[int] = None, why: str = "") -> None:
        """Remove rank ``rank``'s copies at or before ``keep`` (a checkpoint of a step at least as
        new committed: they will never be chosen), or set aside those newer than ``newer_than``
        (a rollback abandoned their trajectory)."""
        store = self.of(rank)
        for c in store.committed():
            if keep is not None and c.step <= keep:
                shutil.rmtree(c.path, ignore_errors=True)
            elif newer_than is not None and c.step > newer_than:
                store.set_aside(c, why, kind="rolledback")


def apply(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], state: dict[str, Any]) -> None:
    """Load a copy's ``{"model", "optim"}`` into the live module and optimizer.

    Raises:
        RuntimeError: a key is missing or unexpected, or a tensor's shape differs (torch's message).
        ValueError: the optimizer's parameter groups differ (torch's message).
    """
    model.load_state_dict(state["model"])
    if optimizer is not None and "optim" in state:
        optimizer.load_state_dict(state["optim"])


def choose(steps: list[list[int]]) -> Optional[int]:
    """The newest step of which every rank has a copy (``steps[r]``: rank ``r``'s verified copies), or ``None``."""
    common = set(steps[0]) if steps else set()
    for s in steps[1:]:
        common &= set(s)
    return max(common, default=None)


def _write(path: Path, data: bytes) -> None:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
