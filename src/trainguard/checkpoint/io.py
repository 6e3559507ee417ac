"""Saving and loading the training state of all ranks into one checkpoint directory.

Model and optimizer state go through ``torch.distributed.checkpoint`` (DCP) in fully-qualified
name form (``get_state_dict``), so DDP, FSDP2 and plain modules share one format and replicated
tensors are written once. Everything else a rank owns (step, scheduler, data position, RNG) is
saved by that rank as ``rank-NNNNN.pt`` and loaded with ``torch.load(weights_only=True)``.

Save protocol across ranks (all ranks call :func:`save_state` together):

1. rank 0 creates the temporary directory; barrier;
2. DCP writes the sharded tensors (files fsynced); each rank writes and fsyncs its rank file;
3. barrier; the files are split round-robin and each rank checksums its share; the lists are
   gathered on rank 0;
4. rank 0 writes the manifest and commits (rename); the result is broadcast, so every rank
   returns the same committed checkpoint or raises the same error.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .. import dist as tgdist
from ..rejoin.protocol import is_peer_failure
from . import manifest as mf
from .store import Checkpoint, CheckpointStore

# DCP warns on every single-process save/load that it assumes a single process: that is intended here
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit this model/optimizer/world size; the message names the first mismatching key."""


def rank_file(rank: int) -> str:
    """Name of a rank's own state file inside a checkpoint."""
    return f"rank-{rank:05d}.pt"


