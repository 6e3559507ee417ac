"""Moving an FSDP2 model (``fully_shard``, a 1-D mesh or HSDP's 2-D mesh) to a new process group in
a live process.

An FSDP2 model keeps its parameters as DTensors on a :class:`~torch.distributed.device_mesh.DeviceMesh`;
the mesh names its process groups (one per mesh dimension) and FSDP's per-group ``mesh_info``
holds the groups it resolved at ``fully_shard``. After the default group is built again
(:func:`~trainguard.rejoin.regroup.rebuild_default_group`), :func:`rebind` makes the mesh's
groups again, exactly as ``init_device_mesh`` makes them on a replacement that runs the script
from its top (same shape, same dimension names, same order of group creation), points the old
mesh at them, and has FSDP resolve its groups again. The parameters, their shards, the optimizer
and its state stay where they are.

FSDP2's and the mesh's private members are reached through :mod:`trainguard.compat` (which lists
them; :func:`missing_members` checks them on the model's objects before a recovery relies on them):

* ``DeviceMesh._dim_group_names``, ``DeviceMesh._pg_registry``, ``DeviceMesh._get_root_mesh``:
  the names of the mesh's groups, the registry ``get_group`` reads under ``torch.compile``, and
  the mesh a slice was cut from;
* ``FSDPModule._get_fsdp_state()._fsdp_param_groups`` (and the state's ``_is_root``), each group's
  ``mesh_info``, ``post_forward_mesh_info`` and ``fsdp_params`` (each with its own ``mesh_info``
  and ``sharded_param``): the objects whose ``__post_init__`` resolves ``shard_process_group`` /
  ``replicate_process_group`` from the mesh. (A separate reduce-scatter group set by
  ``set_separate_reduce_scatter_group`` is dropped: FSDP then reduce-scatters on the shard group.)

A step that failed mid-forward or mid-backward leaves FSDP's per-iteration state undefined; the
public ``FSDPModule.reset_iter_state()`` (torch 2.13) puts it back (:func:`reset`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from .. import compat


def _fsdp_module_class() -> Optional[type]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover  (torch without FSDP2)
        return None
    return FSDPModule


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` (itself included) that ``fully_shard`` made FSDP modules, outermost first."""
    cls = _fsdp_module_class()
    return [m for m in model.modules() if cls is not None and isinstance(m, cls)]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (FSDP2, tensor parallelism)."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def _param_groups(model: torch.nn.Module) -> Iterator[Any]:
    for m in fsdp_modules(model):
        yield from compat.fsdp_param_groups(m)


def _mesh_infos(model: torch.nn.Module) -> list[Any]:
    """Every distinct ``mesh_info`` object FSDP holds for ``model``."""
    seen: dict[int, Any] = {}
    for group in _param_groups(model):
        infos = [group.mesh_info, group.post_forward_mesh_info]
        for p in group.fsdp_params:
            infos += [p.mesh_info, getattr(p, "post_forward_mesh_info", None)]
        for info in infos:
            if info is not None:
                seen.setdefault(id(info), info)
    return list(seen.values())


def missing_members(model: torch.nn.Module) -> list[str]:
    """The private members this module uses that the installed torch lacks on ``model``'s FSDP
    modules and meshes (empty: all there; :func:`trainguard.compat.missing_fsdp`)."""
    mods = fsdp_modules(model)
    missing = compat.missing_fsdp(mods, [])
    return missing or compat.missing_fsdp([], [info.mesh for info in _mesh_infos(model)])


def why_not_rebindable(model: torch.nn.Module) -> Optional[str]:
    """Why a sharded ``model`` cannot be moved to a new group in-process; ``None``: it can (or it
    is not sharded). Refused: DTensor parameters that FSDP2 does not manage (tensor parallelism),
    a mesh that is a slice of a larger mesh, a torch without the members used here."""
    if not is_sharded(model):
        return None
    missing = missing_members(model)  # first: what follows reads them
    if missing:
        return f"torch {torch.__version__} lacks {', '.join(missing)}: in-process recovery of FSDP2"
    managed = {id(fp.sharded_param) for g in _param_groups(model) for fp in g.fsdp_params}
    if not fsdp_modules(model) or any(
        type(p).__name__ == "DTensor" and id(p) not in managed for p in model.parameters()
    ):
        return "DTensor parameters outside FSDP2 (tensor parallelism): in-process recovery re-binds DDP and FSDP2 only"
    for info in _mesh_infos(model):
        if not compat.mesh_is_root(info.mesh):
            return "FSDP2 on a slice of a larger device mesh: in-process recovery re-binds whole meshes only"
    return None


