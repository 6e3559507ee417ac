"""Rebuilding the process groups in a live process, and moving state from survivors' memory.

DDP's private members that this needs are reached through :mod:`trainguard.compat` (which lists
and checks them). A DDP model keeps its module, parameters and hooks; only its reducer (the object that buckets and
all-reduces gradients) is built again on the new default group, exactly as DDP's constructor builds
it, so the survivors and a freshly started replacement hold reducers in the same state (both
rebuild their buckets after the first step, as at a start).
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import compat, console
from . import sharded
from .boundary import decode, encode
from .catch import is_own_hook
from .protocol import Generation
from .stores import init_on_file


class RegroupError(RuntimeError):
    """In-process recovery cannot rebuild this model or group (the message says why); the caller
    falls back to a group restart."""


class RecoveryRefused(RegroupError):
    """A survivor refused to do an interrupted step again before anything of its state was touched
    (a data position that cannot be taken back): its state is still the last completed step's,
    which a just-in-time save may keep. (A recovery that failed after its meeting raises
    :class:`RegroupError` or another error: its state is not trusted for that save.)"""


def missing_ddp_members(model: Optional[torch.nn.Module] = None) -> list[str]:
    """The private DDP members :func:`rebind_ddp` needs that the installed torch lacks (with
    ``model``: also on it), as ``"DistributedDataParallel.x"`` (:func:`trainguard.compat.missing_ddp`)."""
    return compat.missing_ddp(model)


def rebuild_default_group(gen: Generation, backend: str, timeout: float, **options: Any) -> None:
    """Destroy this process's groups and create the default group of generation ``gen`` on its store.

    The group is created the way a replacement's script creates it, so both sides name their keys
    alike: on one node on the generation's ``FileStore`` (``store=``, :attr:`Generation.path`; the
    replacement runner changes the script's call so, :func:`~.stores.init_on_file`); across nodes
    with ``env://``, ``MASTER_ADDR``/``MASTER_PORT`` set to the generation's store, as a client of
    it (``TORCHELASTIC_USE_AGENT_STORE``). ``RANK`` and ``WORLD_SIZE`` stay this process's.

    Args:
        timeout: seconds for the group's collectives and for meeting the other ranks.
        options: more keyword arguments for ``init_process_group`` (NCCL's eager creation:
            :func:`~trainguard.rejoin.abort.init_options`).
    Raises:
        RuntimeError, torch.distributed.DistError: the group could not be formed (a peer did not come).
    """
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
            gc.collect()
        except RuntimeError:  # a group whose peer is gone may fail to shut down cleanly: drop it anyway
            pass
    if gen.path:  # one node: the generation's store is a file (as the replacement runner gives a newcomer's call)
        args, kwargs = init_on_file(
            Path(gen.path), timeout, (backend,), {"timeout": timedelta(seconds=timeout), **options}
        )
        dist.init_process_group(*args, **kwargs)
        return
    os.environ.update(
        {"MASTER_ADDR": gen.host, "MASTER_PORT": str(gen.port), "TORCHELASTIC_USE_AGENT_STORE": str(True)}
    )
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout), **options)


def release_ddp(model: torch.nn.Module) -> None:
    """Drop a DDP model's references to its process group (its reducer and logger), so that the
    group's connections close once it is destroyed: a survivor still waiting in a collective
    with this rank then sees it end (gloo keeps a group's connections open while any object holds
    it). :func:`rebind_ddp` builds them again on the new group."""
    if isinstance(model, DDP):
        model.reducer = None
        model.logger = None
        model.process_group = None


def check_rebindable(model: torch.nn.Module) -> None:
    """Raise before a recovery starts if ``model`` cannot be moved to a new group in-process.

    Raises:
        RegroupError: a DDP model on a process group of part of the ranks (the script's groups
            cannot be rebuilt), DTensor parameters that FSDP2 cannot be re-bound for (tensor parallelism, a
            slice of a larger mesh: :func:`~trainguard.rejoin.sharded.why_not_rebindable`), torch
            does not list DDP's communication hooks, or lacks a DDP member used here. (A hook of
            the script's own is taken over by trainguard's, which the rebuilt reducer keeps.)
    """
    why = sharded.why_not_rebindable(model)
    if why is not None:
        raise RegroupError(why)
    if isinstance(model, DDP) and model.process_group.size() != dist.get_world_size():
        raise RegroupError(
            f"the model's DDP trains on a process group of {model.process_group.size()} of "
            f"{dist.get_world_size()} ranks; in-process recovery rebuilds only the default group and "
            "cannot rebuild the script's own groups"
        )
    missing = missing_ddp_members(model) if isinstance(model, DDP) else []
    if missing:
        raise RegroupError(f"torch {torch.__version__} lacks {', '.join(missing)}: in-process recovery of DDP")
    if isinstance(model, DDP) and compat.ddp_comm_hooks(model) is None:
        raise RegroupError(
            f"torch {torch.__version__} does not list DDP's communication hooks: in-process recovery cannot "
            "carry one over"
        )


def script_comm_hook(model: DDP) -> bool:
    """Whether the script registered a communication hook of its own on ``model`` (not trainguard's;
    where torch does not list the hooks, assumed: in-process recovery cannot see one to carry over)."""
    hooks = compat.ddp_comm_hooks(model)
    return hooks is None or any(not is_own_hook(hook) for hook, _ in hooks)


def rebind_ddp(model: torch.nn.Module, layout: Optional[list[list[int]]] = None) -> None:
    """Give a DDP-wrapped ``model`` a fresh reducer on the (new) default group, with trainguard's
    communication hook again if it had it; other models: nothing.

    Args:
        layout: the bucket layout the reducer starts with (``[[parameter index, ...] per bucket]``,
            :attr:`~trainguard.rejoin.catch.DDPHook.layout`): the one the reducer it replaces had,
            so that the gradients' sums round as before (with three or more ranks, where each
            gradient sits in a bucket decides the order of the sum). ``None``: DDP's initial layout.
    Raises:
        RegroupError: the model has communication hooks, or torch lacks a member used here
            (:func:`trainguard.compat.missing_ddp`).
    """
    if not isinstance(model, DDP):
        return
    missing = missing_ddp_members(model)
    if missing:
        raise RegroupError(f"torch {torch.__version__} lacks {', '.join(missing)}: in-process recovery of DDP")
    if script_comm_hook(model):
        raise RegroupError("a DDP communication hook is registered: in-process recovery cannot carry it over")
    own = compat.ddp_comm_hooks(model) or []
    # the model's own group is the new default group: check_rebindable refused, at start, every DDP
    # whose group is not all the ranks (the script's sub-groups cannot be rebuilt by trainguard)
    model.process_group = dist.group.WORLD
    if not compat.rebuild_reducer(model, layout) and layout:
        console.say(
            f"torch {torch.__version__} lacks torch.distributed._compute_bucket_assignment_by_size: the rebuilt "
            "DDP reducer starts with DDP's initial bucket layout (with 3 or more ranks its sums may round "
            "differently from before the recovery)"
        )
    compat.clear_comm_hooks(model)
    for hook, state in own:  # the class's method: the instance's intercepts the script's (InProcess.hook_ddp)
        DDP.register_comm_hook(model, state, hook)
        hook.__self__.rebuilt()  # trainguard's DDPHook, carrying the script's hook if it took one over


def _broadcast_bytes(blob: Optional[bytes], src: int) -> bytes:
    """``blob`` of global rank ``src`` on every rank (two broadcasts: its length, its bytes)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    size = torch.tensor([len(blob) if blob is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    if blob is not None:
        buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src)
    return buf.cpu().numpy().tobytes()


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by ``("__tensor__", index)`` (the tensor appended to ``tensors``)."""
    if torch.is_tensor(obj):
        tensors.append(obj)
        return (
            "__tensor__",
            len(tensors) - 1,
            tuple(obj.shape),
            str(obj.dtype).removeprefix("torch."),
            str(obj.device),
        )
    if isinstance(obj, dict):
        return {k: _split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, tensors) for v in obj)
    return obj


def _join(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, tuple) and len(obj) == 5 and obj[0] == "__tensor__":
        return tensors[obj[1]]
    if isinstance(obj, dict):
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_join(v, tensors) for v in obj)
    return obj


def _empty_like_meta(meta: Any, out: list[torch.Tensor]) -> None:
    if isinstance(meta, tuple) and len(meta) == 5 and meta[0] == "__tensor__":
        out.append(torch.empty(meta[2], dtype=getattr(torch, meta[3]), device=meta[4]))
    elif isinstance(meta, dict):
        for v in meta.values():
            _empty_like_meta(v, out)
    elif isinstance(meta, (list, tuple)):
        for v in meta:
            _empty_like_meta(v, out)


def transfer_state(
    model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], src: int, packet: Optional[dict]
) -> tuple[dict, int]:
    """Broadcast the model, the optimizer and a small ``packet`` from global rank ``src`` (a collective).

    Nothing received is unpickled as such: the packet and the optimizer's structure travel as a
    step-boundary blob (:func:`~.boundary.encode`: built-in values and raw tensor bytes, read back
    by an unpickler that refuses every class, or ``torch.load(weights_only=True)``), the tensors
    as tensors.

    On ``src`` the tensors are sent from memory; every other rank receives them: the model's
    parameters and buffers in place, the optimizer's state through ``load_state_dict``. Ranks
    that held the same values (surviving data-parallel replicas) end with the same bits.

    Args:
        packet: on ``src``, picklable values to send along (the step, the hosts); ignored elsewhere.
    Returns:
        ``(packet, bytes)``: the packet as sent and the tensor bytes moved.
    """
    rank = dist.get_rank()
    opt_tensors: list[torch.Tensor] = []
    blob = None
    if rank == src:
        blob = encode(
            {"packet": packet, "optimizer": _split(optimizer.state_dict(), opt_tensors) if optimizer else None}
        )
    meta = decode(_broadcast_bytes(blob, src))
    if rank != src and meta["optimizer"] is not None:
        _empty_like_meta(meta["optimizer"], opt_tensors)
    moved = 0
    with torch.no_grad():
        for t in list(model.state_dict().values()) + opt_tensors:
            dist.broadcast(t, src)
            moved += t.numel() * t.element_size()
    if rank != src and optimizer is not None and meta["optimizer"] is not None:
        optimizer.load_state_dict(_join(meta["optimizer"], opt_tensors))
    return meta["packet"], moved
