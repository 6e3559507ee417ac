"""The one checked list of the private members of torch and transformers that trainguard uses.

torch (and the Hugging Face ``Trainer``) give no public way to do a few things trainguard needs:
build a DDP model's reducer again on a new process group, move an FSDP2 mesh to new groups, take a
per-shard gradient norm as ``clip_grad_norm_`` does, supervise torch elastic's workers. Every
private member it uses for them is listed in :data:`MEMBERS`, with the trainguard module that uses
it and what trainguard does when a release renames or removes it: a **fallback** (the feature
works another way, or steps aside and the console or the caller says so) or a **refusal**
(:class:`Incompatible`, whose message names the member and the installed version).

Outside this module only :mod:`trainguard.launcher.torch_agent` touches such members (torch
elastic's, which its subclass of ``LocalElasticAgent`` must override or read); it takes their names
from here. ``tests/test_compat.py`` walks the syntax tree of every module of ``src/trainguard`` and
fails on a private name of another package used anywhere else, and checks every listed member
against the installed torch and transformers. Lightning: the names of Fabric's wrappers (the
Guard unwraps them, :mod:`trainguard.guard.wrappers`).

When each is checked: where it is first needed, by the function here that uses it, which falls
back or refuses there. DDP's and FSDP2's members before in-process recovery is counted on (the
Guard's start: :func:`~trainguard.rejoin.regroup.check_rebindable` turns a missing one into a
group restart), torch elastic's when the launcher's agent is built
(:mod:`~trainguard.launcher.torch_agent`), the others at their first call. Attributes that only
objects carry (an FSDP state's param groups, an agent's worker group) are checked on the object
(:func:`missing_on`). :func:`missing_members` checks every member of a module or class at once
(``tests/test_compat.py``, against the installed packages).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

DDP = "torch.nn.parallel.DistributedDataParallel"
DIST = "torch.distributed"
C10D = "torch.distributed.distributed_c10d"
FOREACH = "torch.utils._foreach_utils"
FSDP_MODULE = "torch.distributed.fsdp.FSDPModule"
FSDP_STATE = "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState"
MESH = "torch.distributed.device_mesh.DeviceMesh"
DTENSOR_UTILS = "torch.distributed.tensor._utils"
TENSOR = "torch.Tensor"
AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent"
PCONTEXT = "torch.distributed.elastic.multiprocessing.api.SubprocessContext"
TRAINER = "transformers.Trainer"
DATALOADER = "torch.utils.data.dataloader"
PG = "torch.distributed.ProcessGroup"
PG_NCCL = "torch.distributed.ProcessGroupNCCL"  # only in a torch built with NCCL
DYNAMIC_RDZV = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"
FABRIC = "lightning.fabric.wrappers"  # also the standalone package's lightning_fabric.wrappers
FABRIC_MODULE = "lightning.fabric.wrappers._FabricModule"
STATEFUL_LOADER = "torchdata.stateful_dataloader.StatefulDataLoader"


@dataclass(frozen=True)
class Private:
    """One private member of another package that trainguard uses.

    Attributes:
        owner: dotted path of the module or class that holds it (importable).
        name: the member's name.
        used_in: the trainguard modules that rely on it (paths below ``src/trainguard``).
        missing: what trainguard does without it: ``"fallback: ..."`` or ``"refused: ..."``.
        on_objects: an attribute the owner's objects set (checked on an object, :func:`missing_on`),
            not one of the module or class.
        nccl: needed only with NCCL (not checked in a torch built without it).
    """

    owner: str
    name: str
    used_in: tuple[str, ...]
    missing: str
    on_objects: bool = False
    nccl: bool = False

    def __str__(self) -> str:
        return f"{self.owner.rpartition('.')[2]}.{self.name}"

    @property
    def package(self) -> str:
        """The distribution that provides it (``torch``, ``transformers``)."""
        return self.owner.partition(".")[0]


_RESTART = "refused: in-process recovery steps aside, the launcher restarts the group (RegroupError)"
_ELASTIC = "refused: the launcher does not start (ElasticIncompatible)"
_CLIP = "fallback: torch's own clip_grad_norm_ runs, should_step all-reduces"
_RERUN = "refused: the step is not run again (Incompatible)"
_ABORT = 'refused: in_process = "nccl-experimental" is declined at start (a group restart)'
_AGENT_METHODS = (
    "_invoke_run",
    "_stop_workers",
    "_initialize_workers",
    "_rendezvous",
    "_assign_worker_ranks",
    "_monitor_workers",
    "_exit_barrier",
    "_shutdown",
)


def _each(owner: str, names: tuple[str, ...], used_in: str, missing: str, on_objects: bool = False) -> tuple:
    return tuple(Private(owner, n, (used_in,), missing, on_objects) for n in names)


_HOOKED = ("guard/ddp_hook.py", "rejoin/regroup.py")
MEMBERS: tuple[Private, ...] = (
    # DDP: trainguard's communication hook and a reducer built again on a new group
    Private(DDP, "_comm_hooks", _HOOKED, "fallback: no trainguard hook (the detectors all-reduce); " + _RESTART, True),
    Private(
        DDP,
        "_build_params_for_reducer",
        _HOOKED,
        "fallback: no trainguard hook (the detectors all-reduce); " + _RESTART,
    ),
    *_each(DDP, ("_build_debug_param_to_name_mapping", "_ddp_init_helper"), "rejoin/regroup.py", _RESTART),
    Private(
        DIST,
        "_compute_bucket_assignment_by_size",
        ("rejoin/regroup.py",),
        "fallback: the rebuilt reducer starts with DDP's initial bucket layout (the console says so)",
    ),
    Private(C10D, "_get_default_store", ("health/ping.py",), "fallback: the liveness ping makes no store of its own"),
    # FSDP2 and its device mesh: moved to new groups in place
    Private(FSDP_MODULE, "_get_fsdp_state", ("rejoin/sharded.py",), _RESTART),
    Private(FSDP_STATE, "_fsdp_param_groups", ("rejoin/sharded.py",), _RESTART, True),
    Private(
        FSDP_STATE, "_is_root", ("rejoin/sharded.py",), "fallback: every FSDP module's iteration state is reset", True
    ),
    Private(MESH, "_get_root_mesh", ("rejoin/sharded.py",), _RESTART),
    *_each(MESH, ("_dim_group_names", "_pg_registry"), "rejoin/sharded.py", _RESTART, True),
    # gradient norms as torch computes them
    Private(
        "torch",
        "_foreach_norm",
        ("instability/clipfold.py", "instability/detect.py"),
        "fallback: one torch.linalg.vector_norm per tensor",
    ),
    *_each(
        FOREACH,
        ("_group_tensors_by_device_and_dtype", "_has_foreach_support", "_device_has_foreach_support"),
        "instability/clipfold.py",
        _CLIP,
    ),
    # state: the hash of a DTensor shard, the background save's change check, the spare's preload
    Private(
        DTENSOR_UTILS,
        "compute_local_shape_and_global_offset",
        ("state/determinism.py",),
        "refused: the state hash of a DTensor (Incompatible)",
    ),
    Private(
        TENSOR,
        "_version",
        ("checkpoint/checkpointer.py",),
        "fallback: a background save copies every tensor at the save (no deferred copy)",
    ),
    Private(
        "torch", "_dynamo", ("rejoin/replacement.py",), "fallback: a warm spare imports it later, at DDP's constructor"
    ),
    # the autograd engine's final callbacks: a rolled-forward recovery meets at the end of a backward pass
    Private(
        "torch.autograd.Variable",
        "_execution_engine",
        ("rejoin/forward.py",),
        "fallback: [recovery] roll_forward is declined at start (said); a lost peer's step is done again",
    ),
    # a data loader's iterator: a step done again gets the interrupted attempt's batches back
    Private(
        DATALOADER,
        "_BaseDataLoaderIter",
        ("rejoin/replay.py",),
        "fallback: no batch is given back; a step done again whose batch differs fails the recovery (a group restart)",
    ),
    # the names set_state_dict looks up in a model's state (the first save's proof that it loads)
    *_each(
        DCP_STATE_DICT,
        ("_iterate_valid_model_state", "_get_fqns"),
        "checkpoint/loadable.py",
        "fallback: the first save checks the saved keys, shapes and dtypes and DCP's load plan, not the names "
        "the model's load looks up",
    ),
    # Lightning Fabric's wrappers given to the Guard: the module inside its _FabricModule
    *_each(
        FABRIC,
        ("_FabricModule", "_FabricOptimizer", "_FabricDataLoader"),
        "guard/wrappers.py",
        "fallback: the Guard takes Fabric's objects as they are (a _FabricModule over DDP is refused at the first "
        "save, checkpoint/loadable.py; a Fabric data loader as the sampler is refused for lacking state_dict())",
    ),
    Private(
        FABRIC_MODULE,
        "_forward_module",
        ("guard/wrappers.py",),
        "refused: BadInput at Guard(...) naming the module to pass",
        True,
    ),
    # which loader a DataLoader iterator draws from (the data position's check after a resume)
    *_each(
        f"{DATALOADER}._BaseDataLoaderIter",
        ("_dataset", "_index_sampler", "_num_workers", "_base_seed"),
        "state/datapos.py",
        "fallback: the first step after a resume says its batches came from a DataLoader of unknown position "
        "without naming its dataset and sampler (and does not see worker processes reading a saved sampler ahead, "
        "nor an iterator made after the resume drawing its seed from torch's global generator)",
        True,
    ),
    # torchdata's StatefulDataLoader given to the Guard: the iterator its position reaches
    Private(
        STATEFUL_LOADER,
        "_iterator",
        ("state/datapos.py",),
        "fallback: a position loaded after the loop made its iterator is not said; the Guard's keeping of the "
        "position before the loop's first iter() makes the loader's iterator (an epoch loop's set_epoch comes late)",
        True,
    ),
    # torch elastic: trainguard's agent (launcher/torch_agent.py overrides and reads these)
    *_each(AGENT, _AGENT_METHODS, "launcher/torch_agent.py", _ELASTIC),
    *_each(
        AGENT,
        ("_worker_group", "_remaining_restarts", "_pcontext", "_store"),
        "launcher/torch_agent.py",
        _ELASTIC,
        True,
    ),
    Private(PCONTEXT, "_running_local_ranks", ("launcher/torch_agent.py",), _ELASTIC, True),
    # torch elastic's rendezvous state: its fields carried as sealed JSON (launcher/sealed_rdzv.py)
    *_each(
        DYNAMIC_RDZV,
        ("_RendezvousState", "_NodeDesc"),
        "launcher/sealed_rdzv.py",
        "refused: the launcher does not start (Incompatible): torch's rendezvous state is not carried unsealed",
    ),
    # the Hugging Face Trainer: a step run again after a lost peer was replaced
    *_each(TRAINER, ("_get_num_items_in_batch", "_clip_grad_norm"), "hf.py", _RERUN),
    # communicator abort (rejoin/abort.py): every group of the process, aborted and dropped
    *_each(C10D, ("_world", "_abort_process_group"), "rejoin/abort.py", _ABORT),
    Private(PG, "_get_backend", ("rejoin/abort.py",), _ABORT),
    *(Private(PG_NCCL, n, ("rejoin/abort.py",), _ABORT, nccl=True) for n in ("_group_start", "_group_end")),
)


class Incompatible(RuntimeError):
    """The installed torch (or transformers) lacks a private member that trainguard uses where it
    has no fallback: the message names the member, the installed version and what is refused."""


def members(owner: str, on_objects: Optional[bool] = None) -> tuple[str, ...]:
    """The names of :data:`MEMBERS` held by ``owner`` (a dotted path), in the list's order; only
    the objects' attributes (``on_objects=True``) or the module's or class's (``False``)."""
    return tuple(p.name for p in MEMBERS if p.owner == owner and on_objects in (None, p.on_objects))


