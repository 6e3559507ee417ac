"""The sbatch script of ``trainguard slurm script|submit``.

What the script does:

* ``#SBATCH`` lines: ``--signal=B:USR1@N`` (N from the run's measured step and save times, see
  :func:`signal_lead`), ``--requeue``, ``--open-mode=append`` (a requeued job appends to its
  output), ``--time``, ``--partition``, ``--nodes`` (``MIN-MAX`` with ``--min-nodes``: the job
  starts on what SLURM gives, and the run resumes on that many, see :mod:`trainguard.state.reshard`)
  with one task per node, ``--gres``,
  ``--cpus-per-task``, optionally ``--array=1-K%1`` (K tasks, one at a time) or
  ``--dependency=afterany:JOB``, and extra lines from ``[slurm] sbatch_args``;
* ``srun`` starts one ``trainguard run`` per node (``--nproc-per-node`` ranks each; with several
  nodes the c10d rendezvous is on the first host of ``SLURM_JOB_NODELIST``);
* the batch shell traps USR1 and TERM and forwards them as SIGUSR1 to ``srun``, which passes them
  to every node's ``trainguard run``; the launcher forwards them to its ranks, which save and exit
  75. Two details matter (both measured on SLURM 22.05): ``srun`` given SIGTERM kills the job step
  at once ("forcing job termination"), so TERM is forwarded as USR1; and a signal that reaches
  ``srun`` or a launcher before its handlers are installed kills it, so the shell forwards only
  once every node's launcher has written its ready file (``TRAINGUARD_READY_DIR``);
* it waits for ``srun`` and exits with ``srun``'s exit code (0, 2, 75, 76 survive in accounting).
"""

from __future__ import annotations

import math
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..config import ConfigError
from ..events import read_events
from ..launch_env import READY_DIR
from .info import parse_show_job, parse_slurm_time

DEFAULT_LEAD = 120  # seconds of signal lead when the run has no measured step or save time yet
EXIT_SECONDS = 15.0  # launcher teardown, process exit and 'scontrol requeue' after the ranks saved
LEAD_FACTOR = 2.0  # safety factor on the measured need
MIN_LEAD = 30  # seconds
MAX_LEAD = 65535  # SLURM's limit for --signal=...@N
READY_TIMEOUT = 300  # s after srun started: forward a pending signal even without every ready file
SLURM_TIMEOUT = 30.0  # seconds for sinfo/scontrol/sbatch


def measured_times(run_dir: Path) -> tuple[Optional[float], Optional[float]]:
    """(slowest step, slowest save) in seconds seen in the run's events: ``progress`` events'
    ``step_seconds`` and ``checkpoint_committed`` events' ``seconds``; ``None`` where none."""
    steps, saves = [], []
    for e in read_events(run_dir):
        d = e.get("details") or {}
        if e.get("kind") == "progress" and isinstance(d.get("step_seconds"), (int, float)):
            steps.append(float(d["step_seconds"]))
        elif (
            e.get("kind") == "checkpoint_committed"
            and d.get("kind") != "jit"
            and isinstance(d.get("seconds"), (int, float))
        ):
            saves.append(float(d["seconds"]))
    return max(steps, default=None), max(saves, default=None)


def signal_lead(run_dir: Path, check_seconds: float = 1.0) -> tuple[int, str]:
    """Seconds before the time limit that the batch shell should get SIGUSR1, and how it was found.

    The ranks need, after the signal: up to one stop check (``check_seconds``) plus the step in
    progress and one more, one save, then the launcher's exit and requeue (:data:`EXIT_SECONDS`).
    The lead is :data:`LEAD_FACTOR` times that, at least :data:`MIN_LEAD`; :data:`DEFAULT_LEAD`
    when the run directory holds no measured step or save time yet.
    """
    step, save = measured_times(run_dir) if Path(run_dir).is_dir() else (None, None)
    if step is None and save is None:
        return DEFAULT_LEAD, f"default {DEFAULT_LEAD} s (no measured step or save time in {run_dir})"
    need = check_seconds + 2 * (step or 0.0) + (save or 0.0) + EXIT_SECONDS
    lead = min(MAX_LEAD, max(MIN_LEAD, math.ceil(LEAD_FACTOR * need)))
    return lead, (
        f"{LEAD_FACTOR:g} × (check {check_seconds:g} s + 2 × step {step or 0:.3f} s + save {save or 0:.3f} s"
        f" + exit {EXIT_SECONDS:g} s), at least {MIN_LEAD} s"
    )


