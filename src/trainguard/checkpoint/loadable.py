"""A checkpoint is proven loadable when it is written: the first save of a process is checked
against what a resume would load, without loading it.

A resume loads a persistent checkpoint in three moves (:func:`~.io.load_state`): DCP reads into a
template of the live state (:func:`~.io.model_optim_state`, keyed as ``get_state_dict`` names
the model's and optimizer's tensors), ``set_state_dict`` puts the template into the model and the
optimizer, and this rank's own state is read with ``torch.load(weights_only=True)``. Each can
fail on a checkpoint that was written without complaint, and then every resume of the run fails,
long after the checkpoints were written: a wrapper whose ``state_dict`` keys are not the names the
load looks up (Lightning Fabric's ``_FabricModule`` over DDP saves ``net.0.weight`` and the load
looks for ``_forward_module.net.0.weight``), a state dict hook that renames keys, an
``extra_state`` entry that ``weights_only`` refuses.

:func:`check_persistent` runs each move's check on a committed checkpoint, reading its metadata
and this rank's small state file only (not the tensors):

1. the template against the saved metadata: every key the load reads is in the checkpoint, with
   the saved shape and dtype, and every saved model key is read; then DCP's own load plan
   (``DefaultLoadPlanner``, as ``dcp.load`` makes it) is made against the metadata;
2. the names ``set_state_dict`` looks up in the template (:func:`check_names`, torch's walk of the
   model through :func:`trainguard.compat.model_load_names`) are all in it;
3. this rank's state file loads with ``weights_only=True``.

The node-local tier holds the same template in one file per rank: :func:`check_names` applies.
A mismatch raises :class:`~.io.CheckpointMismatchError` naming the keys; the checkpointer turns
it into :class:`~trainguard.outcomes.BadInput` (exit 2), at the first save and before a load.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .. import compat
from ..outcomes import BadInput
from .io import CheckpointMismatchError, _with_saved_group_keys, model_optim_state, rank_file

log = logging.getLogger(__name__)

SHOWN = 4  # keys named per kind of mismatch (then "+N more")


def _named(keys: list[str]) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - SHOWN} more)" if len(keys) > SHOWN else ""
    return ", ".join(keys[:SHOWN]) + more


def check_names(model: torch.nn.Module, saved_model_keys: set[str]) -> None:
    """The names ``set_state_dict`` looks up to load ``model`` are in ``saved_model_keys`` (the
    model state's keys as ``get_state_dict`` wrote them, without the ``model.`` prefix). Nothing
    where torch lacks the members it takes (:func:`trainguard.compat.model_load_names`).

    Raises:
        CheckpointMismatchError: naming the keys looked up and not saved, and the saved keys
            nothing looks up.
    """
    names = compat.model_load_names(model)
    if names is None:
        return
    # set_state_dict looks a name up only where it differs from the model's own (a prefix left out)
    missing = [looked for looked, own in names if looked != own and looked not in saved_model_keys]
    if missing:
        unread = saved_model_keys - {looked for looked, _ in names}
        raise CheckpointMismatchError(
            f"the load looks for {_named(missing)}, which the save did not write"
            + (f" (it wrote {_named(list(unread))})" if unread else "")
            + f": {type(model).__name__}'s state_dict() keys are not the names its load looks up; give the Guard "
            "the module whose state_dict() names its parameters as its load does (under a framework's wrapper: "
            "the module it holds)"
        )


def check_template(state: dict[str, Any], metadata: Metadata, dtypes: bool = True) -> None:
    """The template ``state`` (:func:`~.io.model_optim_state`, with the saved group keys) against
    a checkpoint's DCP metadata, then DCP's load plan for it. ``dtypes=False``: another dtype is
    not a mismatch (DCP casts as it loads: a resume into a model of another precision).

    Raises:
        CheckpointMismatchError: naming the keys the load reads and the checkpoint lacks, those
            saved with another shape or dtype, the saved model keys the load would not read, or
            the planner's error.
    """
    planner = DefaultLoadPlanner()  # as dcp.load makes it
    try:
        planner.set_up_planner(state, metadata, False)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointMismatchError(f"DCP's load plan fails: {str(e).splitlines()[0]}") from None
    saved, flat = metadata.state_dict_metadata, planner.state_dict  # the template in DCP's flat keys
    problems = []
    absent = [k for k in flat if k not in saved]
    if absent:
        problems.append(f"the load reads {_named(absent)}, which the checkpoint does not hold")
    unread = [k for k in saved if k.startswith("model.") and k not in flat]
    if unread:
        problems.append(f"the checkpoint holds {_named(unread)}, which the load does not read")
    shapes, casts = [], []
    for key, value in flat.items():
        md = saved.get(key)
        if not (isinstance(value, torch.Tensor) and isinstance(md, TensorStorageMetadata)):
            continue
        if list(value.shape) != list(md.size):
            shapes.append(f"{key} saved {list(md.size)}, loaded into {list(value.shape)}")
        elif dtypes and md.properties.dtype is not None and md.properties.dtype != value.dtype:
            casts.append(f"{key} saved {md.properties.dtype}, loaded into {value.dtype}")
    for kind, found in (("shape", shapes), ("dtype", casts)):
        if found:
            more = f" (+{len(found) - SHOWN} more)" if len(found) > SHOWN else ""
            problems.append(f"another {kind}: {'; '.join(found[:SHOWN])}{more}")
    if problems:
        raise CheckpointMismatchError("; ".join(problems))
    try:
        planner.create_local_plan()
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointMismatchError(f"DCP's load plan fails: {str(e).splitlines()[0]}") from None


def check_persistent(
    path: Path,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    rank: Optional[int],
    dtypes: bool = True,
) -> None:
    """Whether the committed checkpoint ``path`` loads into ``model``/``optimizer`` as a resume
    loads it (see the module doc); reads its metadata and ``rank``'s state file (``None``: not
    read). ``dtypes``: as :func:`check_template` (``False`` before a resume).

    Raises:
        CheckpointMismatchError: naming what does not fit.
        OSError: the metadata or the state file cannot be read.
    """
    reader = FileSystemReader(path)
    metadata = reader.read_metadata()
    state = model_optim_state(model, optimizer)
    _with_saved_group_keys(state, reader)
    check_template(state, metadata, dtypes)
    check_names(model, set(state["model"]))
    if rank is None:
        return
    try:
        with open(path / rank_file(rank), "rb") as f:
            torch.load(f, weights_only=True)
    except OSError:
        raise
    except Exception as e:  # weights_only's refusal (an UnpicklingError naming the class)
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        first = next((line for line in lines if "Unsupported global" in line), lines[0]).split(" Please use")[0]
        raise CheckpointMismatchError(
            f"rank {rank}'s own state ({rank_file(rank)}: scheduler, sampler, extra_state, ...) does not load with "
            f"torch.load(weights_only=True): {first[:300]}; the state_dict() of each of them must hold tensors, "
            "numbers, strings, and lists, tuples and dicts of them"
        ) from None


def prove(
    step: int,
    checkpoint: Any,
    local_root: Optional[Path],
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    rank: int,
) -> None:
    """At the first committed save of this process: would a resume load it? ``checkpoint``: the
    persistent one committed (:class:`~.store.Checkpoint`, or ``None``); ``local_root``: the
    node-local tier's directory when only that tier saved. No collective: a process that joined
    the group later (a replacement, a rank grown back) proves its own first save while the others
    do not; every rank finds the same model mismatch (its own state file aside). A file that
    cannot be read just after its commit is logged and not refused (the resume will tell).

    Raises:
        BadInput: naming this rank and the keys.
    """
    try:
        if checkpoint is not None:
            check_persistent(checkpoint.path, model, optimizer, rank)
        elif local_root is not None:
            check_names(model, set(model_optim_state(model, None)["model"]))
    except CheckpointMismatchError as e:
        where = checkpoint.path if checkpoint is not None else f"the node-local tier, {local_root}"
        raise BadInput(
            f"the checkpoint of step {step} ({where}) was written, but a resume could not load it (rank {rank}): "
            f"{e}. Stopped now rather than at the first resume"
        ) from None
    except OSError as e:
        log.warning("the loadability check of step %d could not read it: %s", step, e)
