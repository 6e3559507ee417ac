"""Filesystem checks: free space and used percent, inodes, and days of headroom.

The checked paths are the checkpoint directory, the run directory and the section's extra
``paths``. Paths on one filesystem (same ``st_dev``) are checked once, named after the first
(``disk[checkpoints]``, ``inodes[checkpoints]``; ``disk[run_dir]`` only when the run dir lies on
another filesystem; ``disk[PATH]`` for an extra path). A checkpoint directory that does not exist
yet is checked on the filesystem of its nearest existing parent; a missing extra path is an alert
(a mount that went away).

Used percent is ``used / (used + available)``, as ``df`` reports it (space reserved for root
counts as neither). Inode use comes from ``os.statvfs`` (``f_files``, ``f_ffree``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import tomllib

from .conditions import ALERT, OK, SKIPPED, Condition, fmt_bytes, fmt_seconds
from .config import WatchSection


@dataclass
class Target:
    """A path to check: ``role`` names its conditions (``checkpoints``, ``run_dir`` or the path)."""

    role: str
    path: Path
    must_exist: bool


def checkpoint_dir(run_dir: Path) -> Path:
    """The run's checkpoint directory: ``[checkpoint] dir`` of ``RUN_DIR/config.toml`` when the run
    wrote one (relative to the run dir unless absolute), else ``RUN_DIR/checkpoints``."""
    name = "checkpoints"
    try:
        with open(Path(run_dir) / "config.toml", "rb") as f:
            configured = tomllib.load(f).get("checkpoint", {}).get("dir")
        if isinstance(configured, str) and configured:
            name = configured
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        pass
    return Path(os.path.abspath(Path(run_dir) / name))


def targets(run_dir: Path, section: WatchSection) -> list[Target]:
    """Checkpoint dir first (it owns the headroom check), then the run dir, then the extra paths."""
    run_dir = Path(os.path.abspath(run_dir))
    found = [Target("checkpoints", checkpoint_dir(run_dir), False), Target("run_dir", run_dir, True)]
    found += [Target(p, Path(os.path.abspath(run_dir / p)), True) for p in section.paths]
    return found


def dir_bytes(path: Path) -> int:
    """Apparent size of every file below ``path`` (hard links once, links not followed; 0 if missing).

    Files that vanish during the walk (checkpoint retention deleting) are skipped.
    """
    total = 0
    seen: set[tuple[int, int]] = set()
    stack = [str(path)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    if st.st_nlink > 1:
                        if (st.st_dev, st.st_ino) in seen:
                            continue
                        seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
            except OSError:
                continue
    return total


def _probe(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _where(paths: list[str]) -> str:
    return paths[0] + (" (also " + ", ".join(paths[1:]) + ")" if len(paths) > 1 else "")


def _disk(name: str, paths: list[str], probe: Path, section: WatchSection) -> tuple[Condition, int]:
    where = _where(paths)
    usage = shutil.disk_usage(probe)
    used_pct = 100.0 * usage.used / (usage.used + usage.free) if usage.used + usage.free else 0.0
    values = {
        "paths": paths,
        "total": usage.total,
        "used": usage.used,
        "free": usage.free,
        "used_percent": round(used_pct, 4),
        "min_free_bytes": section.min_free_bytes,
        "max_used_percent": section.max_used_percent,
    }
    text = f"{where}: {used_pct:.1f} % used, {fmt_bytes(usage.free)} free of {fmt_bytes(usage.total)}"
    crossed = []
    if section.min_free_bytes is not None and usage.free < section.min_free_bytes:
        crossed.append(f"free {fmt_bytes(usage.free)} < min_free_bytes {fmt_bytes(section.min_free_bytes)}")
    if section.max_used_percent is not None and used_pct > section.max_used_percent:
        crossed.append(f"used {used_pct:.4g} % > max_used_percent {section.max_used_percent:g} %")
    status = ALERT if crossed else OK
    return Condition(name, status, "; ".join([text, *crossed]), values), usage.free


def _inodes(name: str, paths: list[str], probe: Path, section: WatchSection) -> Condition:
    where = _where(paths)
    st = os.statvfs(probe)
    if st.f_files == 0:
        return Condition(name, SKIPPED, f"{where}: the filesystem reports no inode counts", {"paths": paths})
    used = st.f_files - st.f_ffree
    pct = 100.0 * used / st.f_files
    values = {
        "paths": paths,
        "inodes": st.f_files,
        "inodes_used": used,
        "inodes_free": st.f_ffree,
        "inodes_used_percent": round(pct, 6),
        "max_inodes_percent": section.max_inodes_percent,
    }
    text = f"{where}: {pct:.2f} % of inodes used ({used:,} of {st.f_files:,})"
    if section.max_inodes_percent is not None and pct > section.max_inodes_percent:
        return Condition(name, ALERT, f"{text}; > max_inodes_percent {section.max_inodes_percent:g} %", values)
    return Condition(name, OK, text, values)


def headroom(
    name: str, free: int, size: int, rate: Optional[float], span: float, samples: int, section: WatchSection
) -> Condition:
    """Days until the checkpoint filesystem is full at the measured growth ``rate`` (bytes/day)."""
    values = {
        "free": free,
        "checkpoint_bytes": size,
        "growth_bytes_per_day": rate,
        "window_seconds": round(span, 3),
        "samples": samples,
        "min_days": section.min_days,
    }
    if rate is None:
        return Condition(name, SKIPPED, "growth not measured yet (needs two passes at least 1 s apart)", values)
    measured = f"measured over {fmt_seconds(span)}, {samples} samples"
    if rate <= 0:
        return Condition(
            name, OK, f"no growth of the checkpoint dir ({fmt_bytes(size)}, {measured}); headroom unbounded", values
        )
    days = free / rate
    values["days"] = round(days, 4)
    text = (
        f"{days:,.1f} days of headroom: {fmt_bytes(free)} free, checkpoints growing {fmt_bytes(rate)}/day ({measured})"
    )
    if section.min_days is not None and days < section.min_days:
        return Condition(name, ALERT, f"{text}; < min_days {section.min_days:g}", values)
    return Condition(name, OK, text, values)


def filesystem_conditions(found: list[Target], section: WatchSection) -> tuple[list[Condition], Optional[int]]:
    """``disk[...]`` and ``inodes[...]`` per filesystem; also the checkpoint filesystem's free bytes."""
    conditions: list[Condition] = []
    groups: dict[int, list[tuple[Target, Path]]] = {}
    for target in found:
        if target.must_exist and not target.path.exists():
            conditions.append(
                Condition(f"disk[{target.role}]", ALERT, f"{target.path} does not exist", {"paths": [str(target.path)]})
            )
            continue
        probe = _probe(target.path)
        groups.setdefault(os.stat(probe).st_dev, []).append((target, probe))
    checkpoint_free = None
    for members in groups.values():
        first, probe = members[0]
        paths = [str(t.path) for t, _ in members]
        disk, free = _disk(f"disk[{first.role}]", paths, probe, section)
        conditions += [disk, _inodes(f"inodes[{first.role}]", paths, probe, section)]
        if first.role == "checkpoints":
            checkpoint_free = free
    return conditions, checkpoint_free
