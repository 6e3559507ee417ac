"""trainguard for PyTorch Lightning: one callback gives a ``Trainer`` trainguard's guarantees.

::

    sampler = trainguard.ResumableSampler(len(dataset), rank, world_size, seed=0)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1000,
                      use_distributed_sampler=False, enable_checkpointing=False,
                      callbacks=[TrainguardCallback(sampler=sampler)])
    trainer.fit(module, DataLoader(dataset, batch_size=8, sampler=sampler))

launched by ``trainguard run --nproc-per-node 2 train.py``. One trainguard step is one optimizer step
(one ``training_step``). What the callback does, hook by hook:

* ``on_fit_start`` (after Lightning's strategy set up DDP and the optimizer): builds the
  :class:`~trainguard.guard.Guard` over ``trainer.strategy.model``, the optimizer, the step
  scheduler, the sampler and Lightning's loop progress (:class:`LoopState`), and resumes from the
  newest valid checkpoint (:meth:`Guard.begin`). Lightning's own ``ckpt_path`` is not used.
* ``on_train_start``: takes SIGTERM/SIGUSR1/SIGINT back from Lightning's handlers (registered
  just before; Lightning's SIGTERM handler runs a collective inside the handler).
* ``on_train_batch_start``: opens the ``step`` section (:meth:`Guard.step_begin`); restores the
  random number generators to the state the last step's end (or the resume) left, kept at
  ``on_fit_start`` and ``on_train_batch_end``: the draws of Lightning's work between steps
  (set-up, a new epoch's DataLoader iterator and validation's, which draw base seeds) do not move
  the training's streams, so a run resumed or recovered at any step (a validation step included:
  the resumed run does not validate it again) draws what the uninterrupted one drew.
* ``on_before_optimizer_step``: the NaN/spike check (:meth:`Guard.should_step`) on the loss
  Lightning passed to ``on_before_backward``. A peer lost in the step (in-process recovery, on by
  default): :meth:`Guard.recover_in_step` meets the lost rank's replacement on a new group, then
  the step's ``training_step`` and backward run again on the same batch (the random number
  generators back at the step's start) and are checked again; Lightning's optimizer step then
  applies the group's gradients. The replacement runs the script from its top; Lightning's
  set-up collectives complete on it alone (:mod:`trainguard.rejoin.catch`), and it takes the fit
  loop's counters from a survivor (a shared part: Lightning's restart logic reads a mid-step
  state as the end of the previous step). A skipped step sets every gradient to ``None`` so
  the optimizer step leaves the parameters alone (torch's optimizers skip parameters without a
  gradient; Lightning still counts the step, as trainguard does). A rollback reloads the
  known-good checkpoint in the process, the fit loop's counters included; Lightning then finishes
  the rolled-back step (its counters, a scheduler step), so ``on_train_batch_end`` puts the
  checkpoint's counters and scheduler back: the run goes on exactly as a resume from that
  checkpoint would (``max_steps`` follows any difference between Lightning's ``global_step`` and
  trainguard's step).
* ``on_train_batch_end``: :meth:`Guard.step_end` — the agreed stop check, scheduled and
  emergency saves on every rank; a stop raises :class:`~trainguard.outcomes.Requeue` out of
  ``fit`` (exit code 75).
* ``on_validation_start``/``end``: the ``validation`` section of the hang supervisor (fit's
  validation: ``trainer.training`` is false while it runs).
* ``on_train_end``: :meth:`Guard.finish` (final save, ``end`` event); ``on_exception`` and
  ``teardown`` release what the Guard installed.

Supported: ``strategy="ddp"`` (gloo or NCCL) and a single device, one optimizer, at most one
scheduler stepping per step, ``accumulate_grad_batches=1``, ``max_steps`` set. Not supported (a
clear error, exit code 2): other strategies, several optimizers, gradient accumulation by Lightning
(trainguard's micro-batches, ``Guard.run_step``, or accumulation inside ``training_step`` keep one
step per batch). See ``docs/lightning.md``.

Imports ``lightning.pytorch`` if installed, else ``pytorch_lightning`` (the ``[lightning]`` extra);
the callback is an instance of that package's ``Callback``.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Optional

from .config import Config, config_from_env
from .events import Hook
from .guard import Guard
from .outcomes import BadInput, Outcome
from .state.trainstate import RNGState

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl
    except ImportError:
        raise ImportError(
            "trainguard.lightning needs PyTorch Lightning 2.x: pip install 'trainguard[lightning]'"
        ) from None


class LoopState:
    """Lightning's fit-loop progress (epoch, batch and optimizer-step counters) plus the steps a
    rollback added to ``max_steps``, as one Stateful saved in trainguard's checkpoints.

    Loading it before the fit loop runs is what Lightning's own resume does
    (``fit_loop.load_state_dict``): the loop restarts mid-epoch from those counters.
    """

    def __init__(self, trainer: pl.Trainer, callback: TrainguardCallback):
        self.trainer, self.callback = trainer, callback

    def state_dict(self) -> dict[str, Any]:
        return {"fit_loop": self.trainer.fit_loop.state_dict(), "extra_steps": self.callback.extra_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.fit_loop.load_state_dict(state["fit_loop"])
        self.callback.extra_steps = int(state["extra_steps"])


def _check_trainer(trainer: pl.Trainer, config: Config) -> None:
    """Refuse what the callback cannot guard (see the module doc).

    Raises:
        BadInput: names the setting and what to use instead.
    """
    strategy = type(trainer.strategy).__name__
    if strategy not in ("DDPStrategy", "SingleDeviceStrategy"):
        raise BadInput(
            f"trainguard.lightning supports strategy='ddp' and a single device; this Trainer uses {strategy}"
        )
    if trainer.max_steps is None or trainer.max_steps < 1:
        raise BadInput("trainguard.lightning needs Trainer(max_steps=N): trainguard counts optimizer steps")
    if trainer.accumulate_grad_batches != 1:
        raise BadInput(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}): trainguard.lightning needs one "
            "optimizer step per batch (accumulate inside training_step, or use [oom] micro-batches)"
        )
    if len(trainer.optimizers) != 1:
        raise BadInput(
            f"trainguard.lightning supports one optimizer; configure_optimizers gave {len(trainer.optimizers)}"
        )
    configs = trainer.lr_scheduler_configs
    if len(configs) > 1 or (configs and (configs[0].interval != "step" or configs[0].frequency != 1)):
        raise BadInput(
            "trainguard.lightning supports at most one LR scheduler, with interval='step' and frequency=1 "
            "(its state is saved with each step's checkpoint)"
        )


class TrainguardCallback(pl.Callback):
    """The Lightning callback (see the module doc for what each hook does).

    Args:
        config: trainguard's :class:`~trainguard.config.Config`; default: the one ``trainguard run``
            passed (:func:`~trainguard.config.config_from_env`).
        sampler: the training DataLoader's sampler, saved and restored (the data position); a
            :class:`~trainguard.sampler.ResumableSampler` makes a resume continue exactly where
            the run stopped, on any world size. Pass the same object to the DataLoader with
            ``Trainer(use_distributed_sampler=False)``.
        extra_state: more ``{name: stateful}`` to save (as :class:`~trainguard.guard.Guard`).
        hooks: :class:`~trainguard.events.Hook` instances.

    Attributes:
        guard: the :class:`~trainguard.guard.Guard` (from ``on_fit_start``).
        extra_steps: steps Lightning has run beyond trainguard's step count (rollbacks, re-runs).
    """

    def __init__(
        self,
        config: Optional[Config] = None,
        *,
        sampler: Any = None,
        extra_state: Optional[dict[str, Any]] = None,
        hooks: tuple[Hook, ...] | list[Hook] = (),
    ):
        self.config, self.sampler = config, sampler
        self.extra_state, self.hooks = dict(extra_state or {}), list(hooks)
        self.guard: Optional[Guard] = None
        self.extra_steps = 0
        self._max_steps = 0
        self._rng: Optional[dict] = None  # the generators' state to put back at the next batch's start
        self._rngs = RNGState()  # copy-on-change: the same dict while no generator moved
        self._loss: Any = None
        self._rolled_back: Optional[tuple[dict, Optional[dict]]] = None
        self._batch: Any = None  # (batch, batch_idx) of the step in progress
        self._fetched: Optional[dict] = None  # the sampler's state after fetching it (in-process recovery)
        self._sections = contextlib.ExitStack()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        config = self.config if self.config is not None else config_from_env()
        with _bad_input_leaves():
            _check_trainer(trainer, config)
        configs = trainer.lr_scheduler_configs
        self.guard = Guard(
            config,
            model=trainer.strategy.model,
            optimizer=trainer.optimizers[0],
            scheduler=configs[0].scheduler if configs else None,
            sampler=self.sampler,
            extra_state=self.extra_state,
            shared_state={"lightning": LoopState(trainer, self)},
            hooks=self.hooks,
            redo_in_step=True,
        )
        self._max_steps = trainer.max_steps
        self.guard.begin(trainer.max_steps)
        self._follow(trainer)
        self._hold_rng()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guard.take_back_signals()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._hold_rng()  # the new epoch's DataLoader iterator draws its base seed after this

    def _hold_rng(self) -> None:
        """Keep the random number generators as they are now (the end of the last step, as its
        checkpoint holds them, or the resume), to be put back at the next batch's start: what
        Lightning draws between steps (set-up, a new epoch's DataLoader iterator, validation's
        iterator, created before ``on_validation_start``) does not move the training's streams, so
        that a step's random numbers follow from the previous step's alone (a resume, a
        replacement). A run resumed from a validation step's checkpoint does not validate that step
        again: its validation's draws must not count."""
        if self._rng is None:
            self._rng = self._rngs.state_dict()

    def _put_back_rng(self) -> None:
        """The generators back where :meth:`_hold_rng` kept them (nothing to do, a fingerprint's
        comparison, when nothing drew in between: the common step)."""
        if self._rng is not None and self._rngs.state_dict() is not self._rng:
            self._rngs.load_state_dict(self._rng)
        self._rng = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        self._put_back_rng()
        self.guard.step_begin()
        self._batch = (batch, batch_idx)
        self._fetched = self.sampler.state_dict() if self.sampler is not None and self.guard.in_process else None

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        # the very tensor backward() runs on (not a detached copy): should_step() then finds it
        # noted in a DDP gradient bucket and runs no all-reduce of its own (instability.fold)
        self._loss = loss

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        step = self.guard.step
        ok = self.guard.should_step(self._loss)
        if not ok and self.guard.recover_in_step():  # a lost peer, replaced: this step's backward again
            self._run_again(trainer, optimizer)
            ok = self.guard.should_step(self._loss)
        if not ok:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            if self.guard.step != step:  # a rollback: the known-good checkpoint's counters and scheduler
                self._rolled_back = copy.deepcopy(self._restored(trainer))

    def _run_again(self, trainer: pl.Trainer, optimizer: Any) -> None:
        """Run the step's ``training_step`` and backward again on the new group, on the same batch:
        the recovery put this rank's random number generators back at the step's start, and its
        data position at the step's (the batch is in hand: the position after fetching it is put
        back). Lightning's counters stay where the step is."""
        if self._fetched is not None:
            self.sampler.load_state_dict(self._fetched)
        optimizer.zero_grad(set_to_none=True)
        batch, batch_idx = self._batch
        out = trainer.strategy.training_step(batch, batch_idx)
        loss = out["loss"] if isinstance(out, dict) else out
        trainer.strategy.backward(loss, optimizer)  # calls on_before_backward: self._loss

    @staticmethod
    def _restored(trainer: pl.Trainer) -> tuple[dict, Optional[dict]]:
        configs = trainer.lr_scheduler_configs
        return trainer.fit_loop.state_dict(), configs[0].scheduler.state_dict() if configs else None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._rolled_back is not None:
            # Lightning went on with the rolled-back step (its step counters, a scheduler step): put
            # back what the checkpoint holds, as a resume from it would find it
            fit_loop, scheduler = self._rolled_back
            trainer.fit_loop.load_state_dict(fit_loop)
            if scheduler is not None:
                trainer.lr_scheduler_configs[0].scheduler.load_state_dict(scheduler)
            self._rolled_back = None
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.guard.step_end(loss=loss.detach() if loss is not None else None)
        self._follow(trainer)
        self._hold_rng()  # as the step's checkpoint holds them

    def _follow(self, trainer: pl.Trainer) -> None:
        """Keep Lightning's ``max_steps`` ahead of its ``global_step`` by the steps trainguard undid."""
        self.extra_steps = trainer.global_step - self.guard.step
        trainer.fit_loop.epoch_loop.max_steps = self._max_steps + self.extra_steps

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # fit's validation: ``trainer.training`` is False while it runs, so test the fit, not the stage
        if self.guard is not None and trainer.state.fn == "fit":
            self._sections.enter_context(self.guard.section("validation"))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sections.close()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guard.finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._sections.close()
        if self.guard is not None and not isinstance(exception, Outcome):
            self.guard.abandon()  # a crash: release without waiting for peers

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.guard is not None:
            self.guard.close()


@contextlib.contextmanager
def _bad_input_leaves():
    """Print a :class:`BadInput` found before the Guard exists the way the Guard would (one line)."""
    try:
        yield
    except BadInput as e:
        import sys

        print(f"trainguard: error: {e.message}", file=sys.stderr, flush=True)
        raise
