"""The detectors' values carried in FSDP2's gradient-norm all-reduce: no collective of their own.

With FSDP2 (``fully_shard`` on a 1-D mesh of every rank) the gradients are sharded DTensors, and
the step already runs one small all-reduce after the backward: the gradient norm's, inside
``torch.nn.utils.clip_grad_norm_``. torch (2.13) computes each gradient's norm over this rank's
shard (no communication; a DTensor whose ``_NormPartial`` placement says how to combine it),
stacks them, and before the norm of that stack makes them whole: ``x ** p`` on each rank, a sum
over the ranks (one all-reduce of one value per gradient), ``** (1 / p)``. :meth:`ClipFold.clip`
runs exactly those operations itself, with the :class:`~.fold.LossFold` values (every rank's loss
in its slot, the stop flags, the straggler timings; the same layout as in a DDP bucket)
appended to that all-reduce, then takes the norm of the norms and clips with
``torch.nn.utils.clip_grads_with_norm_``, as ``clip_grad_norm_`` does. It returns the norm as torch
does, a DTensor replicated on the mesh.

The norm and the clipped gradients are bitwise torch's own: the same operations on the same
values, and the sum of element 0 is the same whatever else the buffer holds
(``tests/test_clipfold.py`` compares them on 2 and 4 gloo ranks).

It is trainguard's wrapper of ``clip_grad_norm_`` (the Guard's :class:`~trainguard.rejoin.catch.Catch`) that
calls :meth:`ClipFold.clip`. Not folded (torch's own clip runs, and ``should_step`` all-reduces
the detectors' values; the console says so once): gradients that are not DTensors sharded on one
1-D mesh of every rank (HSDP's 2-D mesh reduces the norm over a shard group only, which does not
reach every rank; tensor parallelism; a plain module), a norm that is not float32 (bf16
gradients), the ``inf``/``0`` norms (a max, not a sum), and a loop that does not call
``torch.nn.utils.clip_grad_norm_`` through the module (``from torch.nn.utils import
clip_grad_norm_`` before the Guard exists binds torch's own).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .. import compat


def foldable_mesh(tensors: Iterable[Any]) -> Optional[Any]:
    """The device mesh when every tensor of ``tensors`` is a DTensor sharded (only ``Shard``
    placements) on one 1-D mesh whose group is every rank of the default group, else ``None``
    (``tensors`` empty, a plain tensor, HSDP's 2-D mesh, two meshes, a mesh of part of the ranks)."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = None
    for t in tensors:
        if not isinstance(t, DTensor) or t.device_mesh.ndim != 1 or not all(isinstance(p, Shard) for p in t.placements):
            return None
        if mesh is None:
            mesh = t.device_mesh
        elif t.device_mesh != mesh:
            return None
    if mesh is None or not dist.is_initialized() or dist.get_world_size(mesh.get_group()) != dist.get_world_size():
        return None
    return mesh


def _partial_norms(grads: list[Any], p: float, foreach: Optional[bool]) -> Optional[Any]:
    """The stack of each gradient's ``p``-norm over this rank's shard (a DTensor of placement
    ``_NormPartial(p)``), computed as ``torch.nn.utils.get_total_norm`` does before its last norm
    (grouped by device and dtype, ``foreach`` where torch would), or ``None`` where torch would
    raise (``foreach=True`` on a device without it: torch's own clip then says so) or torch lacks
    the helpers of ``get_total_norm`` (:func:`trainguard.compat.foreach_utils`)."""
    utils = compat.foreach_utils()
    if utils is None:  # torch lacks its helpers: its own clip runs
        return None
    group_by_device_and_dtype, has_foreach_support, device_has_foreach_support = utils
    norms: list[Any] = []
    for (device, _), ([tensors], _) in group_by_device_and_dtype([grads]).items():
        if (foreach is None and has_foreach_support(tensors, device)) or (
            foreach and device_has_foreach_support(device)
        ):
            norms.extend(compat.foreach_norm(tensors, p))
        elif foreach:
            return None
        else:
            norms.extend(torch.linalg.vector_norm(g, p) for g in tensors)
    return torch.stack([n.to(grads[0].device) for n in norms])


class ClipFold:
    """``clip_grad_norm_`` with the fold's values in its all-reduce.

    Args:
        extra: ``extra(like)`` → the values to sum with the norm (a 1-D tensor of ``like``'s dtype
            and device, the same length on every rank), or ``None``: not this step (then torch's own
            clip runs). ``like``: this rank's partial norm to the power ``p`` (0-dim).
        reduced: ``reduced(values)``: the sums of ``extra``'s values, once the all-reduce completed.
    """

    def __init__(
        self, extra: Callable[[torch.Tensor], Optional[torch.Tensor]], reduced: Callable[[torch.Tensor], None]
    ):
        self.extra, self.reduced = extra, reduced

    def clip(
        self,
        torch_clip: Callable[..., torch.Tensor],
        parameters: Any,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None,
    ) -> torch.Tensor:
        """``torch_clip(parameters, max_norm, norm_type, error_if_nonfinite, foreach)``'s result
        and effect on the gradients, with the fold's values summed in its all-reduce where the
        gradients allow it (see the module doc); else ``torch_clip`` itself.

        Returns:
            the total norm of the gradients: a 0-dim DTensor replicated on the mesh (folded), or
            what ``torch_clip`` returns.

        Raises:
            RuntimeError: ``error_if_nonfinite`` and the norm is NaN or infinite (torch's message).
            the all-reduce's error: a peer is gone (trainguard's wrapper records it).
        """
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in params if p.grad is not None]
        p = float(norm_type)
        mesh = None if math.isinf(p) or p == 0 else foldable_mesh(grads)
        if mesh is None:
            return torch_clip(params, max_norm, norm_type, error_if_nonfinite, foreach)
        stacked = _partial_norms(grads, p, foreach)  # each gradient's norm over this rank's shard: nothing sent yet
        placement = stacked.placements[0] if stacked is not None else None
        if placement is None or not (placement.is_partial() and getattr(placement, "norm_type", None) == p):
            return torch_clip(params, max_norm, norm_type, error_if_nonfinite, foreach)  # not the reduction we know
        powered = stacked.to_local() ** p  # as _NormPartial reduces: x ** p, a sum over the ranks, ** (1 / p)
        values = self.extra(powered)
        if values is None:
            return torch_clip(params, max_norm, norm_type, error_if_nonfinite, foreach)
        k = powered.numel()
        buf = torch.cat([powered, values])
        c10d.all_reduce(buf, group=mesh.get_group())  # as torch's modules call it (not the script's collective)
        self.reduced(buf[k:])
        from torch.distributed.tensor import DTensor, Replicate

        norms = buf[:k] ** (1.0 / p)
        total = DTensor.from_local(torch.linalg.vector_norm(norms, p), mesh, [Replicate()], run_check=False)
        if error_if_nonfinite and not bool(torch.isfinite(total.to_local())):
            raise RuntimeError(
                f"The total norm of order {p} for gradients from `parameters` is non-finite, so it cannot be "
                "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
        return total


def install(
    model: torch.nn.Module, catch: Any, fold: Any, step_in_progress: Callable[[], int], inject: Any = None
) -> bool:
    """Fold ``fold``'s values (a :class:`~.fold.LossFold`) into ``clip_grad_norm_``'s all-reduce
    when ``model``'s parameters allow it (:func:`foldable_mesh`: FSDP2 on a 1-D mesh of every rank):
    trainguard's wrapper of ``clip_grad_norm_`` is installed (``catch``: the Guard's
    :class:`~trainguard.rejoin.catch.Catch`; the Guard's close removes it) and calls :meth:`ClipFold.clip`; ``fold`` notes each backward's
    tensor (``inject``: see :meth:`~.fold.LossFold.wire`). ``step_in_progress()``: the number of the
    step being run. ``False`` (nothing done): the parameters do not allow it."""
    if foldable_mesh(model.parameters()) is None:
        return False
    catch.install()
    catch.clip_fold = ClipFold(
        lambda like: fold.extra(step_in_progress(), like), lambda values: fold.reduced(step_in_progress(), values)
    ).clip
    fold.wire(inject, "FSDP2's gradient-norm all-reduce (torch.nn.utils.clip_grad_norm_, float32 gradients)")
    return True
