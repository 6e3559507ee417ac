"""The learning-rate ramp after a rollback, composed with the user's scheduler.

After a rollback to step ``K`` the effective learning rate of step number ``s`` (1-based, ``s > K``)
is the scheduler's rate times::

    m(s) = lr_factor + (1 - lr_factor) · min(1, (s - K - 1) / lr_ramp_steps)

so the first step after the rollback runs at ``lr_factor`` and step ``K + 1 + lr_ramp_steps`` is back
at the scheduler's rate (``lr_ramp_steps = 0``: no reduction). The multiplier is applied in an optimizer *step pre-hook* and undone in a
*post-hook*: the scheduler never sees the scaled value, so chainable schedulers (which read
``group["lr"]``) do not compound it, and the user's loop is unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch


class LRRamp:
    """Scales every parameter group's ``lr`` during ``optimizer.step()`` while a ramp is active.

    Args:
        optimizer: the optimizer to hook.
        current_step: returns the step number in progress (1-based), read at each ``step()``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, current_step: Callable[[], int]):
        self.optimizer, self.current_step = optimizer, current_step
        self.start: Optional[int] = None  # the step the run rolled back to (K)
        self.factor = 1.0
        self.steps = 0
        self._saved: list[Any] = []
        self._hooks = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def close(self) -> None:
        """Remove the optimizer hooks (safe to call twice)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def begin(self, start: int, factor: float, steps: int) -> None:
        """Start a ramp after a rollback to step ``start`` (replaces any ramp in progress)."""
        self.start, self.factor, self.steps = start, factor, steps

    def multiplier(self, step: int) -> float:
        """m(step) from the module formula; 1.0 without a ramp."""
        if self.start is None or self.steps == 0:
            return 1.0
        done = min(1.0, max(0, step - self.start - 1) / self.steps)
        return self.factor + (1.0 - self.factor) * done

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        m = self.multiplier(self.current_step())
        if m == 1.0:
            if self.start is not None and self.current_step() > self.start + self.steps:
                self.start = None  # ramp over
            return
        self._saved = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * m

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._saved:
            for g, lr in zip(optimizer.param_groups, self._saved):
                g["lr"] = lr
            self._saved = []

    def state_dict(self) -> dict[str, Any]:
        return {"start": self.start, "factor": self.factor, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start, self.factor, self.steps = (
            state.get("start"),
            float(state.get("factor", 1.0)),
            int(state.get("steps", 0)),
        )
