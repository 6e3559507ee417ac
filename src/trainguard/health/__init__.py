"""Health checks: collective liveness ping, GPU health (NVML), start-up preflight."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from .. import dist as tgdist
from ..checkpoint.manifest import read_manifest
from ..exitcodes import exit_bad_input
from .ping import LivenessPing
from .preflight import PreflightError, run_preflight

if TYPE_CHECKING:
    from ..guard import Guard

__all__ = ["LivenessPing", "PreflightError", "run_preflight", "start"]


def start(guard: "Guard") -> Optional[LivenessPing]:
    """Before the first step, on every rank: the ``[health]`` preflight (exit 2 naming the failed
    check; a ``preflight`` event either way), then the liveness ping of a multi-rank run.

    Returns:
        The running ping, or ``None`` (single rank, or ``[health] ping = false``).
    """
    cfg = guard.cfg.health
    device = next(guard.model.parameters()).device
    if cfg.preflight:
        newest = _newest_checkpoint_bytes(guard)
        try:
            result = run_preflight(guard.store.root, guard.model, guard.optimizer, guard.cfg.checkpoint.keep_last,
                                   newest, device, cfg.gpu_check)
        except PreflightError as e:
            exit_bad_input(f"preflight: {e}", guard.events)
        guard.events.emit("preflight", guard.step, rank=guard.rank, **result)
    if not cfg.ping or guard.world_size < 2:
        return None
    ping = LivenessPing(cfg.ping_interval, cfg.ping_timeout, guard.straggler.hosts, guard.events, device)
    ping.start(tgdist.broadcast_object(time.time()))
    return ping


def _newest_checkpoint_bytes(guard: "Guard") -> Optional[int]:
    """Size of the newest committed checkpoint from its manifest (``None``: none, or unreadable)."""
    committed = guard.store.committed()
    try:
        return sum(f["size"] for f in read_manifest(committed[-1].path)["files"].values()) if committed else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
