"""The Guard (:mod:`trainguard.guard.guard`) and its components, built in order by
:mod:`~trainguard.guard.parts`: the outcome edge (:mod:`~trainguard.guard.edge`), the start and
end of training (:mod:`~trainguard.guard.lifecycle`), the step's points
(:mod:`~trainguard.guard.boundary`), stop and save (:mod:`~trainguard.guard.saving`), rollbacks
(:mod:`~trainguard.guard.rollback`), the replica check's flow (:mod:`~trainguard.guard.sdc_flow`)
and the response to silent data corruption (:mod:`~trainguard.guard.sdc_response`), in-process
recovery (:mod:`~trainguard.guard.inprocess`, :mod:`~trainguard.guard.recovering`), and the shared
view of where a rank stands (:mod:`~trainguard.guard.world`)."""

from .build import PING_FAILURE_GRACE
from .guard import Guard
from .saving import PROGRESS_SECONDS

__all__ = ["Guard", "PING_FAILURE_GRACE", "PROGRESS_SECONDS"]