def version(package: str) -> str:
    """The installed version of ``package`` (``"not installed"``)."""
    try:
        return importlib.import_module(package).__version__
    except ImportError:
        return "not installed"


def resolve(owner: str) -> Any:
    """The module or class named by the dotted path ``owner``.

    Raises:
        ImportError: its package (or the module) is not installed.
    """
    parts = owner.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            if cut == 1:
                raise
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(owner)  # pragma: no cover  (the loop returns or raises)


def missing_members() -> list[str]:
    """The members of :data:`MEMBERS` held by a module or class that the installed packages lack
    (``"Owner.name (package version)"``); packages not installed are skipped."""
    out = []
    for p in MEMBERS:
        if p.on_objects or (p.nccl and not dist.is_nccl_available()):
            continue
        try:
            owner = resolve(p.owner)
        except (ImportError, AttributeError):
            if version(p.package) == "not installed":
                continue
            out.append(f"{p} ({p.package} {version(p.package)}: no {p.owner})")
            continue
        if not hasattr(owner, p.name):
            out.append(f"{p} ({p.package} {version(p.package)})")
    return out


def missing_on(obj: Any, owner: str) -> list[str]:
    """The attributes of :data:`MEMBERS` that ``owner``'s objects carry (``on_objects``) and ``obj``
    lacks, as ``"Class.name"``."""
    return [f"{type(obj).__name__}.{n}" for n in members(owner, on_objects=True) if not hasattr(obj, n)]


