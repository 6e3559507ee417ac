"""Is the training's SLURM job running or queued? (BLOOM's ``slurm-status.py`` watchdog.)

Runs ``squeue --noheader --format=%i|%T|%j`` filtered by ``--name`` and/or ``--jobs``; the condition
alerts unless some matching job is RUNNING or PENDING (a chain of queued jobs under one name is
fine as long as one of them is). Without ``squeue`` on PATH the check is skipped.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Optional

from .conditions import ALERT, OK, SKIPPED, Condition
from .config import WatchSection

ALIVE = ("RUNNING", "PENDING")
TIMEOUT = 60.0


def parse_squeue(text: str) -> list[tuple[str, str, str]]:
    """``(job id, state, name)`` per line of ``%i|%T|%j`` output; lines that do not fit are ignored."""
    jobs = []
    for line in text.splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) == 3 and parts[0].strip() and parts[1].strip():
            jobs.append((parts[0].strip(), parts[1].strip().upper(), parts[2].strip()))
    return jobs


def job_condition(section: WatchSection, squeue: Optional[str] = None) -> Condition:
    """The ``job`` condition; ``squeue`` is the command's path (default: looked up on PATH)."""
    if not section.job_name and not section.job_id:
        return Condition("job", SKIPPED, "no job_name or job_id given")
    wanted = " ".join(
        x
        for x in (
            f"name {section.job_name!r}" if section.job_name else "",
            f"id {section.job_id}" if section.job_id else "",
        )
        if x
    )
    values = {"job_name": section.job_name, "job_id": section.job_id}
    squeue = squeue or shutil.which("squeue")
    if not squeue:
        return Condition("job", SKIPPED, "squeue not found", values)
    cmd = [squeue, "--noheader", "--format=%i|%T|%j"]
    if section.job_name:
        cmd.append(f"--name={section.job_name}")
    if section.job_id:
        cmd.append(f"--jobs={section.job_id}")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Condition("job", ALERT, f"job {wanted}: squeue failed: {e}", values)
    jobs = parse_squeue(proc.stdout)
    err = " ".join(proc.stderr.split())
    if proc.returncode != 0 and not (section.job_id and "invalid job id" in err.lower()):
        return Condition(
            "job", ALERT, f"job {wanted}: squeue exited with {proc.returncode}: {err or 'no message'}", values
        )
    values["jobs"] = [{"id": i, "state": s, "name": n} for i, s, n in jobs]
    listing = ", ".join(f"{i} {s}" for i, s, _ in jobs)
    if any(state in ALIVE for _, state, _ in jobs):
        return Condition("job", OK, f"job {wanted}: {listing}", values)
    if not jobs:
        return Condition("job", ALERT, f"job {wanted}: not in the queue (neither running nor pending)", values)
    return Condition("job", ALERT, f"job {wanted}: neither running nor pending ({listing})", values)
