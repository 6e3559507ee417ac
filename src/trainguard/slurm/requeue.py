"""Requeue the launcher's own SLURM job after a requeue-worthy stop (``[slurm] auto_requeue``).

``sbatch --requeue`` alone does not bring a job back after its ranks stopped at a time limit or on
a preemption signal and exited: the job simply ends. With ``auto_requeue`` the launcher on the
job's first node runs ``scontrol requeue <job>`` itself when the launch ended with 75 for a reason
that a later run can continue from:

* requeued: a stop signal (preemption, ``--signal``, ``scancel --signal``), the time limit
  (``[stop] max_duration`` or the job's EndTime), the memory watchdog, a straggler or silent data
  corruption exclusion, or a 75 whose reason was not recorded;
* not requeued: the kill switch (the run was stopped on purpose; a requeued job would only burn
  through), any other exit code, a job already requeued by someone else (its ``Restarts`` grew or
  it is pending again), a job this launcher already requeued at this restart count, and a job that
  is ending before its time limit: ``scancel`` (or preemption with ``PreemptMode=CANCEL``; use
  ``PreemptMode=REQUEUE``, SLURM then requeues the job itself). SLURM shows such a job and one
  killed at its time limit alike (``JobState=COMPLETING``, EndTime = now); they differ in run time:
  ``EndTime - StartTime`` below ``TimeLimit`` means it was cancelled.

After a successful requeue, the hosts listed in ``RUN_DIR/exclude_nodes`` (a straggler or a
persistent silent data corruption) become the pending job's excluded nodes
(``scontrol update JobId=<job> ExcNodeList=...``, :func:`exclude_on_requeue`), so the next
allocation leaves them out; a host is the SLURM node name the ranks ran on (``SLURMD_NODENAME``).

Each attempt is one ``slurm_requeue`` event: command, return code, output, seconds, the reason,
and the excluded nodes.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

from ..events import EventLog, read_events
from .info import SlurmError, SLURMInfo, parse_slurm_time, parse_slurm_timestamp, show_job

# stop reasons (the ranks' ``exit``/``stop_requested`` events) after which the job should run again
REQUEUE_WORTHY = ("signal", "time_limit", "memory", "straggler", "sdc")
NOT_RUNNING = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD")
REQUEUE_TIMEOUT = 60.0  # seconds for 'scontrol requeue'
LIMIT_TOLERANCE = 5.0  # seconds: a job that ends this close to its time limit ended at the limit


def stop_reasons(run_dir: Path, since: float) -> set[str]:
    """Reasons in the ranks' ``exit`` and ``stop_requested`` events written at or after ``since`` (Unix s)."""
    return {
        str(e["details"].get("reason"))
        for e in read_events(run_dir)
        if e.get("time", 0) >= since
        and e.get("kind") in ("exit", "stop_requested")
        and isinstance(e.get("details"), dict)
        and e["details"].get("reason")
    }


def requeue_decision(
    code: int, reasons: set[str], launcher_signal: Optional[str], kill_switch: Optional[Path] = None
) -> tuple[bool, str]:
    """Whether a launch that ended with ``code`` should be requeued, and why (or why not).

    Args:
        code: the launch's exit code.
        reasons: :func:`stop_reasons` of this launch.
        launcher_signal: the stop signal the launcher itself received (``"SIGTERM"``), if any.
        kill_switch: the kill-switch file; its presence alone vetoes the requeue.
    """
    if code != 75:
        return False, f"exit code {code} is not 75 (requeue)"
    if "kill_switch" in reasons or (kill_switch is not None and kill_switch.exists()):
        return False, "stopped by the kill switch"
    found = set(reasons) | ({"signal"} if launcher_signal else set())
    worthy = sorted(r for r in found if r in REQUEUE_WORTHY)
    if worthy:
        return True, ", ".join(worthy) + (f" ({launcher_signal} to the launcher)" if launcher_signal else "")
    return True, "exit code 75 (" + (", ".join(sorted(found)) or "no stop reason recorded") + ")"


def already_requeued(run_dir: Path, info: SLURMInfo) -> bool:
    """True when a ``slurm_requeue`` event of this job and restart count already succeeded."""
    return any(
        e["details"].get("requeue_id") == info.requeue_id
        and e["details"].get("restart_count") == info.restart_count
        and e["details"].get("ok")
        for e in read_events(run_dir, "slurm_requeue")
    )