def rebind(model: torch.nn.Module) -> None:
    """After the default group was built again: make each FSDP2 mesh's groups again on it (a
    collective, in the order ``init_device_mesh`` makes them), point the mesh and FSDP at them,
    and reset FSDP's per-iteration state (:func:`reset`). Nothing for a model that is not sharded."""
    from torch.distributed.device_mesh import init_device_mesh

    infos = _mesh_infos(model)
    meshes = {id(i.mesh): i.mesh for i in infos}
    for mesh in meshes.values():
        fresh = init_device_mesh(mesh.device_type, tuple(mesh.mesh.shape), mesh_dim_names=mesh.mesh_dim_names)
        compat.mesh_take_groups(mesh, fresh)
    for info in infos:
        info.__post_init__()  # resolves shard_process_group / replicate_process_group from the mesh again
    reset(model)


def reset(model: torch.nn.Module) -> None:
    """Reset FSDP's per-iteration state after a forward or backward that a lost peer interrupted
    (``reset_iter_state`` on each root FSDP module: unsharded parameters freed, trackers cleared,
    the interrupted step's gradients dropped). Errors of collectives on the old group that it
    waits for are ignored: that group is gone."""
    for m in fsdp_modules(model):
        if compat.fsdp_is_root(m) is False:
            continue
        try:
            m.reset_iter_state()
        except RuntimeError:  # a wait on a collective of the lost group, or a module never run as root
            continue


def replica_sets(model: torch.nn.Module) -> Optional[list[list[int]]]:
    """HSDP: for each shard, the global ranks that hold it (one in each replica group), from the
    mesh (its replicate dimension across, the shard dimension along); ``None`` for plain FSDP (no
    replica of a shard exists) or meshes that disagree."""
    layouts = set()
    for info in _mesh_infos(model):
        rep = getattr(info, "replicate_mesh_dim", None)
        if rep is None:
            return None
        ranks = info.mesh.mesh.movedim(rep, 0)
        layouts.add(tuple(tuple(col.tolist()) for col in ranks.reshape(ranks.shape[0], -1).T))
    if len(layouts) != 1:
        return None
    return [list(col) for col in layouts.pop()]


def sources_from(sets: list[list[int]], lost: set[int]) -> Optional[dict[int, int]]:
    """For each rank of ``lost``, the lowest rank outside ``lost`` in its replica set (``sets``: the
    ranks holding each shard); ``None`` when one has no such rank."""
    sources = {}
    for r in sorted(lost):
        alive = [p for s in sets if r in s for p in s if p not in lost]
        if not alive:
            return None
        sources[r] = min(alive)
    return sources


@dataclass(frozen=True)
class ReplicaPlan:
    """An HSDP recovery that loses no completed step.

    Attributes:
        step: the step boundary every rank ends at (the newest a survivor reached).
        sources: each rank that lacks its shard of ``step`` (a replacement, or a survivor behind)
            -> the surviving replica at ``step`` that sends it.
        behind: the survivors one step back, which abandoned ``step`` after a peer completed it.
    """

    step: int
    sources: dict[int, int]
    behind: frozenset[int]


def replica_plan(
    sets: Optional[list[list[int]]], steps: dict[int, int], takers: set[int], kept: dict[int, set[int]]
) -> Optional[ReplicaPlan]:
    """Decide whether the lost shards can come from replicas, and from which (every rank computes
    the same from the same gathered facts).

    A collective that lost a peer can complete on some ranks and fail on others (gloo's ring), so
    the survivors may be one step apart. Those behind take the completed step as a replacement
    does: their shard from a replica that completed it, their own state (data position, random
    streams) as they left the step (they ran its forward and backward).

    Args:
        sets: the ranks holding each shard (:func:`replica_sets`; ``None``: plain FSDP).
        steps: each survivor's step boundary, ``{rank: step}``.
        takers: the survivors that can take a completed step (they kept their own state at the
            end of the step they abandoned; a framework's loop cannot skip its step).
        kept: each replacement's lost rank's kept boundaries, ``{rank: {step, ...}}``.

    Returns:
        The plan, or ``None`` (roll back to the newest common snapshot instead) when the model has
        no replicas, no rank survived, the survivors are more than one step apart, one behind
        cannot take the step, a replacement lacks its lost rank's boundary of it, or some shard
        has no replica at it.
    """
    if sets is None or not steps:
        return None
    step = max(steps.values())
    behind = {r for r, s in steps.items() if s < step}
    if min(steps.values()) < step - 1 or behind - takers or any(step not in k for k in kept.values()):
        return None
    sources = sources_from(sets, set(kept) | behind)
    return None if sources is None else ReplicaPlan(step, sources, frozenset(behind))
