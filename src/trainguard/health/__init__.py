"""Health checks: collective liveness ping, GPU health (NVML), start-up preflight."""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from .. import dist as tgdist
from ..checkpoint.store import CheckpointStore
from ..events import EventLog
from ..outcomes import BadInput
from ..sections import HealthSection
from .ping import PING_FAILED_EXIT, LivenessPing, PeerLostError
from .preflight import PreflightError, run_preflight

__all__ = [
    "PING_FAILED_EXIT",
    "LivenessPing",
    "PeerLostError",
    "PreflightError",
    "run_preflight",
    "start",
    "start_ping",
]


def start(
    cfg: HealthSection,
    store: CheckpointStore,
    keep_last: int,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    events: EventLog,
    step: int,
    hosts: list[str],
    rank: int,
    world_size: int,
    on_ping_failure: Optional[Callable[[str], None]] = None,
) -> Optional[LivenessPing]:
    """Before the first step, on every rank: the ``[health]`` preflight (a ``preflight`` event
    either way), then the liveness ping of a multi-rank run (a collective).

    Args:
        cfg: the ``[health]`` section.
        store, keep_last: the persistent checkpoint store and ``[checkpoint] keep_last`` (free space).
        model, optimizer: their size and device decide the space and device checks.
        events: the rank's event log; step: the step training starts from.
        hosts: every rank's host name (index = rank), for the ping's reports.
        on_ping_failure: called from the ping thread when a ping times out (see :mod:`.ping`).
    Returns:
        The running ping, or ``None`` (single rank, or ``[health] ping = false``).
    Raises:
        BadInput: a preflight check failed (names it).
    """
    device = next(model.parameters()).device
    if cfg.preflight:
        try:
            result = run_preflight(
                store.root, model, optimizer, keep_last, _newest_checkpoint_bytes(store), device, cfg.gpu_check
            )
        except PreflightError as e:
            raise BadInput(f"preflight: {e}") from None
        events.emit("preflight", step, rank=rank, **result)
    return start_ping(cfg, hosts, events, device, world_size, on_ping_failure)


def start_ping(
    cfg: HealthSection,
    hosts: list[str],
    events: EventLog,
    device: torch.device,
    world_size: int,
    on_ping_failure: Optional[Callable[[str], None]] = None,
) -> Optional[LivenessPing]:
    """The liveness ping of a multi-rank run (a collective: its group and an agreed start time),
    or ``None`` (single rank, or ``[health] ping = false``). :func:`start` runs it after the
    preflight; in-process recovery runs it again on the new group."""
    if not cfg.ping or world_size < 2:
        return None
    ping = LivenessPing(cfg.ping_interval, cfg.ping_timeout, hosts, events, device, on_ping_failure)
    ping.start(tgdist.broadcast_object(time.time()))
    return ping


def _newest_checkpoint_bytes(store: CheckpointStore) -> Optional[int]:
    """Size of the newest committed checkpoint from its manifest (``None``: none, or unreadable)."""
    from ..checkpoint.manifest import read_manifest

    committed = store.committed()
    try:
        return sum(f["size"] for f in read_manifest(committed[-1].path)["files"].values()) if committed else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