def model_optim_state(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` in fully-qualified-name form (``get_state_dict``): the
    tensors are the live parameters and optimizer states (no copy)."""
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    return state


def save_state(
    store: CheckpointStore,
    step: int,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    rank_state: dict[str, Any],
    meta: Optional[dict] = None,
) -> tuple[Checkpoint, int]:
    """Write and commit a checkpoint of the live state at ``step`` (see :func:`write_checkpoint`)."""
    return write_checkpoint(store, step, model_optim_state(model, optimizer), rank_state, meta)


def write_checkpoint(
    store: CheckpointStore,
    step: int,
    state: dict[str, Any],
    rank_state: dict[str, Any],
    meta: Optional[dict] = None,
    group: Any = None,
    write_files: Optional[Callable[[Path], None]] = None,
    refuse: Optional[str] = None,
) -> tuple[Checkpoint, int]:
    """Write and commit a checkpoint at ``step``; a collective: every rank must call it.

    Args:
        state: :func:`model_optim_state` of the live model, or a host snapshot of it.
        rank_state: this rank's non-tensor state (must load with ``weights_only=True``).
        meta: extra manifest fields (rank 0's value is used).
        group: the process group for the protocol's collectives (the background writer's own).
        write_files: called on every rank with the temporary directory after the state is written
            (no collective inside): the files it adds there are checksummed into the manifest and
            committed with the checkpoint (the Hugging Face Trainer's own files, :mod:`trainguard.hf`).
        refuse: why this rank's part must not be committed although it is written (a background
            copy whose sources changed during it): the collectives run as usual and every rank
            raises the ``OSError`` naming it.
    Returns:
        (the committed checkpoint, its total size in bytes).
    Raises:
        OSError: a write failed on some rank (then nothing is committed and older checkpoints stay).
    """
    rank, world = tgdist.rank(), tgdist.world_size()
    tmp = store.tmp_path_for(step)
    if rank == 0:
        store.begin(step)
    tgdist.barrier(group)
    error = None
    try:
        # DCP raises the same CheckpointException on every rank when any rank's write fails
        dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True), process_group=group)
        with open(tmp / rank_file(rank), "wb") as f:
            torch.save(rank_state, f)
            f.flush()
            os.fsync(f.fileno())
        if write_files is not None:
            write_files(tmp)
    except (
        OSError,
        RuntimeError,
        CheckpointException,
    ) as e:  # keep going to the collectives below: no rank is left waiting
        lost = peer_lost(e)
        if lost is not None:  # ...unless a peer is gone: the collectives below would wait on it
            raise lost from None
        error = f"rank {rank}: writing {tmp.name} failed: {_first_line(e)} ({_free(store.root)})"
    tgdist.barrier(group)
    error = error or refuse
    mine: dict[str, dict] = {}
    if error is None:
        try:
            names = sorted(p.name for p in tmp.iterdir() if p.is_file())
            mine = mf.describe_files(tmp, names[rank::world])
        except OSError as e:
            error = f"rank {rank}: checksumming failed: {e}"
    parts = tgdist.gather_objects((mine, error), group)
    result: Any = None
    if rank == 0:
        errors = [err for _, err in parts if err]
        files = {k: v for part, _ in parts for k, v in part.items()}
        body = {"world_size": world, "created": time.time(), **(meta or {})}
        try:
            result = "; ".join(errors) if errors else store.commit(tmp, step, files, body)
        except OSError as e:
            result = f"commit failed: {e}"
        if isinstance(result, str):
            shutil.rmtree(tmp, ignore_errors=True)  # free the space a failed write took (ENOSPC)
    result = tgdist.broadcast_object(result, group=group)
    if isinstance(result, str):
        raise OSError(result)
    total = sum(v["size"] for part, _ in parts for v in part.values())
    return result, total


def peer_lost(e: BaseException) -> Optional[BaseException]:
    """The lost-peer error in ``e`` (itself, or one a rank's DCP step failed with), else ``None``
    (see :func:`~trainguard.rejoin.protocol.is_peer_failure`). A save that lost a peer raises it, so
    that in-process recovery catches it at once (:meth:`Guard.save <trainguard.guard.Guard.save>`);
    a disk error instead goes on to the save's remaining collectives, where every rank learns of it."""
    if is_peer_failure(e):
        return e
    return next((c for c in _causes(e) if isinstance(c, BaseException) and is_peer_failure(c)), None)


def _causes(e: BaseException) -> list:
    """The underlying error of each failing rank of DCP's CheckpointException (else none)."""
    if not isinstance(e, CheckpointException):
        return []
    return [f[0] if isinstance(f, tuple) else getattr(f, "exception", f) for f in e.failures.values()]


def _first_line(e: BaseException) -> str:
    """A short form of an error (DCP's CheckpointException carries whole tracebacks per rank)."""
    if isinstance(e, CheckpointException):  # the underlying error of each failing rank
        return "; ".join(f"{type(c).__name__}: {c}".splitlines()[0][:300] for c in _causes(e)) or "CheckpointException"
    text = str(e)
    for marker in ("OSError", "No space left", "Errno"):
        at = text.find(marker)
        if at >= 0:
            return text[at:].splitlines()[0][:500]
    return text.splitlines()[0][:500] if text else type(e).__name__


def _free(root: Path) -> str:
    """``"N bytes free in ROOT"``: a full disk often surfaces as another error (torch's zip writer
    reports ENOSPC as "unexpected pos"), so every write error says how much space is left."""
    try:
        return f"{shutil.disk_usage(root).free} bytes free in {root}"
    except OSError:
        return f"free space in {root} unknown"


def apply_state(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], state: dict[str, Any]) -> None:
    """Load ``{"model", "optim"}`` (as made by :func:`model_optim_state`) into the live objects."""
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )


def _with_saved_group_keys(state: dict[str, Any], reader: FileSystemReader) -> None:
    """Add to ``state``'s optimizer parameter groups the entries the checkpoint holds and the live
    optimizer lacks (``initial_lr``, which a learning-rate scheduler adds when it is built: a script
    that builds its scheduler after the resume, from the resumed step, needs the saved one), so that
    ``dcp.load`` (which reads only what its template names) brings them back as
    ``Optimizer.load_state_dict`` would."""
    groups = state.get("optim", {}).get("param_groups")
    if not groups:
        return
    for key in reader.read_metadata().state_dict_metadata:
        parts = key.split(".")
        if len(parts) == 4 and parts[:2] == ["optim", "param_groups"] and parts[2].isdigit():
            index, name = int(parts[2]), parts[3]
            if index < len(groups) and name not in groups[index]:
                groups[index][name] = None  # filled by dcp.load


def saved_world_size(path: Path) -> Optional[int]:
    """The number of ranks that wrote the committed checkpoint ``path`` (``None``: not recorded)."""
    return mf.read_manifest(path).get("meta", {}).get("world_size")


def check_compatible(path: Path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
    """Refuse a checkpoint written for another model (any world size fits: DCP reshards the model
    and optimizer, see :mod:`trainguard.state.reshard` for the rest).

    Compares the model's keys and tensor shapes with the DCP metadata, in sorted key order.

    Raises:
        CheckpointMismatchError: naming the first key that is missing, unexpected, or of another shape.
    """
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    ours = model_optim_state(model, None)["model"]
    want = {f"model.{k}": list(v.shape) for k, v in ours.items() if isinstance(v, torch.Tensor)}
    have = {
        k: list(m.size) for k, m in saved.items() if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    for key in sorted(set(want) | set(have)):
        if key not in have:
            raise CheckpointMismatchError(
                f"checkpoint {path} does not fit this model: key '{key[6:]}' is missing from the checkpoint"
            )
        if key not in want:
            raise CheckpointMismatchError(
                f"checkpoint {path} does not fit this model: key '{key[6:]}' is in the checkpoint but not in the model"
            )
        if want[key] != have[key]:
            raise CheckpointMismatchError(
                f"checkpoint {path} does not fit this model: key '{key[6:]}' has shape {have[key]} in the checkpoint, {want[key]} in the model"
            )


def load_state(
    path: Path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], rank: Optional[int] = None
) -> dict[str, Any]:
    """Load a committed checkpoint into ``model``/``optimizer`` and return the ``rank_state`` of
    ``rank`` (default this rank; rank 0's after a world-size change).

    Call :func:`check_compatible` first for a clear error on a mismatching model.

    Raises:
        FileNotFoundError: the checkpoint has no state file for this rank.
    """
    state = model_optim_state(model, optimizer)
    reader = FileSystemReader(path)
    _with_saved_group_keys(state, reader)
    dcp.load(state, storage_reader=reader)
    apply_state(model, optimizer, state)
    with open(path / rank_file(tgdist.rank() if rank is None else rank), "rb") as f:
        return torch.load(f, weights_only=True)