def refuse(missing: list[str], package: str = "torch", what: str = "") -> None:
    """Raise :class:`Incompatible` naming ``missing`` (``"Class.name"`` each) and the installed
    version of ``package``, when ``missing`` is not empty; ``what``: the feature that needs them."""
    if missing:
        raise Incompatible(
            f"{package} {version(package)} lacks {', '.join(missing)}, which trainguard{' ' + what if what else ''} "
            f"relies on; trainguard is tested with torch 2.13 and transformers 5.24 (see pyproject.toml)"
        )


def _lacks(owner: Any, names: tuple[str, ...], label: str) -> list[str]:
    return [f"{label}.{n}" for n in names if not hasattr(owner, n)]


# ---- DDP ----------------------------------------------------------------------------------------


def ddp_comm_hooks(model: torch.nn.Module) -> Optional[list[tuple[Callable, Any]]]:
    """The ``(hook, state)`` pairs registered with ``register_comm_hook`` on a DDP ``model``;
    ``None`` when torch does not keep them where trainguard reads them (fallback: the caller
    assumes one it cannot see)."""
    hooks = getattr(model, "_comm_hooks", None)
    return None if hooks is None else list(hooks)


def ddp_reducer_params(model: torch.nn.Module) -> Optional[list[torch.nn.Parameter]]:
    """The parameters a DDP ``model``'s reducer buckets, in its order (as DDP's constructor
    computes them); ``None`` when torch lacks the method."""
    build = getattr(model, "_build_params_for_reducer", None)
    return None if build is None else list(build()[0])