def requeue(info: SLURMInfo, scontrol: str = "scontrol") -> dict:
    """Run ``scontrol requeue <info.requeue_id>`` unless the job was requeued meanwhile.

    SIGTERM and SIGUSR1 are ignored from here on: SLURM signals the job's processes (this one
    included) as soon as it requeues the job, and the launcher is done anyway.

    Returns:
        The ``slurm_requeue`` event details: ``ok``, ``command``, ``returncode``, ``output``,
        ``seconds``; ``skipped`` (a reason) when the job's state says it is already requeued.
    """
    details: dict = {"requeue_id": info.requeue_id, "restart_count": info.restart_count, "ok": False}
    try:
        job = show_job(info.job_id, scontrol)
        details["job_state"] = job.get("JobState")
        restarts = int(job.get("Restarts", "0") or 0)
        if restarts > info.restart_count:
            details["skipped"] = f"the job was already requeued (Restarts={restarts} > {info.restart_count})"
            return details
        if job.get("JobState") in NOT_RUNNING:
            details["skipped"] = f"the job is {job.get('JobState')}"
            return details
        early = ended_early(job)
        if early is not None:
            details["skipped"] = early
            return details
    except (SlurmError, ValueError) as e:
        details["state_error"] = str(e)  # try the requeue anyway: it fails clearly if it must
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    cmd = [scontrol, "requeue", info.requeue_id]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=REQUEUE_TIMEOUT)
        details.update(
            returncode=proc.returncode,
            ok=proc.returncode == 0,
            output=" ".join((proc.stdout + proc.stderr).split())[:2000],
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        details.update(returncode=None, output=str(e))
    details.update(command=" ".join(cmd), seconds=round(time.monotonic() - t0, 3))
    return details


def exclude_on_requeue(run_dir: Path, info: SLURMInfo, scontrol: str = "scontrol") -> Optional[dict]:
    """Make the requeued (pending) job leave out the hosts in ``RUN_DIR/exclude_nodes``:
    ``scontrol update JobId=<requeue id> ExcNodeList=h1,h2`` (SLURM keeps the list for later
    requeues too).

    Returns:
        ``exclude_nodes`` (the hosts), ``exclude_ok``, ``exclude_output`` for the ``slurm_requeue``
        event; ``None`` when the file lists no host.
    """
    path = run_dir / "exclude_nodes"
    hosts = sorted(set(path.read_text().split())) if path.exists() else []
    if not hosts:
        return None
    cmd = [scontrol, "update", f"JobId={info.requeue_id}", f"ExcNodeList={','.join(hosts)}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=REQUEUE_TIMEOUT)
        ok, out = proc.returncode == 0, " ".join((proc.stdout + proc.stderr).split())[:2000]
    except (OSError, subprocess.TimeoutExpired) as e:
        ok, out = False, str(e)
    return {"exclude_nodes": hosts, "exclude_ok": ok, "exclude_output": out}


def ended_early(job: dict[str, str]) -> Optional[str]:
    """Why a job that is no longer RUNNING ended before its time limit (cancelled, or preempted
    without requeue), or ``None`` when it is running or ended at its limit (or this is unknown).

    Args:
        job: :func:`~trainguard.slurm.info.show_job` of the job.
    """
    if job.get("JobState") == "RUNNING":
        return None
    start, end = parse_slurm_timestamp(job.get("StartTime")), parse_slurm_timestamp(job.get("EndTime"))
    try:
        limit = parse_slurm_time(job.get("TimeLimit", "UNLIMITED"))
    except ValueError:
        limit = None
    if start is None or end is None:
        return None
    if limit is None or end - start < limit - LIMIT_TOLERANCE:
        return (
            f"the job is {job.get('JobState')} after {end - start:.0f} s of its "
            f"{'unlimited' if limit is None else f'{limit:.0f} s'} time limit: cancelled (scancel) or preempted, not requeued"
        )
    return None


def after_launch(
    run_dir: Path,
    info: SLURMInfo,
    events: EventLog,
    code: int,
    since: float,
    launcher_signal: Optional[str],
    kill_switch: Path,
    scontrol: str = "scontrol",
) -> Optional[dict]:
    """The ``auto_requeue`` step at the end of a launch on the job's first node.

    Decides (:func:`requeue_decision`), skips a job already requeued at this restart count, runs
    :func:`requeue`, and writes one ``slurm_requeue`` event (also for a skip or a failure).

    Returns:
        The event's details, or ``None`` when the launch is not requeue-worthy (nothing written
        then, except a ``slurm_requeue_declined`` event for a 75 that is not requeued).
    """
    wanted, why = requeue_decision(code, stop_reasons(run_dir, since), launcher_signal, kill_switch)
    if not wanted:
        if code == 75:
            events.emit(
                "slurm_requeue_declined", reason=why, requeue_id=info.requeue_id, restart_count=info.restart_count
            )
        return None
    if already_requeued(run_dir, info):
        details = {
            "requeue_id": info.requeue_id,
            "restart_count": info.restart_count,
            "ok": False,
            "skipped": "already requeued by a launcher at this restart count",
            "reason": why,
        }
    else:
        details = {**requeue(info, scontrol), "reason": why}
        if details.get("ok"):
            details.update(exclude_on_requeue(run_dir, info, scontrol) or {})
    events.emit("slurm_requeue", **details)
    return details
