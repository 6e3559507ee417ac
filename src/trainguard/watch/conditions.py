"""``Condition``: the outcome of one check, and the number formatting the messages share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OK = "ok"
ALERT = "alert"
SKIPPED = "skipped"


@dataclass
class Condition:
    """One named condition of one watch pass.

    Attributes:
        name: stable identifier, the de-duplication key (``disk[checkpoints]``, ``job``, ``hang``...).
        status: ``"ok"``, ``"alert"`` or ``"skipped"`` (could not be checked, or nothing to check).
        message: one human line with the numbers.
        values: the numbers behind the message (JSON-serializable), recorded in events.
    """

    name: str
    status: str
    message: str
    values: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        """``name: status: message``, the line printed for each condition."""
        return f"{self.name}: {self.status}: {self.message}"


def fmt_bytes(n: float) -> str:
    """``1536`` → ``'1.5 KiB'`` (binary units, one decimal)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1023.95 or unit == "TiB":  # no "1024.0 KiB"
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_seconds(s: float) -> str:
    """``5400`` → ``'1.5 h'``; seconds, minutes, hours or days, whichever reads best."""
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "min"), (172800, 3600, "h")):
        if s < limit:
            return f"{s / div:.0f} {unit}" if unit == "s" else f"{s / div:.1f} {unit}"
    return f"{s / 86400:.1f} days"