def missing_ddp(model: Optional[torch.nn.Module] = None) -> list[str]:
    """The DDP members :func:`rebuild_reducer` needs that the installed torch lacks (with ``model``,
    a DDP model, also the list of its communication hooks), as ``"DistributedDataParallel.x"``."""
    from torch.nn.parallel import DistributedDataParallel

    need = ("_build_params_for_reducer", "_build_debug_param_to_name_mapping", "_ddp_init_helper")
    out = [f"DistributedDataParallel.{n}" for n in need if not callable(getattr(DistributedDataParallel, n, None))]
    return out + ([] if model is None else missing_on(model, DDP))


_layout_lock = threading.Lock()


@contextlib.contextmanager
def bucket_layout(layout: Optional[list[list[int]]], cap: int) -> Iterator[bool]:
    """Inside: a DDP reducer built by *this thread* starts with ``layout`` (``[[parameter index,
    ...] per bucket]``, each bucket capped at ``cap`` bytes) instead of the one DDP computes; other
    threads building a DDP model meanwhile get DDP's own. ``torch.distributed``'s bucket
    assignment is replaced for that time (one holder at a time: a lock); yields whether it was
    (``False``: no ``layout``, or torch lacks the function: DDP's initial layout)."""
    name = "_compute_bucket_assignment_by_size"
    if not layout:
        yield False
        return
    with _layout_lock:
        original = getattr(dist, name, None)
        if original is None:
            yield False
            return
        owner = threading.get_ident()
        given = (list(reversed(layout)), [cap] * len(layout))  # DDP's constructor reverses what it gets

        @functools.wraps(original)
        def assign(*args: Any, **kwargs: Any) -> Any:
            return given if threading.get_ident() == owner else original(*args, **kwargs)

        setattr(dist, name, assign)
        try:
            yield True
        finally:
            setattr(dist, name, original)


