"""The Guard (:mod:`trainguard.guard.guard`) and its components: the outcome edge
(:mod:`~trainguard.guard.edge`), in-process recovery (:mod:`~trainguard.guard.inprocess`) and the
response to silent data corruption (:mod:`~trainguard.guard.sdc_response`)."""

from .guard import PING_FAILURE_GRACE, PROGRESS_SECONDS, Guard

__all__ = ["Guard", "PING_FAILURE_GRACE", "PROGRESS_SECONDS"]
