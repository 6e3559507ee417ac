"""trainguard for the Hugging Face ``Trainer``: one callback, one argument to ``train``.

::

    args = TrainingArguments(output_dir, max_steps=1000, save_strategy="no", ...)
    trainer = Trainer(model, args, train_dataset=data, callbacks=[TrainguardCallback()])
    trainer.train(resume_from_checkpoint=last_checkpoint())

launched by ``trainguard run --nproc-per-node 2 train.py`` (on CPUs: ``use_cpu=True,
ddp_backend="gloo"``). One trainguard step is one optimizer step (with gradient accumulation, one
``on_step_begin`` … ``on_step_end``).

**Checkpoints.** trainguard decides when to save (``[checkpoint] interval``, a stop, the save
switch) and commits each checkpoint through its store (``RUN_DIR/checkpoints/step-N``: written in a
temporary directory, every file checksummed into the manifest, then renamed; ``latest_valid``;
retention). A checkpoint holds trainguard's state (model and optimizer through
``torch.distributed.checkpoint``, each rank's state) *and* the Trainer's own files, written through
public APIs into the same directory before the commit: ``config.json`` and ``model.safetensors``
(``save_pretrained``), ``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json``,
``training_args.bin`` and ``rng_state_{rank}.pth``. So ``from_pretrained(step-N)`` loads it and
``Trainer.train(resume_from_checkpoint=step-N)`` resumes from it the Trainer's way: its loop
position, its data position (it skips the batches already trained in the epoch) and its random
number generators. :func:`last_checkpoint` names the newest valid one; the callback checks that
the Trainer resumed at the step trainguard resumed at, and says how to fix it when not.

**Hooks.** ``on_train_begin``: the :class:`~trainguard.guard.Guard` over the model, the optimizer and
the scheduler; it resumes its own state from the same checkpoint (:meth:`Guard.begin`) and starts
the liveness ping and the hang supervisor's sections. ``on_step_begin``: the ``step`` section.
``on_pre_optimizer_step``: the NaN/spike check (:meth:`Guard.should_step`) on the step's loss (the
mean of the model outputs' ``loss`` over the step's micro-batches, taken by a forward hook; after
each forward it is pinned as the loss that rides in a DDP gradient bucket,
:func:`trainguard.instability.fold.pin`, so the check runs no all-reduce of its own, with or
without gradient accumulation) and the gradient norm after the Trainer's clipping; a skipped step sets every gradient to ``None``,
so the ``optimizer.step()`` the Trainer still calls changes nothing (its scheduler still steps:
the Trainer counts the step, as trainguard does).
``on_step_end``: :meth:`Guard.step_end`, the agreed stop check and saves; a stop raises
:class:`~trainguard.outcomes.Requeue` out of ``train`` (exit code 75). ``on_train_end``:
:meth:`Guard.finish`.

Not supported (a clear error, exit code 2): ``save_strategy`` other than ``"no"`` (the Trainer
would write uncommitted checkpoints beside trainguard's), ``[checkpoint] async_save`` and the
node-local tier (the Trainer's files are written from the live state, into the persistent tier).

**In-process recovery** (on by default): the callback finds the ``Trainer`` up its call stack and
guards its DDP model (``model_wrapped``), so a lost peer is caught in any collective; a step whose
update was not applied runs again in ``on_pre_optimizer_step`` after :meth:`Guard.recover_in_step`
(the step's micro-batches, kept from ``get_batch_samples``, through the Trainer's own
``training_step``). A replacement's :func:`last_checkpoint` is :func:`join_checkpoint`. A rollback restores the model, optimizer and scheduler from the
known-good checkpoint; the Trainer's ``global_step`` and data position go on (the batches between
are skipped), so the run ends at ``max_steps`` steps *run*, fewer of them kept. The steps the
Trainer is ahead are saved with each checkpoint (:class:`TrainerSteps`), so a resume after a
rollback is checked against them. See ``docs/hf.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from . import compat
from . import dist as tgdist
from .checkpoint.store import Checkpoint, CheckpointStore
from .config import Config, config_from_env
from .events import EventLog, Hook
from .guard import Guard
from .instability import fold
from .launch_env import LaunchEnv
from .outcomes import BadInput
from .rejoin.auth import Seal, reporter
from .rejoin.protocol import RecoveryStore
from .rejoin.rank import lost_boundaries
from .rejoin.stores import open_store
from .state.determinism import capture_rng, restore_rng

try:
    from transformers import Trainer, TrainerCallback
except ImportError:
    raise ImportError("trainguard.hf needs transformers and accelerate: pip install 'trainguard[hf]'") from None


def _store_root(config: Config) -> Path:
    root = Path(config.checkpoint.dir)
    return root if root.is_absolute() else Path(config.run.dir) / root


def last_checkpoint(config: Optional[Config] = None) -> Optional[str]:
    """The newest valid checkpoint of the run (verified as ``[checkpoint] verify`` says), for
    ``Trainer.train(resume_from_checkpoint=...)``; ``None`` on a fresh start.

    Args:
        config: trainguard's config; default: the one ``trainguard run`` passed.
    """
    config = config if config is not None else config_from_env()
    found = CheckpointStore(_store_root(config), config.checkpoint.keep_last).latest_valid(config.checkpoint.verify)
    launch = LaunchEnv.from_environ()
    if config.recovery.in_process and launch.join is not None and launch.recovery_store:
        return str(join_checkpoint(config, launch, found))  # a replacement of a lost rank
    return str(found.path) if found is not None else None


def _check(args: Any, config: Config) -> None:
    """Refuse what the callback cannot guard (see the module doc).

    Raises:
        BadInput: names the setting and the value to use.
    """
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy != "no":
        raise BadInput(
            f"TrainingArguments(save_strategy={strategy!r}): under trainguard.hf trainguard decides when to save "
            "([checkpoint] interval); set save_strategy='no'"
        )
    if args.max_steps is None or args.max_steps < 1:
        raise BadInput("trainguard.hf needs TrainingArguments(max_steps=N): trainguard counts optimizer steps")
    if config.checkpoint.local.dir is not None:
        raise BadInput("trainguard.hf saves to the persistent tier only; unset checkpoint.local.dir")


def join_checkpoint(config: Config, launch: LaunchEnv, newest: Optional[Checkpoint]) -> Path:
    """A replacement of a lost rank (in-process recovery): a checkpoint directory from which the
    Trainer's own resume sets its loop up at the survivors' step, so that it meets them there.

    The Trainer reads its loop position (``trainer_state.json``: the global step, from which it
    skips the batches trained in the epoch) and this rank's random number generators
    (``rng_state_{rank}.pth``) before any callback runs. The directory,
    ``RUN_DIR/.hf-join/rank-N``, holds the newest committed checkpoint's files (hard links) with
    those two written for the survivors' step (read from the recovery store) and the lost rank's
    generators at that step boundary (its boundary file, or the copy in the recovery store when a
    spare node replaced its node). The model, optimizer and scheduler the
    Trainer loads from it are the checkpoint's; the Guard replaces them with the survivors' when
    it joins them (``on_train_begin``). The directory is removed after the first step.

    Raises:
        RuntimeError: no committed checkpoint yet (the Trainer cannot be set up at a step without
            one), no step from the survivors within ``[recovery] timeout``, or the lost rank kept
            no boundary of that step: this replacement fails and the launcher restarts the group.
    """
    rank = int(os.environ["RANK"])
    if newest is None:
        raise RuntimeError("no committed checkpoint yet to set the Trainer up from: the group restarts")
    seal = Seal(launch.recovery_key or b"", launch.recovery_nonce)
    refused = reporter(EventLog(config.run.dir))  # a security event per refused value
    store = RecoveryStore(open_store(launch.recovery_store), launch.recovery_group, seal, refused)
    step = store.survivors_step(launch.join, config.recovery.timeout)
    if step is None:
        raise RuntimeError(f"the survivors did not say their step within {config.recovery.timeout} s")
    kept, _ = lost_boundaries(Path(launch.recovery_dir), rank, store)  # its node's file, else the store's copy
    if step not in kept:
        raise RuntimeError(f"rank {rank} kept no state of step {step} (it kept {sorted(kept)})")
    directory = Path(config.run.dir) / ".hf-join" / f"rank-{rank}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    for f in newest.path.iterdir():
        if f.is_file() and f.name != "trainer_state.json" and not f.name.startswith("rng_state"):
            try:
                os.link(f, directory / f.name)
            except OSError:  # another file system
                shutil.copy2(f, directory / f.name)
    state = json.loads((newest.path / "trainer_state.json").read_text())
    state["global_step"] = step
    (directory / "trainer_state.json").write_text(json.dumps(state))
    now = capture_rng()
    restore_rng(kept[step]["rng"])
    name = f"rng_state_{rank}.pth" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else "rng_state.pth"
    torch.save(_hf_rng_state(), directory / name)
    restore_rng(now)
    return directory


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' own progress bars (``save_pretrained``'s "Writing model shards", which
    ``TrainingArguments(disable_tqdm=True)`` does not reach) off while trainguard saves, then back
    as they were (the Trainer's training bar is tqdm's own: untouched)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if was:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _calling_trainer() -> Any:
    """The ``transformers.Trainer`` whose loop called the running callback (found up the call
    stack: callbacks are not given it), ``None`` if none is there."""
    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), Trainer):
            return frame.f_locals["self"]
        frame = frame.f_back
    return None


def _hf_rng_state() -> dict[str, Any]:
    """The generators in the layout of the Trainer's ``rng_state_{rank}.pth``."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def _save_synced(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(directory: Path) -> None:
    for p in directory.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