def rebuild_reducer(model: Any, layout: Optional[list[list[int]]] = None) -> bool:
    """Build a DDP ``model``'s reducer (and its logger) again on ``model.process_group``, exactly
    as DDP's constructor builds them, starting with ``layout`` (see :func:`bucket_layout`).
    Returns whether ``layout`` was used (``False`` for none, or DDP's initial layout as a fallback).

    Raises:
        Incompatible: torch lacks a DDP member used here (:func:`missing_ddp`).
    """
    refuse(missing_ddp(model), what="'s in-process recovery of DDP")
    params, sparse = model._build_params_for_reducer()
    with bucket_layout(layout, model.bucket_bytes_cap) as kept:
        model._ddp_init_helper(params, sparse, model._build_debug_param_to_name_mapping(params), model.static_graph)
    return kept


def clear_comm_hooks(model: Any) -> None:
    """Forget the hooks a DDP ``model`` lists as registered (its reducer was built again without them)."""
    hooks = getattr(model, "_comm_hooks", None)
    if hooks is not None:
        hooks.clear()


def default_store() -> Optional[dist.Store]:
    """The default process group's store, ``None`` without one (or where torch lacks the function)."""
    from torch.distributed import distributed_c10d

    get = getattr(distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except (RuntimeError, ValueError):
        return None


# ---- FSDP2 and the device mesh ------------------------------------------------------------------


def missing_fsdp(modules: list[torch.nn.Module], meshes: list[Any]) -> list[str]:
    """The FSDP2 and device mesh members in-process recovery uses that ``modules`` (FSDP modules)
    and ``meshes`` (their device meshes) lack; checked on the objects: most are set by their
    constructors."""
    out: list[str] = []
    for m in modules[:1]:
        out += _lacks(m, members(FSDP_MODULE) + ("reset_iter_state",), "FSDPModule")
        if not out and not hasattr(m._get_fsdp_state(), "_fsdp_param_groups"):
            out.append("FSDPState._fsdp_param_groups")  # _is_root has a fallback
    for mesh in meshes[:1]:
        out += _lacks(mesh, members(MESH), "DeviceMesh")
    return sorted(set(out))


def fsdp_param_groups(module: torch.nn.Module) -> list[Any]:
    """The parameter groups of an FSDP module's state (each with ``mesh_info``,
    ``post_forward_mesh_info`` and ``fsdp_params``); empty where torch lacks them (see
    :func:`missing_fsdp`, which refuses first)."""
    state = getattr(module, "_get_fsdp_state", None)
    return list(getattr(state(), "_fsdp_param_groups", ())) if state is not None else []


def fsdp_is_root(module: torch.nn.Module) -> Optional[bool]:
    """Whether an FSDP module is a root of its state (``None``: not known yet, or where torch
    does not say: the caller treats it as a root)."""
    state = getattr(module, "_get_fsdp_state", None)
    return getattr(state(), "_is_root", None) if state is not None else None


def mesh_is_root(mesh: Any) -> bool:
    """Whether ``mesh`` is a whole device mesh, not a slice of a larger one."""
    return mesh._get_root_mesh() is mesh


def mesh_take_groups(mesh: Any, fresh: Any) -> None:
    """Point ``mesh`` at the process groups of ``fresh`` (a mesh of the same shape and names, made
    on the new default group): the names ``get_group`` looks up, and the registry it reads under
    ``torch.compile``."""
    mesh._dim_group_names = list(fresh._dim_group_names)
    mesh._pg_registry.update(fresh._pg_registry)


# ---- gradient norms -----------------------------------------------------------------------------


def foreach_norm(tensors: list[torch.Tensor], p: float = 2.0) -> list[torch.Tensor]:
    """Each tensor's ``p``-norm, with torch's fused kernel where it has one (as
    ``clip_grad_norm_``); else one ``torch.linalg.vector_norm`` each (the same values)."""
    fused = getattr(torch, "_foreach_norm", None)
    if fused is not None:
        return list(fused(tensors, p))
    return [torch.linalg.vector_norm(t, p) for t in tensors]


@functools.cache
def foreach_utils() -> Optional[tuple[Callable, Callable, Callable]]:
    """torch's helpers of ``get_total_norm`` (``_group_tensors_by_device_and_dtype``,
    ``_has_foreach_support``, ``_device_has_foreach_support``), or ``None`` where torch lacks one."""
    try:
        mod = importlib.import_module(FOREACH)
    except ImportError:
        return None
    found = tuple(getattr(mod, n, None) for n in members(FOREACH))
    return None if None in found else found  # type: ignore[return-value]


# ---- state --------------------------------------------------------------------------------------


def local_shape_and_offset(t: Any) -> tuple[Any, Any]:
    """A DTensor's local shard shape and global offset, as ``torch.distributed.checkpoint``
    computes them.

    Raises:
        Incompatible: torch lacks the function.
    """
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        refuse(["torch.distributed.tensor._utils.compute_local_shape_and_global_offset"], what="'s state hash")
    return compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)