@dataclass
class ScriptOptions:
    """Everything the batch script is made of (times in seconds; ``None`` = not set).

    ``time`` is the sbatch ``--time`` text; ``signal_lead`` 0 writes no ``--signal`` (the ranks
    then stop before the job's EndTime alone, or on SLURM's SIGTERM); ``array`` is K for ``--array=1-K%1``; ``after`` a job
    id for ``--dependency=afterany:ID``; ``launcher_sets`` are ``--set`` overrides for
    ``trainguard run`` (and its ranks).
    """

    script: str
    run_dir: Path
    script_args: list[str] = field(default_factory=list)
    config: Optional[str] = None
    launcher_sets: list[str] = field(default_factory=list)
    nodes: int = 1
    min_nodes: Optional[int] = None  # with it, ``--nodes=MIN-MAX``: the job may start on fewer nodes
    spare_nodes: int = 0  # allocated beyond ``nodes``: their launchers wait as spare nodes (``--nnodes N:N+S``)
    nproc_per_node: int = 1
    time: Optional[str] = None
    partition: Optional[str] = None
    signal_lead: int = DEFAULT_LEAD
    lead_basis: str = ""
    job_name: Optional[str] = None
    array: Optional[int] = None
    after: Optional[str] = None
    gres: Optional[str] = None
    cpus_per_task: Optional[int] = None
    rdzv_port: int = 29500
    sbatch_args: list[str] = field(default_factory=list)
    python: str = sys.executable
    workdir: Path = field(default_factory=Path.cwd)


def partitions(sinfo: str = "sinfo") -> tuple[list[str], Optional[str]]:
    """(partition names, the default partition) from ``sinfo -h -o %P`` (the default ends in ``*``).

    Raises:
        ConfigError: ``sinfo`` is missing or fails (the cluster cannot be asked).
    """
    try:
        proc = subprocess.run([sinfo, "-h", "-o", "%P"], capture_output=True, text=True, timeout=SLURM_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"cannot list the SLURM partitions ({sinfo} -h -o %P): {e}") from None
    if proc.returncode != 0:
        raise ConfigError(
            f"cannot list the SLURM partitions: sinfo exited with {proc.returncode}: {' '.join(proc.stderr.split())}"
        )
    names = [p.strip() for p in proc.stdout.split()]
    default = next((p.rstrip("*") for p in names if p.endswith("*")), None)
    return [p.rstrip("*") for p in names], default


