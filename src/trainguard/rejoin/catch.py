"""A lost peer caught at the collective, wherever a survivor meets it.

A rank that dies closes its connections; a surviving rank sees the loss as the error of whatever
collective it is in. Most of a step's waiting is in collectives the Guard does not call: DDP's
gradient all-reduce inside the script's own ``loss.backward()``, and the script's own
``dist.all_reduce`` of a loss for logging or ``dist.barrier``. This module catches the failure
there, so that the survivor's loop carries on to ``guard.step_end()`` (where recovery starts)
instead of raising out of the script:

* **DDP's backward**: the Guard registers a :class:`DDPHook` as the model's communication hook. It
  all-reduces each gradient bucket as DDP's default hook does (divide by the size of the model's
  process group, sum over it);
  an all-reduce that fails because a peer is gone is recorded and completes with the bucket as it
  was (this rank's own gradients). Once a failure is recorded, the next buckets are not sent.
* **The script's collectives**: a Guard's :class:`Catch` wraps the public collectives of
  ``torch.distributed`` (``all_reduce``, ``barrier``, ``broadcast``, ``all_gather_object``, ...,
  :data:`COLLECTIVES`) for calls made from the script (not from torch or trainguard, which
  handle their own errors). A call that fails because a peer is gone is recorded and returns
  ``None``, its tensors as they were; after a failure in the step, the script's collectives
  complete at once on this rank alone (:func:`complete_locally`).
* **The gradient norm**: ``torch.nn.utils.clip_grad_norm_`` (called through that name) of a
  sharded model all-reduces inside torch; a failure there is recorded and the norm is NaN.
* **A replacement before it joined** (``mode = "local"``): a replacement runs the script from its
  top, and meets the collectives the script runs before its loop (a barrier, a broadcast of a
  seed, an ``all_gather_object`` of host names) that the survivors passed long ago. They complete
  on the replacement alone, so they cannot pair with the survivors' recovery collectives; what a
  broadcast would have sent comes with the state from the survivors instead (the model, the
  optimizer, the RNG streams).
* **A replacement after it joined**, until its collectives line up with the survivors'
  (:mod:`.align`): a script collective at another place than the survivors' next one completes
  on it alone too; DDP's backward at another place fails the recovery at once.

The step whose collective failed is not applied (an optimizer pre-hook drops its gradients; see
:mod:`trainguard.rejoin.stepstart`) and is done again after the recovery.

A collective the script calls with ``async_op=True`` returns a work object as torch's does: a lost
peer is caught at its ``wait()`` (:class:`CaughtWork`), and one completed on this rank alone
returns a work object whose ``wait()`` returns at once (:class:`DoneWork`). Not caught: DDP's
buffer broadcast in ``forward`` (models with buffers and ``broadcast_buffers=True``).
A DDP communication hook of the script's own (registered before or after the Guard) is called by
trainguard's (:attr:`DDPHook.delegate`) instead of its own all-reduce: a lost peer is caught in it
too, and the detectors' values do not ride in its buckets (``should_step`` all-reduces them).
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .. import patches
from .align import DDP_BACKWARD, Alignment, script_site

# the public collectives of torch.distributed wrapped for the script's calls (trainguard.patches' table)
COLLECTIVES = patches.COLLECTIVES
PASS, LOCAL, CATCHING = "pass", "local", "catch"
_OWN = ("torch", "trainguard")  # packages whose collectives are not the script's (torchmetrics is)


def complete_locally(name: str, args: tuple, kwargs: dict) -> None:
    """What a collective ``name`` leaves on a rank that runs it alone: gathers fill every slot
    with this rank's own value (``all_gather``, ``all_gather_object``); every other collective
    leaves its tensors and objects as they are."""
    if name == "all_gather_object":
        out = args[0] if args else kwargs["object_list"]
        obj = args[1] if len(args) > 1 else kwargs["obj"]
        out[:] = [obj] * len(out)
    elif name == "all_gather":
        out = args[0] if args else kwargs["tensor_list"]
        mine = args[1] if len(args) > 1 else kwargs["tensor"]
        for t in out:
            t.copy_(mine)


def _from_script(frame: Any) -> bool:
    package = frame.f_globals.get("__name__", "").partition(".")[0]
    return package not in _OWN


class Catch:
    """The wrapping of ``torch.distributed``'s collectives for one Guard (each Guard builds its
    own; a replacement's runner builds one before the script starts and hands it to the script's
    Guard: :func:`hand_over`, :func:`take_handed`). Nothing is wrapped until :meth:`install`, and
    :meth:`uninstall` (the Guard's ``close()``) puts torch's functions back.

    Args:
        align: the alignment of a replacement's collectives with the survivors' after a meeting
            (:mod:`.align`); a new one when not given.

    Attributes:
        align: that alignment (the Guard's parts that meet the survivors use this one).
        mode: ``"pass"`` (call through), ``"local"`` (a replacement before it joined: complete on
            this rank alone) or ``"catch"`` (a survivor: record a lost peer and go on).
        on_failure: ``(error, where) -> bool``: records a lost peer; ``False``: not one, re-raise.
        failed: ``() -> bool``: whether a lost peer was recorded in the current step.
        tail: the step was abandoned and will be done again (:meth:`abandon_tail`): until the
            next step begins, the script's collectives complete on this rank alone.
        alone: the script's collectives (but barriers) completed on this rank alone in
            ``"local"`` mode since the current step began (``"dist.all_reduce"``, ...): their
            results were this rank's own values.
    """

    def __init__(self, align: Optional[Alignment] = None) -> None:
        self.align = align if align is not None else Alignment()
        self.mode = PASS
        self.tail = False
        self.on_failure: Callable[[BaseException, str], bool] = lambda e, where: False
        self.failed: Callable[[], bool] = lambda: False
        self._originals: dict[str, Callable] = {}
        self._clip: Optional[Callable] = None
        # clip_fold(torch_clip, *args, **kwargs): runs clip_grad_norm_ in its stead, with the
        # detectors' values in its all-reduce (trainguard.instability.clipfold); None: torch's
        self.clip_fold: Optional[Callable] = None
        self._norms: list[Any] = []  # what clip_grad_norm_ returned in the current step (step_begin())
        self.alone: list[str] = []  # the script's collectives completed alone ("local") in the current step

    def install(self) -> None:
        """Wrap the collectives in ``torch.distributed``'s namespace and ``clip_grad_norm_``
        (idempotent). torch's own modules call them through ``distributed_c10d`` and are not
        affected. Only where a lost peer can be caught (in-process recovery, world size > 1, or a
        replacement); :meth:`uninstall` puts them back."""
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None or name in self._originals:
                continue
            self._originals[name] = fn
            setattr(dist, name, self._wrap(name, fn))
        self.install_clip()

    def install_clip(self) -> None:
        """Wrap ``torch.nn.utils.clip_grad_norm_`` only (idempotent): the norm it returns in a step
        is noted for ``should_step`` (:meth:`step_norm`; the Hugging Face Trainer clips before its
        callback). Every Guard installs it; :meth:`uninstall` puts it back."""
        if self._clip is None:
            self._clip = torch.nn.utils.clip_grad_norm_
            torch.nn.utils.clip_grad_norm_ = self._wrap_clip(self._clip)

    def uninstall(self) -> None:
        """Put the original functions back and stop catching."""
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()
        if self._clip is not None:
            torch.nn.utils.clip_grad_norm_, self._clip = self._clip, None
        self.clip_fold = None
        self.disarm()

    def step_begin(self, step: int) -> None:
        """Step ``step`` begins (the Guard's component protocol): forget the norms
        ``clip_grad_norm_`` returned in the one before; the abandoned attempt's tail
        (:meth:`abandon_tail`) is over."""
        self._norms = []
        self.tail = False
        self.alone = []

    def close(self) -> None:
        """Put torch's functions back (:meth:`uninstall`) and end the alignment's window."""
        try:
            self.uninstall()
        finally:
            self.align.close()

    def abandon_tail(self) -> None:
        """A survivor met a replacement at the end of an abandoned step that it does again next:
        what the script runs between that ``step_end`` and the next step (a validation loss
        all-reduced every N steps after ``step_end``) ends the abandoned attempt, which the
        replacement, starting at the step done again, never runs; its collectives complete on
        this rank alone until the step begins again (and run with every rank after the redo)."""
        self.tail = True

    def step_norm(self) -> Optional[Any]:
        """The total gradient norm ``torch.nn.utils.clip_grad_norm_`` returned in the current step
        (before clipping), when it was called exactly once since :meth:`step_begin` (through the
        module, with the wrapper installed), else ``None``. The Hugging Face Trainer clips (or takes
        the norm) before its ``on_pre_optimizer_step``: ``should_step`` then needs no norm of its own."""
        return self._norms[0] if len(self._norms) == 1 else None

    def arm(self, on_failure: Callable[[BaseException, str], bool], failed: Callable[[], bool]) -> None:
        """Catch lost peers in the script's collectives from now on (a survivor's mode)."""
        self.install()
        self.on_failure, self.failed, self.mode = on_failure, failed, CATCHING

    def disarm(self) -> None:
        """Call through again."""
        self.mode = PASS
        self.on_failure, self.failed = (lambda e, where: False), (lambda: False)

    def _wrap(self, name: str, fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        def done(args: tuple, kwargs: dict) -> Any:  # completed on this rank alone, as the call returns
            complete_locally(name, args, kwargs)
            return DoneWork() if _async(signature, args, kwargs) else None

        @functools.wraps(fn)
        def collective(*args: Any, **kwargs: Any) -> Any:
            if self.mode == PASS or not _from_script(sys._getframe(1)):
                return fn(*args, **kwargs)
            if self.mode == LOCAL or self.failed() or self.tail:
                if self.mode == LOCAL and name != "barrier":  # a value it returns may not be the group's
                    self.alone.append(f"dist.{name}")
                return done(args, kwargs)
            align = self.align
            site = script_site(f"dist.{name}", sys._getframe(1)) if align.active else None
            if site is not None and not align.at(site, alone_ok=True):
                return done(args, kwargs)  # a replacement's, the survivors are not at it
            try:
                with align.waiting(site):
                    out = fn(*args, **kwargs)
            except Exception as e:
                if not self.on_failure(e, f"dist.{name}"):
                    raise
                return done(args, kwargs)
            if out is None or not _async(signature, args, kwargs):
                return out
            return CaughtWork(
                out, lambda e: self.on_failure(e, f"dist.{name}"), lambda: complete_locally(name, args, kwargs)
            )

        return collective

    def _wrap_clip(self, fn: Callable) -> Callable:
        """``torch.nn.utils.clip_grad_norm_``: with sharded gradients (FSDP2's DTensors) its norm
        is an all-reduce inside torch, the step's first collective after the backward. A lost peer
        there is recorded and the norm comes back NaN, the gradients unclipped (the step is done
        again); after a lost peer in the step it returns NaN at once. With :attr:`clip_fold` set,
        that runs instead of ``fn`` (given ``fn``)."""

        def run(*args: Any, **kwargs: Any) -> Any:
            norm = fn(*args, **kwargs) if self.clip_fold is None else self.clip_fold(fn, *args, **kwargs)
            self._norms.append(norm)
            return norm

        @functools.wraps(fn)
        def clip(*args: Any, **kwargs: Any) -> Any:
            if self.mode != CATCHING:
                return run(*args, **kwargs)
            if self.failed():
                return torch.full((), float("nan"))
            try:
                return run(*args, **kwargs)
            except Exception as e:
                if not self.on_failure(e, "clip_grad_norm_"):
                    raise
                return torch.full((), float("nan"))

        return clip


_handed: list[Catch] = []  # a replacement runner's Catch, until the script's Guard takes it


def hand_over(catch: Catch) -> None:
    """A replacement's runner hands ``catch`` (installed, in ``"local"`` mode while the script's
    top runs) to the Guard the script builds next (:func:`take_handed`)."""
    _handed[:] = [catch]


def take_handed() -> Optional[Catch]:
    """The :class:`Catch` a replacement's runner handed over (once; ``None`` in any other process
    or after it was taken): the Guard makes it its own, and its ``close()`` uninstalls it."""
    return _handed.pop() if _handed else None


def _async(signature: inspect.Signature, args: tuple, kwargs: dict) -> bool:
    """Whether a collective was called with ``async_op=True`` (by keyword or position)."""
    if "async_op" in kwargs:
        return bool(kwargs["async_op"])
    names = list(signature.parameters)
    if "async_op" not in names or len(args) <= names.index("async_op"):
        return False  # not given by position (the usual call: no binding on the hot path)
    try:
        return bool(signature.bind_partial(*args, **kwargs).arguments.get("async_op", False))
    except TypeError:
        return False


class DoneWork:
    """What a script's collective called with ``async_op=True`` returns when it completed on this
    rank alone (a lost peer in the step, a replacement before it joined): a work object, as torch
    returns, whose :meth:`wait` returns at once."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list:
        return []

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([])
        return fut


class CaughtWork:
    """torch's work object of a script's ``async_op=True`` collective, whose :meth:`wait` records
    a lost peer as the synchronous call does (``caught(error)``: ``True`` when it was one; the
    collective then completes on this rank alone, ``alone()``) and raises any other error as
    torch's would. Every other member is torch's work object's."""

    def __init__(self, work: Any, caught: Callable[[BaseException], bool], alone: Callable[[], None]):
        self._work, self._caught, self._alone = work, caught, alone

    def wait(self, timeout: Any = None) -> bool:
        try:
            return self._work.wait() if timeout is None else self._work.wait(timeout)
        except Exception as e:
            if not self._caught(e):
                raise
            self._alone()
            return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class DDPHook:
    """A DDP communication hook (``ddp.register_comm_hook(None, DDPHook(...).hook)``) that all-reduces each
    gradient bucket as DDP's default does (``buffer / group size``, summed over the model's group) and
    records a lost peer through ``catch.on_failure`` instead of failing the backward pass.

    It also notes the reducer's bucket layout (:attr:`layout`): with three or more ranks the sum's
    rounding depends on where each gradient sits in the buckets, so a reducer built again after a
    recovery must have the same layout as the one it replaces to stay bitwise equal to a run
    without the failure (:func:`~trainguard.rejoin.regroup.rebind_ddp`).

    Args:
        catch: where failures are recorded and asked for (``catch.failed()``: send nothing more).
        params: the model's parameters in the reducer's order (``ddp._build_params_for_reducer()``).
        before_last: called before the step's last bucket is sent (the Guard keeps this rank's
            step-boundary state there: after it, a peer may have the step's update).
        extra: called with the step's carrying bucket (:attr:`carrier`): values to all-reduce
            with it (its dtype and device), or ``None``. The same number of values on every rank.
            The sums go to ``reduced``. (:mod:`trainguard.instability.fold`.)
        group: ``() -> ProcessGroup``: the process group the model trains on now (DDP's
            ``process_group``, which an in-process recovery replaces; ``None``: the default group),
            read at each bucket: the buckets are averaged over it, as DDP's own hook averages them.
        delegate: ``(hook, state)``: the script's own communication hook, called as
            ``hook(state, bucket)`` instead of this hook's all-reduce (``extra`` is then not
            called); settable later (a registration after the Guard's, :meth:`InProcess.hook_ddp`).

    Attributes:
        forward: a :class:`~.forward.RollForward` (``[recovery] roll_forward``; set after the
            hook is made): each bucket's input is kept, a pass's end is the meeting point, and
            the buckets complete on this rank alone while it says so; ``None``: not rolling forward.
        layout: ``[[parameter index, ...] per bucket]`` in bucket order, as last seen (empty
            before the first backward).
        carrier: the index of the bucket that carries ``extra``'s values: 0 (the first DDP sends,
            at most 1 MiB) until a layout is noted after the hook was made or the reducer rebuilt
            (:meth:`rebuilt`), then the smallest bucket of the last layout noted (the fewest bytes
            copied to append them). Every rank notes the same layouts at the same backward passes
            (DDP builds its buckets alike on every rank), so every rank carries them in the same
            bucket.
    """

    LAYOUT_CALLS = (
        3  # backward passes whose layout is noted after a (re)build: DDP rebuilds its buckets once, after the first
    )

    def __init__(
        self,
        catch: Catch,
        params: list,
        before_last: Optional[Callable[[], None]] = None,
        extra: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = None,
        reduced: Callable[[torch.Tensor], None] = lambda values: None,
        delegate: Optional[tuple[Callable, Any]] = None,
        group: Optional[Callable[[], Any]] = None,
    ):
        self.catch, self.before_last, self.extra, self.reduced = catch, before_last, extra, reduced
        # the Guard always passes the model's group (DDPCommHook); the default serves a hook built
        # by hand for a model on the default group (the benchmarks' comm_hook_cost)
        self.group = group if group is not None else (lambda: dist.group.WORLD)
        self.delegate = delegate
        self.forward: Any = None  # a RollForward (.forward) where [recovery] roll_forward applies
        self._index = {id(p): i for i, p in enumerate(params)}
        self._numel = [p.numel() for p in params]
        self.layout: list[list[int]] = []
        self.carrier = 0
        self._noting = self.LAYOUT_CALLS

    def rebuilt(self) -> None:
        """The reducer was built again (in-process recovery, on every rank of the new group): note
        its layout for the next backward passes, and carry the values in bucket 0 until then, as a
        replacement's new hook does, so that every rank appends them to the same bucket."""
        self._noting, self.carrier = self.LAYOUT_CALLS, 0

    def progress(self) -> tuple[int, int]:
        """Where the hook stands in noting the layout: ``(carrier, backward passes still to note)``
        (:meth:`resume`: a replacement that runs a step rolled forward carries the detectors'
        values in the survivors' bucket)."""
        return self.carrier, self._noting

    def resume(self, progress: tuple[int, int], layout: Optional[list[list[int]]]) -> None:
        """Stand where :meth:`progress` stood on another rank whose :attr:`layout` was ``layout``."""
        self.carrier, self._noting = progress
        if layout:
            self.layout = [list(b) for b in layout]

    def hook(self, state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations: none here)
        """The hook DDP calls with each gradient bucket; a future of the reduced buffer."""
        buf = bucket.buffer()
        if self.forward is not None and bucket.index() == 0:  # a backward pass begins
            self.forward.pass_begins(self.progress())
        if self._noting:
            self._note(bucket)
        if bucket.is_last() and self.before_last is not None:
            self.before_last()
        if self.catch.align.open:  # after a meeting: the survivors' first collective, or a replacement's check
            self.catch.align.at(DDP_BACKWARD, alone_ok=False)
        forward = self.forward
        if forward is None and self.catch.failed():
            return _done(buf)
        if self.delegate is not None:
            return self._delegated(bucket, buf)
        group = self.group()
        buf.div_(group.size())
        extra = self.extra(buf) if self.extra is not None and bucket.index() == self.carrier else None
        # appended to the bucket only on two ranks: there each element's sum is one addition of
        # two values whatever the buffer's length; on three or more, gloo's (and NCCL's) ring
        # splits the buffer by its length, so a longer buffer sums the gradients in another order
        # (other bits): the values go in a small all-reduce of their own, issued right after it
        inline = extra is not None and group.size() <= 2
        sent = torch.cat([buf, extra]) if inline else buf
        if forward is not None:  # roll forward (.forward): the input kept, the meeting at the pass's end
            forward.keep(bucket, sent, buf.numel(), None if inline else extra)
            if bucket.is_last():
                forward.pass_ends()
            if forward.alone():
                return _done(buf)
        # the process group's own all-reduce (a sum), as DDP's reducer calls it: c10d.all_reduce's
        # checks around it cost more than the call itself on a CPU-bound step
        fut = group.allreduce([sent]).get_future()
        apart = extra is not None and not inline
        if apart:
            fut = torch.futures.collect_all([fut, group.allreduce([extra.clone()]).get_future()])

        def reduced(f: torch.futures.Future) -> torch.Tensor:
            try:
                done = f.value()
                out, values = (done[0].value()[0], done[1].value()[0]) if apart else (done[0], None)
            except Exception as e:
                if not self.catch.on_failure(e, "backward"):
                    raise
                return buf
            if inline:
                self.reduced(out[buf.numel() :])
                return out[: buf.numel()]
            if values is not None:
                self.reduced(values)
            return out

        return fut.then(reduced)

    def _delegated(self, bucket: Any, buf: torch.Tensor) -> torch.futures.Future:
        """The script's own hook reduces the bucket (``hook(state, bucket)``, its future as it
        returns it); a lost peer in it is recorded as in trainguard's own all-reduce and the bucket
        completes as it was. No detector values ride along (``should_step`` all-reduces them)."""
        hook, state = self.delegate

        def reduced(f: torch.futures.Future) -> torch.Tensor:
            try:
                return f.value()
            except Exception as e:
                if not self.catch.on_failure(e, "backward"):
                    raise
                return buf

        try:
            fut = hook(state, bucket)
        except Exception as e:  # a hook that runs its collective synchronously
            if not self.catch.on_failure(e, "backward"):
                raise
            return _done(buf)
        return fut.then(reduced)

    def _note(self, bucket: Any) -> None:
        i = bucket.index()
        del self.layout[i:]
        self.layout.append([self._index[id(p)] for p in bucket.parameters()])
        if bucket.is_last():
            self._noting -= 1
            sizes = [sum(self._numel[p] for p in params) for params in self.layout]
            self.carrier = sizes.index(min(sizes))  # from the next backward pass on


def _done(buf: torch.Tensor) -> torch.futures.Future:
    """A bucket completed on this rank alone: a future of its buffer as it is."""
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(buf)
    return done


def is_own_hook(hook: Any) -> bool:
    """Whether a registered DDP communication hook is trainguard's (:meth:`DDPHook.hook`)."""
    return isinstance(getattr(hook, "__self__", None), DDPHook)
