"""The optimal checkpoint interval from the checkpoint cost C and the mean time between failures M.

* Young: ``τ = sqrt(2·C·M)`` — J. W. Young, "A first order approximation to the optimum
  checkpoint interval", Communications of the ACM 17(9), 530–531, 1974.
* Daly: ``τ = sqrt(2·C·M)·[1 + (1/3)·sqrt(C/(2M)) + (1/9)·(C/(2M))] − C`` for ``C < 2M``, else
  ``τ = M`` — J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
  dumps", Future Generation Computer Systems 22(3), 303–312, 2006.

Both give the compute time between two checkpoints (the save itself not included), so the run's
own interval is compared in steps × the median step time.
"""

from __future__ import annotations

import math
from typing import Optional


def young_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young's first-order optimum, ``sqrt(2·C·M)`` seconds of compute between checkpoints."""
    if save_seconds < 0 or mtbf_seconds <= 0:
        raise ValueError(f"need C >= 0 and M > 0, got C={save_seconds}, M={mtbf_seconds}")
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


def daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Daly's higher-order optimum (seconds of compute between checkpoints); ``M`` when ``C ≥ 2M``."""
    c, m = save_seconds, mtbf_seconds
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return young_interval(c, m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def recommend(
    save_seconds: Optional[float],
    wall_seconds: float,
    failures: int,
    seconds_per_step: Optional[float],
    used_steps: Optional[float],
) -> dict:
    """The report's ``checkpoint_interval`` section: C, M, Young's and Daly's intervals in seconds
    and steps, and the interval the run used. Without failures or a measured save there is no
    recommendation; ``note`` says why."""
    per_step = seconds_per_step if seconds_per_step and seconds_per_step > 0 else None
    out: dict = {
        "save_seconds": save_seconds,
        "failures": failures,
        "mtbf_seconds": None,
        "young_seconds": None,
        "young_steps": None,
        "daly_seconds": None,
        "daly_steps": None,
        "used_steps": used_steps,
        "used_seconds": used_steps * per_step if used_steps and per_step else None,
        "seconds_per_step": per_step,
        "note": None,
    }
    if failures <= 0:
        out["note"] = "no unplanned failures observed: no mean time between failures, no recommendation"
        return out
    if save_seconds is None:
        out["note"] = "no committed checkpoint: the checkpoint cost is unknown, no recommendation"
        return out
    m = wall_seconds / failures
    young, daly = young_interval(save_seconds, m), daly_interval(save_seconds, m)
    out.update(
        mtbf_seconds=m,
        young_seconds=young,
        daly_seconds=daly,
        young_steps=young / per_step if per_step else None,
        daly_steps=daly / per_step if per_step else None,
    )
    if per_step is None:
        out["note"] = "no step time measured: intervals in seconds only"
    return out