def partition_limit(name: str, scontrol: str = "scontrol") -> Optional[float]:
    """The time limit (seconds) a job without ``--time`` gets in partition ``name``: its
    ``DefaultTime``, else its ``MaxTime``; ``None`` when unlimited or unknown."""
    try:
        proc = subprocess.run(
            [scontrol, "show", "partition", "-o", name], capture_output=True, text=True, timeout=SLURM_TIMEOUT
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    fields = parse_show_job(proc.stdout)  # the same Key=Value line format as scontrol show job -o
    for key in ("DefaultTime", "MaxTime"):
        try:
            value = parse_slurm_time(fields.get(key, "UNLIMITED"))
        except ValueError:  # NONE, N/A
            continue
        if value is not None:
            return value
    return None


CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # C0 control characters and DEL: a newline would start a line of its own


def _values(opts: ScriptOptions) -> list[tuple[str, object]]:
    """Every value the batch script is written from, with the option (or setting) that gave it."""
    named: list[tuple[str, object]] = [
        ("--job-name (or [slurm] job_name)", opts.job_name),
        ("--gres (or [slurm] gres)", opts.gres),
        ("--partition (or [slurm] partition)", opts.partition),
        ("--time (or [slurm] time)", opts.time),
        ("--after", opts.after),
        ("--run-dir", opts.run_dir),
        ("--config", opts.config),
        ("the training script", opts.script),
        ("the working directory", opts.workdir),
        ("the Python interpreter", opts.python),
    ]
    named += [("[slurm] sbatch_args", a) for a in opts.sbatch_args]
    named += [("--set", a) for a in opts.launcher_sets]
    named += [("a script argument", a) for a in opts.script_args]
    return named


def refuse_control_characters(opts: ScriptOptions) -> None:
    """Refuse a value holding a control character (newline, CR, NUL, another C0 one, DEL): in an
    ``#SBATCH`` line or the ``srun`` line a newline starts a command of its own.

    Raises:
        ConfigError: names the option and the character.
    """
    for name, value in _values(opts):
        found = CONTROL.search(str(value)) if value is not None else None
        if found:
            raise ConfigError(
                f"{name} {str(value)!r}: holds the control character {found.group()!r}; the batch script takes "
                "no control characters (a newline would start a command of its own)"
            )


def validate(opts: ScriptOptions, check_cluster: bool = True) -> list[str]:
    """Check the options; return notes for the user (empty when all is plain).

    Args:
        check_cluster: ask the cluster (``sinfo``/``scontrol``) whether the partition exists and,
            without ``--time``, what its time limit is. Without SLURM commands on PATH, or when
            ``sinfo`` cannot reach the controller, the partition is not checked (a note says so).
    Raises:
        ConfigError: a value with a control character (:func:`refuse_control_characters`), a
            malformed time, a signal lead not below the time limit, an unknown partition, a
            missing script, bad counts or ids.
    """
    notes: list[str] = []
    refuse_control_characters(opts)
    if not Path(opts.script).is_file():
        raise ConfigError(f"training script {opts.script} does not exist")
    for name, value in (("--nodes", opts.nodes), ("--nproc-per-node", opts.nproc_per_node)):
        if value < 1:
            raise ConfigError(f"{name} must be ≥ 1, got {value}")
    if opts.min_nodes is not None and not 1 <= opts.min_nodes <= opts.nodes:
        raise ConfigError(f"--min-nodes must be between 1 and --nodes ({opts.nodes}), got {opts.min_nodes}")
    if opts.spare_nodes < 0:
        raise ConfigError(f"--spare-nodes must be ≥ 0, got {opts.spare_nodes}")
    if opts.spare_nodes and _elastic(opts):
        raise ConfigError(
            "--spare-nodes and --min-nodes do not go together: spare nodes wait beside a group of a fixed "
            "number of nodes (docs/recovery.md), --min-nodes lets the group itself shrink"
        )
    if opts.array is not None and opts.array < 1:
        raise ConfigError(f"--array must be ≥ 1 (the number of tasks), got {opts.array}")
    if opts.array is not None and opts.after:
        raise ConfigError(
            "--array and --after do not go together: a job array already runs its tasks one after another"
        )
    if opts.after and not re.fullmatch(r"\d+(_\d+)?", opts.after):
        raise ConfigError(f"--after {opts.after!r}: expected a SLURM job id such as 1234 or 1234_5")
    if not 0 <= opts.signal_lead <= MAX_LEAD:
        raise ConfigError(f"signal lead {opts.signal_lead} s: SLURM accepts 1 to {MAX_LEAD} seconds (0: no --signal)")
    limit: Optional[float] = None
    if opts.time is not None:
        try:
            limit = parse_slurm_time(opts.time)
        except ValueError as e:
            raise ConfigError(f"--time: {e}") from None
        if limit is not None and limit <= 0:
            raise ConfigError(f"--time {opts.time!r}: the time limit must be positive")
    asked: Optional[tuple[list[str], Optional[str]]] = None
    if check_cluster and shutil.which("sinfo"):
        try:
            asked = partitions()
        except ConfigError as e:  # a login node whose controller is down: the script can still be written
            notes.append(f"{e}: the partition and its limits were not checked")
    if asked is not None:
        names, default = asked
        part = opts.partition or default
        if opts.partition is not None and opts.partition not in names:
            raise ConfigError(
                f"unknown SLURM partition {opts.partition!r} (this cluster has: {', '.join(names) or 'none'})"
            )
        if limit is None and opts.time is None and part:
            limit = partition_limit(part)
            if limit is not None:
                notes.append(f"no --time: partition {part}'s limit of {limit:g} s applies")
    elif check_cluster and not shutil.which("sinfo"):
        notes.append("sinfo not found: the partition and its limits were not checked")
    if limit is not None and opts.signal_lead and opts.signal_lead >= limit:
        raise ConfigError(
            f"signal lead {opts.signal_lead} s is not shorter than the time limit {limit:g} s "
            f"({opts.lead_basis or 'given'}): use a longer --time or a shorter --signal-lead"
        )
    return notes


def _elastic(opts: ScriptOptions) -> bool:
    """Whether the job may run on fewer nodes than ``opts.nodes`` (``--min-nodes``)."""
    return opts.min_nodes is not None and opts.min_nodes < opts.nodes


def _q(value: object) -> str:
    return shlex.quote(str(value))


def render(opts: ScriptOptions) -> str:
    """The batch script's text (validate first with :func:`validate`)."""
    run_dir = Path(opts.run_dir).resolve()
    out = run_dir / ("slurm-%A_%a.out" if opts.array else "slurm-%j.out")
    sb = [f"--job-name={opts.job_name or run_dir.name}"]
    sb += [f"--signal=B:USR1@{opts.signal_lead}"] if opts.signal_lead else []  # 0: rely on EndTime alone
    sb += [
        "--requeue",
        "--open-mode=append",
        f"--output={out}",
        f"--chdir={Path(opts.workdir).resolve()}",
        f"--nodes={opts.min_nodes}-{opts.nodes}" if _elastic(opts) else f"--nodes={opts.nodes + opts.spare_nodes}",
        "--ntasks-per-node=1",
    ]
    sb += [f"--time={opts.time}"] if opts.time else []
    sb += [f"--partition={opts.partition}"] if opts.partition else []
    sb += [f"--gres={opts.gres}"] if opts.gres else []
    sb += [f"--cpus-per-task={opts.cpus_per_task}"] if opts.cpus_per_task else []
    sb += [f"--array=1-{opts.array}%1"] if opts.array else []
    sb += [f"--dependency=afterany:{opts.after}"] if opts.after else []
    sb += list(opts.sbatch_args)

    run = [
        _q(opts.python),
        "-m",
        "trainguard.cli",
        "run",
        "--run-dir",
        _q(run_dir),
        "--nnodes",
        '"$SLURM_JOB_NUM_NODES"'
        if _elastic(opts)
        else (f"{opts.nodes}:{opts.nodes + opts.spare_nodes}" if opts.spare_nodes else str(opts.nodes)),
        "--nproc-per-node",
        str(opts.nproc_per_node),
    ]
    if opts.nodes + opts.spare_nodes > 1:
        run += [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f'"$head_node:{opts.rdzv_port}"',
            "--rdzv-id",
            '"$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"',
        ]
    run += ["--config", _q(Path(opts.config).resolve())] if opts.config else []
    for item in opts.launcher_sets:
        run += ["--set", _q(item)]
    run += [_q(Path(opts.script).resolve())] + [_q(a) for a in opts.script_args]
    n = '"$SLURM_JOB_NUM_NODES"' if _elastic(opts) else str(opts.nodes + opts.spare_nodes)  # what SLURM allocated
    srun = ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", "--kill-on-bad-exit=0"]
    srun += [f"--cpus-per-task={opts.cpus_per_task}"] if opts.cpus_per_task else []  # srun ≥ 22.05 does not inherit it

    lines = [
        "#!/bin/bash",
        "# Written by 'trainguard slurm script'. Signal lead: "
        + (opts.lead_basis or f"{opts.signal_lead} s, given")
        + ".",
    ]
    lines += [f"#SBATCH {_q(s)}" for s in sb]  # sbatch splits an #SBATCH line as a shell would: one word each
    lines += [
        "",
        BODY.replace("@RUN_DIR@", _q(run_dir))
        .replace("@READY_TIMEOUT@", str(READY_TIMEOUT))
        .replace("@READY_DIR@", READY_DIR)
        .replace("@SRUN@", " ".join(srun) + " \\\n  " + " ".join(run) + " &"),
    ]
    return "\n".join(lines)


BODY = r"""set -u
run_dir=@RUN_DIR@
restart=${SLURM_RESTART_COUNT:-0}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
ready_dir="$run_dir/.slurm-ready/$SLURM_JOB_ID.$restart"
rm -rf "$run_dir/.slurm-ready/$SLURM_JOB_ID".*
mkdir -p "$ready_dir"
export @READY_DIR@="$ready_dir"
log() { echo "trainguard-sbatch: $(date '+%F %T') $*"; }
log "job ${SLURM_JOB_ID} (array ${SLURM_ARRAY_JOB_ID:-none}_${SLURM_ARRAY_TASK_ID:-none}) restart $restart on ${SLURM_JOB_NODELIST}, first host $head_node"

# USR1 (from --signal or scancel) and TERM: remember, forward as USR1 to srun once the launchers
# handle it (srun turns a TERM into an immediate kill of the job step)
pending=""
trap 'pending=USR1; log "SIGUSR1 received"' USR1
trap 'pending=TERM; log "SIGTERM received"' TERM

@SRUN@
srun_pid=$!
started=$SECONDS
while kill -0 "$srun_pid" 2>/dev/null; do
  if [ -n "$pending" ]; then
    ready=$(find "$ready_dir" -maxdepth 1 -name 'node*' 2>/dev/null | wc -l)
    if [ "$ready" -ge "${SLURM_JOB_NUM_NODES:-1}" ] || [ $((SECONDS - started)) -ge @READY_TIMEOUT@ ]; then
      log "forwarding SIG$pending as SIGUSR1 to srun (pid $srun_pid; $ready launcher(s) ready)"
      kill -USR1 "$srun_pid" 2>/dev/null || true
      pending=""
    fi
  fi
  sleep 0.5 &
  wait $! 2>/dev/null   # returns at once when a trapped signal arrives
done
wait "$srun_pid"
rc=$?
rm -rf "$ready_dir"
log "srun exited with $rc"
exit "$rc"
"""


def submit(script_path: Path, extra: tuple[str, ...] = (), test_only: bool = False) -> str:
    """``sbatch [--test-only] EXTRA SCRIPT``; returns the job id (or, with ``test_only``, sbatch's message).

    Raises:
        ConfigError: ``sbatch`` is missing or refuses the script (its message is included).
    """
    cmd = ["sbatch", *(["--test-only"] if test_only else ["--parsable"]), *extra, str(script_path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SLURM_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"{' '.join(cmd)}: {e}") from None
    message = " ".join((proc.stderr + proc.stdout).split())
    if proc.returncode != 0:
        raise ConfigError(f"sbatch refused {script_path}: {message or f'exit code {proc.returncode}'}")
    return message if test_only else proc.stdout.strip().split(";")[0]