class TrainerSteps:
    """The steps by which the Trainer's ``global_step`` is ahead of trainguard's step (a rollback
    undoes trainguard's steps, the Trainer counts on), as a Stateful saved in trainguard's
    checkpoints: a resume checks the Trainer's step against it."""

    def __init__(self) -> None:
        self.extra_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"extra_steps": self.extra_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.extra_steps = int(state["extra_steps"])


class TrainguardCallback(TrainerCallback):
    """The Trainer callback (see the module doc for what each hook does).

    Args:
        config: trainguard's :class:`~trainguard.config.Config`; default: the one ``trainguard run``
            passed (:func:`~trainguard.config.config_from_env`).
        extra_state: more ``{name: stateful}`` to save (as :class:`~trainguard.guard.Guard`).
        hooks: :class:`~trainguard.events.Hook` instances.

    Attributes:
        guard: the :class:`~trainguard.guard.Guard` (from ``on_train_begin``).
    """

    def __init__(
        self,
        config: Optional[Config] = None,
        *,
        extra_state: Optional[dict[str, Any]] = None,
        hooks: tuple[Hook, ...] | list[Hook] = (),
    ):
        self.config, self.extra_state, self.hooks = config, dict(extra_state or {}), list(hooks)
        self.guard: Optional[Guard] = None
        self.steps = TrainerSteps()
        self._losses: list[torch.Tensor] = []
        self._loss: Optional[torch.Tensor] = None  # their mean, the very tensor should_step gets (and the fold carries)
        self._handle: Any = None
        self._trainer: dict[str, Any] = {}
        self._hf: Any = None  # the Trainer itself (in-process recovery runs a step again through it)
        self._batches: Optional[list] = None  # the step's micro-batches (in-process recovery)
        self._join_dir: Optional[Path] = None  # a replacement's join_checkpoint() (removed after its first step)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        config = self.config if self.config is not None else config_from_env()
        try:
            _check(args, config)
        except BadInput as e:
            print(f"trainguard: error: {e.message}", flush=True)
            raise
        model, optimizer = kw["model"], getattr(kw["optimizer"], "optimizer", kw["optimizer"])
        self._trainer = {"args": args, "state": state, "model": model, "optimizer": optimizer, **kw}
        self._hf = _calling_trainer()
        self.guard = Guard(
            config,
            model=self._hf.model_wrapped if self._hf is not None else model,  # DDP: its backward is caught
            optimizer=optimizer,
            scheduler=kw.get("lr_scheduler"),
            extra_state={"hf_trainer": self.steps, **self.extra_state},
            hooks=self.hooks,
            checkpoint_files=self._write_trainer_files,
            redo_in_step=True,
            framework=None if self._hf is not None else "the Hugging Face Trainer (not found to call back into)",
        )
        if self._hf is not None and self.guard.in_process:
            self._wrap_trainer(self._hf)
        if self.guard.joining:
            self._join_dir = Path(config.run.dir) / ".hf-join" / f"rank-{self.guard.rank}"
        step = self.guard.begin(state.max_steps)
        self.guard.catch_peers()  # the step's first collective (the token count) comes before on_step_begin
        if step + self.steps.extra_steps != state.global_step:
            raise BadInput(
                f"trainguard resumed at step {step} (the Trainer's {step + self.steps.extra_steps}) but the Trainer "
                f"at step {state.global_step}: pass resume_from_checkpoint=trainguard.hf.last_checkpoint() to "
                "Trainer.train"
            )
        self._handle = model.register_forward_hook(self._take_loss)

    def _take_loss(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if module.training and loss is not None:
            self._losses.append(loss.detach())
            self._loss = torch.stack(self._losses).mean()
            fold.pin(self._loss)  # the step's loss so far: the micro-batch's backward carries it

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._losses, self._loss = [], None
        self.guard.step_begin()

    def _step_loss(self) -> torch.Tensor:
        if self._loss is None:
            self._loss = torch.zeros(())
        return self._loss

    def _wrap_trainer(self, trainer: Any) -> None:
        """Wrap two methods on this Trainer instance for in-process recovery: ``get_batch_samples``
        keeps each step's micro-batches (to run the step again), ``training_step`` records a lost
        peer its backward meets and goes on (the Trainer's DDP model finds unused parameters by
        default: its backward all-reduces the used-parameter map itself, outside trainguard's
        communication hook; the step is run again after the recovery)."""
        fetch, train = trainer.get_batch_samples, trainer.training_step

        def get_batch_samples(*args: Any, **kwargs: Any) -> Any:
            batches, items = fetch(*args, **kwargs)
            self._batches = batches
            return batches, items

        def training_step(*args: Any, **kwargs: Any) -> torch.Tensor:
            with self.guard.recoverable("backward"):
                return train(*args, **kwargs)
            return torch.zeros((), device=trainer.args.device)  # a lost peer: the step is run again

        trainer.get_batch_samples, trainer.training_step = get_batch_samples, training_step

    def _run_again(self) -> None:
        """Run the step's micro-batches again on the new group, as the Trainer ran them: the token
        count across ranks, forward and backward of each (DDP's all-reduce at the last one only),
        the gradient clipping. The recovery put this rank's random number generators back at the
        step's start."""
        t = self._hf
        model = t.model_wrapped
        self._losses, self._loss = [], None
        model.zero_grad(set_to_none=True)
        items = compat.trainer_num_items_in_batch(t, self._batches, t.args.device)
        for i, inputs in enumerate(self._batches):
            last = i == len(self._batches) - 1
            with contextlib.nullcontext() if last else t.accelerator.no_sync(model):
                t.training_step(model, inputs, items)
        if t.args.max_grad_norm is not None and t.args.max_grad_norm > 0:
            compat.trainer_clip_grad_norm(t, model)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        ok = self.guard.should_step(self._step_loss())
        if not ok and self._hf is not None and self.guard.recover_in_step():  # a lost peer, replaced
            self._run_again()
            ok = self.guard.should_step(self._step_loss())
        if not ok:
            for group in self._trainer["optimizer"].param_groups:
                for p in group["params"]:
                    p.grad = None
            self.guard.release_step()  # the Trainer calls optimizer.step() next: a no-op without gradients

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._join_dir is not None:  # the Trainer has read it (its generators after the data skip)
            shutil.rmtree(self._join_dir, ignore_errors=True)
            self._join_dir = None
        self.guard.step_end(loss=self._step_loss())
        self.steps.extra_steps = state.global_step - self.guard.step

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
        fold.pin(None)
        if self._hf is not None:
            vars(self._hf).pop("get_batch_samples", None)
            vars(self._hf).pop("training_step", None)
        self.guard.finish()
        self.guard.close()

    def _write_trainer_files(self, directory: Path) -> None:
        """The Trainer's checkpoint files of this step, into ``directory`` (every rank; the model,
        optimizer, scheduler, trainer state and arguments from rank 0, the generators from each)."""
        t = self._trainer
        rank = tgdist.rank()
        if rank == 0:
            with _no_progress_bars():  # save_pretrained's "Writing model shards" bar at every checkpoint
                t["model"].save_pretrained(directory, safe_serialization=True)
                if t.get("processing_class") is not None:
                    t["processing_class"].save_pretrained(directory)
            _save_synced(t["optimizer"].state_dict(), directory / "optimizer.pt")
            if t.get("lr_scheduler") is not None:
                _save_synced(t["lr_scheduler"].state_dict(), directory / "scheduler.pt")
            _save_synced(t["args"], directory / "training_args.bin")
            t["state"].save_to_json(str(directory / "trainer_state.json"))
        name = f"rng_state_{rank}.pth" if tgdist.world_size() > 1 else "rng_state.pth"
        _save_synced(_hf_rng_state(), directory / name)
        _fsync_tree(directory)
