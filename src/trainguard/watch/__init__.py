"""``trainguard watch RUN_DIR``: operator watchdogs with real notifications.

Checks disk space, inodes and days of headroom of the run's filesystems, the SLURM job's state, a
hang (no training event for ``max_silence``) and node memory; sends one apprise notification per
condition when it starts alerting and one when it recovers (state in ``RUN_DIR/watch_state.json``,
events ``watch_alert`` / ``watch_recovered`` / ``watch_notify_failed`` in ``events.jsonl``).
One pass for cron, or a loop every N seconds.
"""

from .conditions import ALERT, OK, SKIPPED, Condition
from .config import WatchSection, section_from_overrides
from .errors import WatchError
from .notify import Notifier
from .runner import collect, main, run_pass, watch_loop

__all__ = [
    "ALERT",
    "OK",
    "SKIPPED",
    "Condition",
    "Notifier",
    "WatchError",
    "WatchSection",
    "collect",
    "main",
    "run_pass",
    "section_from_overrides",
    "watch_loop",
]
