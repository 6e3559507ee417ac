"""``WatchSection``: the settings of ``trainguard watch`` and how ``key=value`` overrides build it.

Every threshold is off (``None``) unless set, except ``max_silence``. Durations take seconds,
``"30m"`` or ``"HH:MM:SS"``; sizes take bytes or ``"50GiB"`` (see :mod:`trainguard.sections`).
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, ValidationError, field_validator

from ..config import parse_value, split_key_value
from ..sections import Bytes, Section, parse_duration
from .errors import WatchError


class WatchSection(Section):
    """``[watch]``: operator watchdogs (disk, inodes, SLURM job, hang, node memory) and notifications."""

    notify: list[str] = Field(
        [],
        description="apprise notification URLs, e.g. 'mailto://smtp.host:25?from=a@b&to=c@d', 'json://host:8080/hook', 'slack://...'",
    )
    every: Optional[float] = Field(None, gt=0, description="seconds between passes ('5m'); unset = one pass (for cron)")
    paths: list[str] = Field(
        [], description="extra paths whose filesystems are checked, relative to the run dir unless absolute"
    )
    min_free_bytes: Optional[Bytes] = Field(
        None, description="alert when a filesystem has less free space than this (bytes or '50GiB')"
    )
    max_used_percent: Optional[float] = Field(
        None, gt=0, lt=100, description="alert when a filesystem's used space exceeds this percentage"
    )
    max_inodes_percent: Optional[float] = Field(
        None, gt=0, lt=100, description="alert when a filesystem's used inodes exceed this percentage"
    )
    min_days: Optional[float] = Field(
        None,
        gt=0,
        description="alert when the checkpoint filesystem's free space lasts fewer days at the measured checkpoint growth",
    )
    job_name: Optional[str] = Field(
        None, min_length=1, description="SLURM job name that must be RUNNING or PENDING (squeue --name)"
    )
    job_id: Optional[str] = Field(
        None, pattern=r"^\d+([_+]\d+)?$", description="SLURM job id that must be RUNNING or PENDING (squeue --jobs)"
    )
    max_silence: float = Field(
        1800.0,
        gt=0,
        description="alert when the newest training event is older than this (seconds or '30m') and the run has not ended",
    )
    max_memory_percent: Optional[float] = Field(
        None,
        gt=0,
        lt=100,
        description="alert when the node's used memory (psutil virtual_memory().percent) exceeds this",
    )

    @field_validator("every", "max_silence", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Optional[float]:
        return parse_duration(v)

    @field_validator("notify", "paths", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("job_name", "job_id", mode="before")
    @classmethod
    def _text(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


def section_from_overrides(overrides: list[str], base: Optional[dict] = None) -> WatchSection:
    """Build a :class:`WatchSection` from ``key=value`` strings (``watch.key=value`` is accepted too).

    Raises:
        WatchError: an override without ``=``, an unknown key or a bad value (the message names the key).
    """
    values: dict[str, Any] = dict(base or {})
    for text in overrides:
        key, raw = split_key_value(text, f"watch setting {text!r}", "key=value, e.g. max_used_percent=90", WatchError)
        values[key.removeprefix("watch.")] = parse_value(raw)
    try:
        return WatchSection(**values)
    except ValidationError as e:
        raise WatchError(describe_validation(e)) from None


def describe_validation(error: ValidationError) -> str:
    """One line per problem: ``watch setting KEY: MESSAGE``."""
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "?"
        msg = "unknown key" if item["type"] == "extra_forbidden" else item["msg"]
        lines.append(f"watch setting {key}: {msg}")
    return "; ".join(lines)