def has_tensor_version() -> bool:
    """Whether tensors count their in-place changes where :func:`tensor_version` reads it."""
    return hasattr(torch.Tensor, "_version")


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter (any in-place op on it or a view; not a ``.data`` edit).
    Call only where :func:`has_tensor_version`."""
    return t._version


def preload_dynamo() -> None:
    """Import ``torch._dynamo`` now (DDP's constructor imports it; 0.7 s): a warm spare does it
    before it is assigned. Nothing where torch has no such module."""
    try:
        importlib.import_module("torch._dynamo")
    except ImportError:
        pass


def backward_engine() -> Optional[Any]:
    """The autograd engine whose ``queue_callback(fn)`` runs ``fn`` once the running backward pass
    ends (after the callbacks queued before it: DDP's reducer finalizes the gradients in one),
    ``None`` where torch lacks it (roll forward is then declined)."""
    return getattr(torch.autograd.Variable, "_execution_engine", None)


def dataloader_iterator_class() -> Optional[type]:
    """The base class of a ``DataLoader``'s iterators (``_BaseDataLoaderIter``, whose ``__next__``
    every iterator uses: one process or worker processes), ``None`` where torch has no such class."""
    cls = getattr(importlib.import_module(DATALOADER), "_BaseDataLoaderIter", None)
    return cls if isinstance(cls, type) and callable(getattr(cls, "__next__", None)) else None


# ---- what a checkpoint load looks up -------------------------------------------------------------


def model_load_names(model: torch.nn.Module) -> Optional[list[tuple[str, str]]]:
    """The names ``set_state_dict`` looks up in a model state to load ``model``, each as ``(name
    looked up, name in the model)`` (they differ under a prefix that torch's state dict leaves out:
    DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``): torch's own walk of the model
    (``_iterate_valid_model_state``, ``_get_fqns``); ``None`` where torch lacks either."""
    module = importlib.import_module(DCP_STATE_DICT)
    walk, fqns = getattr(module, "_iterate_valid_model_state", None), getattr(module, "_get_fqns", None)
    if walk is None or fqns is None:
        return None
    names = []
    for key, _ in walk(model):
        plain = fqns(model, key)
        prefixed = fqns(model, key, skip_ddp_prefix=False, skip_compiler_prefix=False)
        names += list(zip(sorted(plain), sorted(prefixed)))
    return names


# ---- Lightning Fabric ----------------------------------------------------------------------------


def fabric_kind(obj: Any) -> Optional[str]:
    """What Lightning Fabric's ``setup`` made ``obj``: ``"module"`` (its ``_FabricModule``),
    ``"optimizer"``, ``"dataloader"``, ``"wrapped"`` (another object its public ``is_wrapped``
    knows: a compiled module), or ``None`` (not Fabric's; always where Lightning is not imported:
    nothing is imported here)."""
    for name in (FABRIC, "lightning_fabric.wrappers"):
        module = sys.modules.get(name)
        if module is None:
            continue
        for kind, cls in (
            ("module", "_FabricModule"),
            ("optimizer", "_FabricOptimizer"),
            ("dataloader", "_FabricDataLoader"),
        ):
            known = getattr(module, cls, None)
            if isinstance(known, type) and isinstance(obj, known):
                return kind
        is_wrapped = getattr(module, "is_wrapped", None)
        try:  # (it raises on a module compiled before Lightning was imported: not Fabric's)
            wrapped = callable(is_wrapped) and is_wrapped(obj)
        except RuntimeError:
            wrapped = False
        if wrapped:
            return "wrapped"
    return None


def fabric_forward_module(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The module a ``_FabricModule`` runs (DDP, FSDP or the plain module: what Fabric's strategy
    made of the one given to ``setup``), ``None`` where Lightning renamed it."""
    inner = getattr(module, "_forward_module", None)
    return inner if isinstance(inner, torch.nn.Module) else None


def dataloader_iterator_source(iterator: Any) -> tuple[Any, Any]:
    """``(dataset, index sampler)`` a ``DataLoader`` iterator draws from (the index sampler: the
    loader's ``batch_sampler`` when it batches, else its ``sampler``); ``None`` for each that this
    torch does not show."""
    return getattr(iterator, "_dataset", None), getattr(iterator, "_index_sampler", None)


def dataloader_iterator_seed(iterator: Any) -> Optional[int]:
    """The base seed a ``DataLoader`` iterator drew when it was made (from the loader's generator,
    else torch's global one), ``None`` where torch does not show it."""
    seed = getattr(iterator, "_base_seed", None)
    return int(seed) if isinstance(seed, int) else None


def stateful_loader_owns(loader: Any, iterator: Any) -> bool:
    """Whether ``iterator`` is the one a torchdata ``StatefulDataLoader`` holds now (the one its
    position, saved or loaded, belongs to: a ``load_state_dict`` drops the one it held). ``True``
    where torchdata does not show it (the fallback: not said)."""
    if not hasattr(loader, "_iterator"):
        return True
    return loader._iterator is iterator


def stateful_loader_idle(loader: Any) -> bool:
    """Whether a torchdata ``StatefulDataLoader`` holds no iterator now (since it was made, or since
    a ``load_state_dict``): its ``state_dict()`` would then make one, from the sampler as it is at
    that moment. ``False`` where torchdata does not show it."""
    return getattr(loader, "_iterator", False) is None


def dataloader_iterator_workers(iterator: Any) -> int:
    """The number of worker processes a ``DataLoader`` iterator reads with (0: the main process;
    also where torch does not show it)."""
    return int(getattr(iterator, "_num_workers", 0) or 0)


# ---- the Hugging Face Trainer -------------------------------------------------------------------


def _trainer_member(trainer: Any, name: str) -> Callable:
    member = getattr(trainer, name, None)
    if member is None:
        refuse([f"Trainer.{name}"], "transformers", "'s Hugging Face callback (a step run again after a lost peer)")
    return member


def trainer_num_items_in_batch(trainer: Any, batches: list[Any], device: Any) -> Any:
    """The Trainer's count of the items (tokens) of the step's micro-batches ``batches`` across
    ranks, as its loop computes it.

    Raises:
        Incompatible: transformers lacks ``Trainer._get_num_items_in_batch``.
    """
    return _trainer_member(trainer, "_get_num_items_in_batch")(batches, device)


def trainer_clip_grad_norm(trainer: Any, model: Any) -> Any:
    """The Trainer's gradient clipping of ``model``, as its loop runs it.

    Raises:
        Incompatible: transformers lacks ``Trainer._clip_grad_norm``.
    """
    return _trainer_member(trainer, "_clip_grad_norm")(model)


# ---- torch elastic's rendezvous state (launcher/sealed_rdzv.py) ----------------------------------

RENDEZVOUS_FIELDS = (
    "round",
    "complete",
    "deadline",
    "closed",
    "participants",
    "wait_list",
    "redundancy_list",
    "last_heartbeats",
)


def rendezvous_classes() -> tuple[type, type]:
    """torch's ``(_RendezvousState, _NodeDesc)``: the dynamic rendezvous's state and its node
    descriptor, which :mod:`~trainguard.launcher.sealed_rdzv` carries as fields (never pickled
    through a store). Checked: the state has exactly the fields of :data:`RENDEZVOUS_FIELDS` and
    the node descriptor is ``(addr, pid, local_id)``.

    Raises:
        Incompatible: torch lacks either class or either has other fields.
    """
    mod = importlib.import_module(DYNAMIC_RDZV)
    state_cls, node_cls = getattr(mod, "_RendezvousState", None), getattr(mod, "_NodeDesc", None)
    if state_cls is None or node_cls is None:
        refuse(
            [n for n, c in (("_RendezvousState", state_cls), ("_NodeDesc", node_cls)) if c is None],
            what="'s rendezvous",
        )
    fields = tuple(vars(state_cls()).keys())
    node_fields = tuple(getattr(node_cls, "__dataclass_fields__", {}))
    if sorted(fields) != sorted(RENDEZVOUS_FIELDS) or node_fields != ("addr", "pid", "local_id"):
        refuse([f"_RendezvousState{fields}", f"_NodeDesc{node_fields}"], what="'s rendezvous (other fields)")
    return state_cls, node_cls


# ---- communicator abort (rejoin/abort.py) -----------------------------------------------------


def missing_abort(nccl: bool) -> list[str]:
    """The members the communicator abort uses that the installed torch lacks (``nccl``: with
    NCCL's own), as ``"Class.name"``; empty when it can run."""
    wanted = [p for p in MEMBERS if "rejoin/abort.py" in p.used_in and (nccl or not p.nccl)]
    out = []
    for p in wanted:
        try:
            owner = resolve(p.owner)
        except (ImportError, AttributeError):
            out.append(str(p))
            continue
        if not hasattr(owner, p.name):
            out.append(str(p))
    return out


def process_groups() -> list[dist.ProcessGroup]:
    """Every process group of this process, the newest first (the order torch aborts them in)."""
    from torch.distributed import distributed_c10d as c10d

    names = dict(c10d._world.pg_names)
    return sorted(names, key=lambda pg: names[pg], reverse=True)


def drop_process_groups() -> None:
    """Abort every process group and clear torch's registry of them without the shutdown that
    waits for peers (an aborted NCCL communicator's would wait for the lost one)."""
    from torch.distributed import distributed_c10d as c10d

    c10d._abort_process_group()


def group_backend(pg: dist.ProcessGroup, device: torch.device) -> Any:
    """The backend of ``pg`` for ``device``.

    Raises:
        RuntimeError: ``pg`` has none for that device.
    """
    return pg._get_backend(device)


@contextlib.contextmanager
def nccl_group(backend: Any) -> Iterator[None]:
    """``ncclGroupStart``/``ncclGroupEnd`` around the block on an NCCL ``backend`` (several
    communicators aborted inside one cannot deadlock, pytorch issue 119797); ``None``: nothing."""
    if backend is None:
        yield
        return
    backend._group_start()
    try:
        yield
    finally:
        backend._group_end()


__all__ = [
    "MEMBERS",
    "Incompatible",
    "Private",
    "missing_members",
    "missing_on",
    "refuse",
]
