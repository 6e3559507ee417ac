"""Which recovery a lost rank gets, from the default group's backend and ``[recovery] in_process``.

In-process recovery needs every survivor out of the collective that lost a peer. On gloo a dead
peer's connections close and the collective fails within milliseconds (and :mod:`.sever` ends the
waits that remain): that is what the tests exercise, end to end. On NCCL a peer that dies inside
a collective on one node (NVLink, shared memory) closes nothing: the survivors wait in the
collective until NCCL's timeout (10 min by default) unless their communicators are aborted
(:mod:`.abort`), and that path has not run on two GPUs yet. So by default an NCCL job recovers a
lost rank by a **group restart**: rank 0 declines in-process recovery at start with the reason
(:meth:`~.protocol.RecoveryStore.decline`) and the launcher ends the survivors at once on a lost
rank (not after ``[recovery] timeout``, not after NCCL's). ``in_process = "nccl-experimental"``
opts into the abort path.

The rule, per backend (``in_process`` = ``true`` / ``"nccl-experimental"`` / ``false``):

==========================  ===================  ============================  =============
backend of the default      true                 "nccl-experimental"           false
==========================  ===================  ============================  =============
gloo                        in-process + abort   in-process + abort watcher    group restart
                            watcher
nccl, "cpu:gloo,cuda:nccl"  declined: restart    in-process + abort watcher    group restart
any other (xccl, ucc, ...)  declined: restart    declined: restart             group restart
none (one process)          in-process (no-op)   in-process (no-op)            group restart
==========================  ===================  ============================  =============

A backend string names NCCL when one of its parts is ``nccl`` (torch's ``"cpu:gloo,cuda:nccl"``,
the default group ``init_process_group()`` makes on a GPU machine: the GPU's collectives are
NCCL's). On gloo the abort watcher is on whenever in-process recovery is (issue 52: a loss is
learned from the launcher, never only from the transport): it cuts the group's connections
(gloo's ``ProcessGroup.abort()`` does not end a blocked collective in torch 2.13, measured) as
soon as the launcher publishes the loss, so a survivor does not wait on a dead rank whose children
(DataLoader workers forked after ``init_process_group``) hold its sockets open; the same
mechanism NCCL needs, exercised without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

EXPERIMENTAL = "nccl-experimental"  # the [recovery] in_process value that opts into the abort path
VERIFIED = ("gloo",)  # backends in-process recovery is tested on, end to end

InProcessValue = Union[bool, str]


@dataclass(frozen=True)
class BackendPolicy:
    """The decision for one job.

    Attributes:
        in_process: a lost rank is replaced in-process (``False``: the group restarts from the
            newest checkpoint).
        abort: survivors abort their old communicators when the launcher publishes the loss
            (:class:`~trainguard.rejoin.abort.CommAbort`), and the new group is created eagerly.
        declined: why in-process recovery does not apply although it is on (rank 0 says it on the
            console and tells the launcher, which then kills the survivors at once); ``None`` otherwise.
    """

    in_process: bool
    abort: bool
    declined: Optional[str] = None


def parts(backend: Optional[str]) -> tuple[str, ...]:
    """The backend names in a backend string, lower case: ``"cpu:gloo,cuda:nccl"`` → ``("gloo", "nccl")``."""
    if not backend:
        return ()
    return tuple(p.rpartition(":")[2].strip().lower() for p in backend.split(",") if p.strip())


def is_nccl(backend: Optional[str]) -> bool:
    """Whether the backend string has NCCL in it (the GPU collectives go through NCCL)."""
    return "nccl" in parts(backend)


def decide(backend: Optional[str], in_process: InProcessValue) -> BackendPolicy:
    """The recovery for a job whose default process group has ``backend`` (``dist.get_backend()``;
    ``None``: no group) under ``[recovery] in_process`` (see the module's table). Pure.

    Raises:
        ValueError: ``in_process`` is neither a bool nor :data:`EXPERIMENTAL`.
    """
    if not isinstance(in_process, bool) and in_process != EXPERIMENTAL:
        raise ValueError(f"[recovery] in_process: expected true, false or {EXPERIMENTAL!r}, got {in_process!r}")
    if in_process is False:
        return BackendPolicy(in_process=False, abort=False)
    names = parts(backend)
    experimental = in_process == EXPERIMENTAL
    if not names:
        return BackendPolicy(in_process=True, abort=False)
    if is_nccl(backend):
        if experimental:
            return BackendPolicy(in_process=True, abort=True)
        return BackendPolicy(
            in_process=False,
            abort=False,
            declined=f'not verified on NCCL here; [recovery] in_process = "{EXPERIMENTAL}" opts in',
        )
    if all(n in VERIFIED for n in names):  # the loss learned from the launcher, as on NCCL (module doc)
        return BackendPolicy(in_process=True, abort=True)
    return BackendPolicy(
        in_process=False,
        abort=False,
        declined=f'not verified on backend "{backend}" here, only on gloo and, with "{EXPERIMENTAL}", NCCL',
    )


__all__ = ["EXPERIMENTAL", "VERIFIED", "BackendPolicy", "decide", "is_nccl", "parts"]
