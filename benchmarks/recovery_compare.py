"""Time to recover from a killed rank and from a hung rank: trainguard vs torchrun vs NVIDIA's ft_launcher.

The same small job runs under each launcher (``benchmarks/_recovery_worker.py``: a 2-rank gloo DDP
MLP, steps padded to ``--step-ms`` = 30 ms, a checkpoint every ``--ckpt-every`` = 10 steps, 70 steps;
the fault at step ``--fault-step`` = 45 on rank 1, in the first attempt only):

* **trainguard in-process** (``inprocess``, ``inprocess-plain``, ``inprocess-cold``): ``trainguard
  run`` with ``[recovery] in_process`` (the default) and one warm spare (or none); two loop shapes:
  through ``guard.run_step`` and ``guard.should_step`` (``--guard-api``), and the plain loop
  (``loss.backward()``, ``optimizer.step()``, ``guard.step_end()``: ``inprocess-plain``, where the
  survivor notices the loss inside DDP's all-reduce in its own ``backward()``): rank 0 stays, a
  replacement takes rank 1's place; the time to recover ends at rank 0's ``recovery_finished``
  event (it trains again);
* **trainguard restart** (``trainguard``): ``trainguard run --nproc-per-node 2 --inject
  rank_killed|rank_hung:rank=1,step=45``, the loop under ``trainguard.Guard``, the group restarted
  from the newest checkpoint. For all trainguard rows the hang timeout is the *learned* one:
  ``timeouts.json`` of a warm-up run (same job, no fault) is copied into every trial's run directory;
* **torchrun**: ``python -m torch.distributed.run --standalone --max-restarts 3``, the plain loop
  with ``torch.save`` checkpoints by rank 0, ``init_process_group(timeout=--pg-timeout)`` (30 s):
  a stopped rank is noticed only when the peer's collective times out;
* **torchrun+fix** (kill only, ``--fix-faults``): the same with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
  the workaround ``trainguard run`` applies for pytorch issue 135712 (a restarted gloo group can
  fail in ``init_process_group`` with stale peer addresses, then waits for the connect timeout,
  about a minute, and restarts again);
* **ft_launcher** (``nvidia-resiliency-ext``, from the venv ``--nvrx``, default ``/tmp/nvrx``):
  the plain loop plus ``RankMonitorClient.send_heartbeat()`` every step, heartbeat timeout
  ``--ft-hb-timeout`` = 10 s checked every ``--ft-check-interval`` = 1 s (hand-set: its defaults are
  45 min and 5 s).

Faults: **kill** (the rank SIGKILLs itself) and **hang** (the rank SIGSTOPs itself: alive, silent).
The time to recover is ``fault_injected`` → the ``start`` event of rank 0 in a later attempt (the
resumed loop is about to run its first step; "→ step done" adds that first step), or rank 0's
``recovery_finished`` (in-process). Steps lost: the fault step − the step training goes on from. The phases of the
recovery come from the events (``worker_timing``: process start, torch imported, process group
ready, Guard/setup ready) and from polling the old rank processes in ``/proc``. Each trial is capped
at ``--cap`` seconds. The trials of all configurations are interleaved, so that load changes on the
machine spread over all of them.

To install ft_launcher (CPU torch from the trainguard venv is reused through a ``.pth`` file, so
nothing big is downloaded)::

    python3 -m venv /tmp/nvrx
    .venv/bin/python -c "import site; print(site.getsitepackages()[0])" > /tmp/nvrx/lib/python3.11/site-packages/zz_main.pth
    /tmp/nvrx/bin/pip install torch==2.13.0 nvidia-resiliency-ext==0.4.1

    .venv/bin/python benchmarks/recovery_compare.py [--quick | --smoke] [--trials 6] [--launchers inprocess,inprocess-cold,trainguard,torchrun,torchrun-fix,ft]

``--smoke`` runs the smallest job (30 steps of 10 ms, fault at step 15) once per configuration that
recovers without a fixed wait: trainguard kill and hang, torchrun+fix kill, ft_launcher kill (when
installed); plain torchrun (it can need a second restart after a one-minute connect timeout) and
the torchrun/ft hangs (a process-group or heartbeat timeout, then torch elastic's fixed 30 s wait
for the stopped rank before it is killed) are left out. It exits 1 when a trial did not recover.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from _common import SMOKE_HELP  # noqa: E402
from _common import exited as _exited
from _common import run_events as _events
from _common import trainguard_cmd as _trainguard

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "benchmarks" / "_recovery_worker.py"
LAUNCHERS = ("inprocess", "inprocess-plain", "inprocess-cold", "trainguard", "torchrun", "torchrun-fix", "ft")
NAMES = {
    "inprocess": "trainguard\nin-process\nrun_step",
    "inprocess-plain": "trainguard\nin-process\nplain loop",
    "inprocess-cold": "trainguard\nin-process\nno spare",
    "trainguard": "trainguard\nrestart",
    "torchrun": "torchrun",
    "torchrun-fix": "torchrun+fix",
    "ft": "ft_launcher",
}
# trainguard's in-process recovery ([recovery] in_process): {arm: warm spares}; the loop through
# guard.run_step and guard.should_step (--guard-api) but in the arms of GUARD_API
INPROCESS = {"inprocess": 1, "inprocess-plain": 1, "inprocess-cold": 0}
GUARD_API = ("inprocess", "inprocess-cold")
FAULTS = ("kill", "hang")
# goals of the in-process recovery (the issue): kill → training again ≤ 1 s; hang → ≤ the learned
# step timeout + 1 s (checked against each trial's timeout); the restart path's own goals were 3 s and 5 s
GOALS = {"kill": 1.0, "hang": 1.0}
RESTART_GOALS = {"kill": 3.0, "hang": 5.0}
# reference medians measured earlier on this machine (6 trials), for orientation only
REFERENCE = {("torchrun", "kill"): 3.3, ("ft", "kill"): 3.4, ("ft", "hang"): 13.9, ("torchrun", "hang"): 64.0}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="1 trial each and a 10 s process-group timeout, to check that it works"
    )
    p.add_argument(
        "--smoke", action="store_true", help=SMOKE_HELP + "; exits 1 when a trial did not recover (see above)"
    )
    p.add_argument(
        "--trials", type=int, default=None, help="trials per launcher and fault (default 6, quick 1, smoke 1)"
    )
    p.add_argument(
        "--launchers",
        default=None,
        help="comma-separated subset of " + ",".join(LAUNCHERS) + " (default all; smoke: all but torchrun)",
    )
    p.add_argument(
        "--fix-faults",
        default="kill",
        help="faults run with torchrun-fix (default: kill only; its hang recovery is the "
        "process-group timeout, as plain torchrun's)",
    )
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset of kill,hang")
    p.add_argument(
        "--skip", default=None, help="comma-separated LAUNCHER:FAULT pairs not to run (smoke: torchrun:hang,ft:hang)"
    )
    p.add_argument("--step-ms", type=float, default=None, help="pad every step to this duration (default 30, smoke 10)")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps of the job (default 70, smoke 30: 20 observed steps "
        "before the fault let the warm-up run learn its step timeout)",
    )
    p.add_argument(
        "--fault-step",
        type=int,
        default=None,
        help="default 45, smoke 15; not a multiple of --ckpt-every (all launchers then resume from the same step)",
    )
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument(
        "--pg-timeout",
        type=float,
        default=None,
        help="torchrun/ft: init_process_group timeout in seconds (default 30, quick 10)",
    )
    p.add_argument("--ft-hb-timeout", type=float, default=10.0, help="ft_launcher: rank heartbeat timeout (seconds)")
    p.add_argument(
        "--ft-check-interval", type=float, default=1.0, help="ft_launcher: workload check interval (seconds)"
    )
    p.add_argument("--nvrx", default="/tmp/nvrx", help="virtualenv with nvidia-resiliency-ext (ft_launcher)")
    p.add_argument(
        "--cap",
        type=float,
        default=None,
        help="seconds after which a trial is killed (default 120; smoke 300: "
        "only against a stuck trial, a loaded machine must not fail the smoke run)",
    )
    p.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    p.add_argument(
        "--analyse", metavar="DIR", default=None, help="print the tables of trials kept with --keep in DIR, run nothing"
    )
    args = p.parse_args()
    args.trials = args.trials or (1 if args.quick or args.smoke else 6)
    args.pg_timeout = args.pg_timeout or (5.0 if args.smoke else 10.0 if args.quick else 30.0)
    args.step_ms = args.step_ms or (10.0 if args.smoke else 30.0)
    args.steps = args.steps or (30 if args.smoke else 70)
    args.fault_step = args.fault_step or (15 if args.smoke else 45)
    args.cap = args.cap or (300.0 if args.smoke else 120.0)
    if args.launchers is None:
        args.launchers = ",".join(x for x in LAUNCHERS if not (args.smoke and x == "torchrun"))
    if args.skip is None:
        args.skip = "torchrun:hang,ft:hang" if args.smoke else ""
    args.launchers = [x for x in args.launchers.split(",") if x]
    args.skip = {tuple(x.split(":", 1)) for x in args.skip.split(",") if x}
    args.faults = [x for x in args.faults.split(",") if x]
    args.fix_faults = [x for x in args.fix_faults.split(",") if x]
    for x in args.launchers:
        if x not in LAUNCHERS:
            p.error(f"unknown launcher {x!r}")
    for x in args.faults:
        if x not in FAULTS:
            p.error(f"unknown fault {x!r}")
    return args


class PidWatcher(threading.Thread):
    """Records when each worker process (pids from the run's events) exits, polled every 5 ms."""

    def __init__(self, run_dir: Path):
        super().__init__(daemon=True)
        self.path = run_dir / "events.jsonl"
        self.exits: dict[int, float] = {}
        self.pids: set[int] = set()
        self.stop = threading.Event()
        self._pos = 0

    def _read_pids(self) -> None:
        try:
            with open(self.path) as f:
                f.seek(self._pos)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind("\n") + 1
        self._pos += len(chunk[:end].encode())
        for line in chunk[:end].splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if e.get("kind") == "worker_timing":
                self.pids.add(int(e["pid"]))
            elif e.get("kind") == "workers_started":
                self.pids.update(int(p) for p in e["details"]["pids"].values())

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            if n % 2 == 0:
                self._read_pids()
            now = time.time()
            for pid in list(self.pids - set(self.exits)):
                if _exited(pid):
                    self.exits[pid] = now
            n += 1
            time.sleep(0.005)


def _command(args: argparse.Namespace, launcher: str, fault: str, run_dir: Path) -> tuple[list[str], dict]:
    env = dict(os.environ)
    common = ["--steps", str(args.steps), "--step-ms", str(args.step_ms)]
    if launcher == "trainguard" or launcher in INPROCESS:
        spec = (
            f"rank_killed:rank=1,step={args.fault_step}"
            if fault == "kill"
            else f"rank_hung:rank=1,step={args.fault_step},hang=sigstop"
        )
        cmd = _trainguard() + [
            "run",
            "--nproc-per-node",
            "2",
            "--run-dir",
            str(run_dir),
            "--inject",
            spec,
            str(WORKER),
            "--mode",
            "trainguard",
            *common,
            "--set",
            f"checkpoint.interval={args.ckpt_every}",
        ]
        if launcher in INPROCESS:
            cmd += ["--guard-api"] if launcher in GUARD_API else []
            cmd += ["--set", "recovery.in_process=true", "--set", f"launcher.spares={INPROCESS[launcher]}"]
        else:  # the group restart (in-process recovery is the default)
            cmd += ["--set", "recovery.in_process=false"]
        return cmd, env
    worker = [
        str(WORKER),
        "--mode",
        "ft" if launcher == "ft" else "plain",
        "--run-dir",
        str(run_dir),
        *common,
        "--ckpt-every",
        str(args.ckpt_every),
        "--pg-timeout",
        str(args.pg_timeout),
        "--fault",
        "kill" if fault == "kill" else "sigstop",
        "--fault-rank",
        "1",
        "--fault-step",
        str(args.fault_step),
    ]
    if launcher == "torchrun-fix":  # the workaround trainguard run applies for torch issue 135712
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if launcher.startswith("torchrun"):
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "3",
            *worker,
        ], env
    ft = [
        str(Path(args.nvrx) / "bin" / "ft_launcher"),
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "--ft-rank-heartbeat-timeout",
        str(args.ft_hb_timeout),
        "--ft-initial-rank-heartbeat-timeout",
        "120",
        "--ft-workload-check-interval",
        str(args.ft_check_interval),
    ]
    return ft + worker, env


def ft_unavailable(args: argparse.Namespace) -> Optional[str]:
    """Why ft_launcher cannot run here (None if it can)."""
    exe = Path(args.nvrx) / "bin" / "ft_launcher"
    if not exe.exists():
        return f"{exe} not found (install nvidia-resiliency-ext==0.4.1 into --nvrx, see --help)"
    r = subprocess.run(
        [
            str(Path(args.nvrx) / "bin" / "python"),
            "-c",
            "import torch, nvidia_resiliency_ext.fault_tolerance as f; print(torch.__version__)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.returncode != 0:
        return "import failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return None


def run_trial(args: argparse.Namespace, launcher: str, fault: str, run_dir: Path, timeouts: Optional[Path]) -> dict:
    run_dir.mkdir(parents=True)
    if timeouts is not None:
        shutil.copyfile(timeouts, run_dir / "timeouts.json")
    cmd, env = _command(args, launcher, fault, run_dir)
    log = open(run_dir / "launcher.log", "w")
    watcher = PidWatcher(run_dir)
    watcher.start()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        code: Optional[int] = proc.wait(args.cap)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    finally:
        watcher.stop.set()
        watcher.join(2)
        log.close()
        # leftovers (a stopped rank nobody killed): end them, they are ours
        for pid in watcher.pids:
            if not _exited(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    (run_dir / "trial.json").write_text(
        json.dumps(
            {
                "launcher": launcher,
                "fault": fault,
                "code": code,
                "pid_exits": {str(k): v for k, v in watcher.exits.items()},
            }
        )
    )
    return analyse(launcher, fault, run_dir, code, watcher.exits)


def reanalyse(base: Path) -> list[dict]:
    """Results of the trials kept in ``base`` (``--keep``), from their ``trial.json`` and events."""
    out = []
    for d in sorted(base.iterdir()):
        if (d / "trial.json").exists():
            t = json.loads((d / "trial.json").read_text())
            out.append(analyse(t["launcher"], t["fault"], d, t["code"], {int(k): v for k, v in t["pid_exits"].items()}))
    return out


def analyse(launcher: str, fault: str, run_dir: Path, code: Optional[int], exits: dict[int, float]) -> dict:
    ev = _events(run_dir)
    out: dict = {"launcher": launcher, "fault": fault, "code": code, "run_dir": str(run_dir), "error": None}
    inj = next((e for e in ev if e["kind"] == "fault_injected"), None)
    if inj is None:  # the job never reached the fault: say why (the launch's exit code, its last error line)
        out["error"] = f"no fault_injected event (exit code {code}{_last_error(run_dir / 'launcher.log')})"
        return out
    t_f = inj["time"]
    if launcher in INPROCESS:
        return _analyse_inprocess(out, ev, t_f)
    start = next((e for e in ev if e["kind"] == "start" and e["rank"] == 0 and e["time"] > t_f), None)
    if start is None:
        out["error"] = "timed out" if code is None else f"no recovery (exit code {code})"
        return out
    att = start["attempt"]
    done = next((e for e in ev if e["kind"] == "first_step_done" and e["attempt"] == att and e["time"] > t_f), None)
    out.update(
        total=start["time"] - t_f,
        step_done=(done["time"] - t_f) if done else None,
        restarts=att,
        start_step=start["details"].get("first_step"),
        lost=inj["step"] - start["details"].get("first_step", 0),
    )
    old_pids = [e["pid"] for e in ev if e["kind"] == "worker_timing" and e["attempt"] == inj["attempt"]]
    t_old_gone = max(exits[p] for p in old_pids) if old_pids and all(p in exits for p in old_pids) else None
    timing = next((e for e in ev if e["kind"] == "worker_timing" and e["rank"] == 0 and e["attempt"] == att), None)
    ph: dict[str, Optional[float]] = {}
    if t_old_gone is not None:
        ph["detect+stop"] = t_old_gone - t_f
    if t_old_gone is not None and timing is not None:
        ph["restart"] = timing["details"]["process"] - t_old_gone
    if launcher == "trainguard":
        det = next((e for e in ev if e["kind"] in ("hang_detected", "workers_failed") and e["time"] >= t_f), None)
        started = next((e for e in ev if e["kind"] == "workers_started" and e["details"].get("restart") == att), None)
        if det is not None:
            ph["detect"] = det["time"] - t_f
            if det["kind"] == "hang_detected":
                out["timeout"] = det["details"].get("timeout")
                out["learned"] = det["details"].get("learned")
                if t_old_gone is not None:
                    ph["stop"] = t_old_gone - det["time"]
        if t_old_gone is not None and started is not None:
            ph["rendezvous"] = started["time"] - t_old_gone
    if timing is not None:
        d = timing["details"]
        ph["torch import"] = d["torch_imported"] - d["process"]
        ph["pg init"] = d["pg_ready"] - d["torch_imported"]
        if "trainguard_import" in d:
            ph["model+DDP"] = d["trainguard_import"] - d["pg_ready"]
            ph["trainguard import+Guard"] = d["guard_ready"] - d["trainguard_import"]
        else:
            ph["model+DDP"] = d["guard_ready"] - d["pg_ready"]
        ph["resume"] = start["time"] - d["guard_ready"]
    out["phases"] = ph
    return out


def _analyse_inprocess(out: dict, ev: list[dict], t_f: float) -> dict:
    """A trial of in-process recovery: fault → rank 0's ``recovery_finished`` (the survivor trains
    again from the step boundary it kept); detection from ``workers_failed``/``hang_detected``."""
    inj = next(e for e in ev if e["kind"] == "fault_injected")
    done = next((e for e in ev if e["kind"] == "recovery_finished" and e["rank"] == 0 and e["time"] > t_f), None)
    if done is None:
        fell = next((e for e in ev if e["kind"] == "recovery_fallback"), None)
        out["error"] = f"fell back: {fell['details']['reason']}" if fell else f"no recovery (exit code {out['code']})"
        return out
    # a hang's stack dump lets the stopped rank run on for a moment: rank 0 may be past the fault step
    lost = max(0, inj["step"] - done["step"])
    out.update(total=done["time"] - t_f, step_done=None, restarts=0, start_step=done["step"], lost=lost)
    det = next((e for e in ev if e["kind"] in ("hang_detected", "workers_failed") and e["time"] >= t_f), None)
    ph: dict[str, Optional[float]] = {}
    if det is not None:
        ph["detect"] = det["time"] - t_f
        ph["rejoin"] = done["time"] - det["time"]
        if det["kind"] == "hang_detected":
            out["timeout"], out["learned"] = det["details"].get("timeout"), det["details"].get("learned")
    out["phases"] = ph
    return out


def _name(launcher: str) -> str:
    """The launcher's name on one line."""
    return NAMES[launcher].replace("\n", " ")


def _goal(ours: str, fault: str, median: Optional[float], timeouts: list[float]) -> str:
    """The goal cell: in-process kill ≤ 1 s, hang ≤ the learned step timeout + 1 s; the restart
    path's goals (3 s, 5 s) when only it ran."""
    if ours in INPROCESS:
        limit = GOALS[fault] + (statistics.median(timeouts) if fault == "hang" and timeouts else 0.0)
        text = f"≤ {limit:.1f} s" + (" (timeout + 1 s)" if fault == "hang" else "")
    else:
        limit = RESTART_GOALS[fault]
        text = f"≤ {limit:.0f} s"
    return f"{text}: " + ("—" if median is None else ("met" if median <= limit else "MISSED"))


def _last_error(log: Path) -> str:
    """``; LINE`` with the last line of ``log`` that names an error, or ``""``."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    hits = [ln.strip() for ln in lines if "Error" in ln or "error:" in ln or "giving up" in ln]
    return f"; {hits[-1][:300]}" if hits else ""


PHASE_ROWS = [  # (key, label, from → to, part of the total: the rows marked True add up to it)
    ("detect+stop", "detect + stop", "fault → the last rank process of the failed attempt has exited", True),
    (
        "detect",
        "  detect",
        "fault → workers_failed (after torch closed the other ranks) / hang_detected event (trainguard)",
        False,
    ),
    ("stop", "  stop", "hang_detected → old rank processes gone (trainguard, hang)", False),
    (
        "restart",
        "restart",
        "→ first line of the new rank 0 process (rendezvous, spawn, interpreter; incl. failed re-rendezvous)",
        True,
    ),
    ("rendezvous", "  rendezvous", "old processes gone → workers_started event (trainguard)", False),
    ("torch import", "torch import", "→ import torch done", True),
    ("pg init", "pg init", "→ init_process_group returned (waits for the slower rank)", True),
    ("model+DDP", "model + DDP", "→ model, DDP(model) (imports torch._dynamo), optimizer", True),
    (
        "trainguard import+Guard",
        "import trainguard + Guard",
        "→ import trainguard, config, Guard() (trainguard only)",
        True,
    ),
    ("resume", "resume", "→ start event (checkpoint loaded)", True),
    ("rejoin", "in-process recovery", "workers_failed / hang_detected → rank 0's recovery_finished", False),
]


def run_all(args: argparse.Namespace, base: Path, console, unavailable: dict[str, str]) -> list[dict]:
    """The warm-up run, then every trial, interleaved."""
    results: list[dict] = []
    timeouts = None
    learns = {"trainguard", *INPROCESS}  # the launchers whose hang trials use the learned timeouts
    if learns & set(args.launchers) and "hang" in args.faults:
        # warm-up: the same job without a fault; its timeouts.json gives the learned timeouts
        warm = base / "warmup"
        subprocess.run(
            _trainguard()
            + [
                "run",
                "--nproc-per-node",
                "2",
                "--run-dir",
                str(warm),
                str(WORKER),
                "--mode",
                "trainguard",
                "--steps",
                str(args.steps),
                "--step-ms",
                str(args.step_ms),
                "--set",
                f"checkpoint.interval={args.ckpt_every}",
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=args.cap,
        )
        timeouts = warm / "timeouts.json"
        step = json.loads(timeouts.read_text())["sections"]["step"] if timeouts.exists() else None
        console.print(
            f"warm-up run: step timeout {step['timeout']:.2f} s, learned={step['learned']} ({step['count']} steps observed)"
            if step
            else "warm-up run: no timeouts.json (the hang trials use the configured timeouts)"
        )
        if step is None:
            timeouts = None
    for trial in range(args.trials):
        for fault in args.faults:
            for launcher in args.launchers:
                if (
                    launcher in unavailable
                    or (launcher == "torchrun-fix" and fault not in args.fix_faults)
                    or (launcher, fault) in args.skip
                ):
                    continue
                t0 = time.perf_counter()
                r = run_trial(
                    args,
                    launcher,
                    fault,
                    base / f"{launcher}-{fault}-{trial}",
                    timeouts if launcher in learns else None,
                )
                results.append(r)
                val = f"{r['total']:.2f} s (restarts {r['restarts']})" if r.get("total") is not None else r["error"]
                console.print(
                    f"trial {trial + 1}/{args.trials} {_name(launcher):>26} {fault:<4}: fault → training again {val}; "
                    f"trial {time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.2f}"
                )
    return results


def main() -> int:
    args = _parse()
    from rich.console import Console
    from rich.table import Table

    console = Console(width=170)
    load0 = os.getloadavg()
    unavailable: dict[str, str] = {}
    t_wall = time.perf_counter()
    if args.analyse:
        results = reanalyse(Path(args.analyse))
        args.trials = max(
            sum(1 for r in results if r["launcher"] == l and r["fault"] == f) for l in LAUNCHERS for f in FAULTS
        )
        args.launchers = [l for l in args.launchers if any(r["launcher"] == l for r in results)]
        args.faults = [f for f in args.faults if any(r["fault"] == f for r in results)]
    else:
        if "ft" in args.launchers:
            why = ft_unavailable(args)
            if why:
                unavailable["ft"] = why
        base = Path(tempfile.mkdtemp(prefix="tg-bench-recovery-"))
        try:
            results = run_all(args, base, console, unavailable)
        finally:
            if args.keep:
                print(f"run directories kept in {base}")
            else:
                shutil.rmtree(base, ignore_errors=True)
    wall = time.perf_counter() - t_wall
    med = statistics.median

    def vals(launcher: str, fault: str, key: str = "total") -> list[float]:
        return [r[key] for r in results if r["launcher"] == launcher and r["fault"] == fault and r.get(key) is not None]

    def failed(launcher: str, fault: str) -> list[str]:
        return [r["error"] for r in results if r["launcher"] == launcher and r["fault"] == fault and r["error"]]

    table = Table(
        title=f"fault on rank 1 at step {args.fault_step} → rank 0 trains again (seconds: median, min–max of "
        f"{args.trials} trial(s); completed steps trained again); 2 gloo ranks, {args.step_ms:.0f} ms steps"
    )
    table.add_column("fault")
    for launcher in args.launchers:
        table.add_column(NAMES[launcher], justify="right")
    # trainguard's arms (each in-process loop shape, else the restart) against every other launcher
    mine = [x for x in ("inprocess", "inprocess-plain", "trainguard") if x in args.launchers]
    mine = [x for x in mine if x in INPROCESS] or mine
    ours = mine[0] if mine else None
    has_tg = ours is not None
    others = [x for x in args.launchers if x not in mine and x != "inprocess-cold"]
    per_trial: list[str] = []
    meds: dict[tuple[str, str], float] = {}
    for fault in args.faults:
        cells = []
        for launcher in args.launchers:
            if launcher in unavailable:
                cells.append(f"not run: {unavailable[launcher]}")
                continue
            v = vals(launcher, fault)
            bad = failed(launcher, fault)
            if not v:
                cells.append("no recovery: " + "; ".join(sorted(set(bad))) if bad else "—")
                continue
            meds[launcher, fault] = med(v)
            restarts = vals(launcher, fault, "restarts")
            more = sum(1 for x in restarts if x > 1)
            notes = ([f"{len(bad)} failed"] if bad else []) + ([f"{more}× 2+ restarts"] if more else [])
            lost = vals(launcher, fault, "lost")
            cells.append(
                f"{med(v):.2f} [{min(v):.2f}–{max(v):.2f}]"
                + (f"\nlost {med(lost):g}" if lost else "")
                + (f"\n({', '.join(notes)})" if notes else "")
            )
            per_trial.append(
                f"{_name(launcher)} {fault}: "
                + " ".join(f"{x:.1f}" for x in v)
                + (f"; failed: {'; '.join(bad)}" if bad else "")
            )
        label = "kill\n(SIGKILL)" if fault == "kill" else "hang\n(SIGSTOP)"
        table.add_row(label, *cells)
    console.print(table)
    console.print("per trial (s): " + " | ".join(per_trial))
    if has_tg:
        ratios = Table(title="trainguard / other launcher (ratio of the medians; < 1: trainguard trains again sooner)")
        ratios.add_column("trainguard arm")
        ratios.add_column("fault")
        for o in others:
            ratios.add_column(_name(o), justify="right")
        ratios.add_column("goal", justify="right")
        for arm in mine:
            for fault in args.faults:
                mine_med = meds.get((arm, fault))
                cells = [f"{mine_med / meds[o, fault]:.3f}" if mine_med and (o, fault) in meds else "—" for o in others]
                goal = _goal(arm, fault, mine_med, vals(arm, fault, "timeout"))
                lost = vals(arm, fault, "lost")
                ratios.add_row(_name(arm), fault, *cells, goal + (f"; lost {max(lost):g}" if lost else ""))
        console.print(ratios)

    # per-launcher details
    for fault in args.faults:
        if has_tg and fault == "hang":
            tos = vals(ours, "hang", "timeout")
            lrn = [r.get("learned") for r in results if r["launcher"] == ours and r["fault"] == "hang"]
            if tos:
                console.print(
                    f"trainguard hang timeout used: {med(tos):.2f} s (learned in {sum(bool(x) for x in lrn)}/{len(lrn)} trials); "
                    f"ft_launcher: hand-set {args.ft_hb_timeout:.0f} s heartbeat timeout checked every {args.ft_check_interval:g} s; "
                    f"torchrun: process-group timeout {args.pg_timeout:.0f} s"
                )
        sd = [
            f"{_name(l)} {med(vals(l, fault, 'step_done')):.2f}" for l in args.launchers if vals(l, fault, "step_done")
        ]
        console.print(f"{fault}: fault → first resumed step done (median s): " + ", ".join(sd))

    bd = Table(title="phases of the recovery (median ms; rank 0 of the new attempt)")
    bd.add_column("phase")
    bd.add_column("from → to")
    cols = [(l, f) for f in args.faults for l in args.launchers if vals(l, f)]
    for l, f in cols:
        bd.add_column(f"{NAMES[l]}\n{f}", justify="right")
    for key, label, span, _ in PHASE_ROWS:
        cells = []
        for l, f in cols:
            v = [
                r["phases"][key]
                for r in results
                if r["launcher"] == l and r["fault"] == f and r.get("phases", {}).get(key) is not None
            ]
            cells.append(f"{med(v) * 1e3:.0f}" if v else "")
        if any(cells):
            bd.add_row(label, span, *cells)
    bd.add_row(
        "total",
        "fault → start event (in-process: recovery_finished)",
        *[f"{med(vals(l, f)) * 1e3:.0f}" for l, f in cols],
    )

    def net(l: str, f: str) -> list[float]:
        return [
            r["total"] - r["phases"].get("torch import", 0) - r["phases"].get("model+DDP", 0)
            for r in results
            if r["launcher"] == l and r["fault"] == f and r.get("total") is not None
        ]

    bd.add_row(
        "total − torch start-up",
        "total less torch import and model + DDP (the same work for every launcher)",
        *[f"{med(net(l, f)) * 1e3:.0f}" for l, f in cols],
    )
    console.print(bd)
    for l, f in cols:
        if l != "trainguard":
            continue
        phs = {
            k: med(
                [r["phases"][k] for r in results if r["launcher"] == l and r["fault"] == f and k in r.get("phases", {})]
            )
            for k, _, _, top in PHASE_ROWS
            if top and any(k in r.get("phases", {}) for r in results if r["launcher"] == l and r["fault"] == f)
        }
        if phs:
            big = max(phs, key=phs.get)
            console.print(f"trainguard {f}: biggest phase '{big}' {phs[big]:.2f} s of {med(vals(l, f)):.2f} s")
    if has_tg:
        for f in args.faults:
            tg = net("trainguard", f)
            restarts = [o for o in others if o != "trainguard" and o not in INPROCESS]
            parts = [f"{_name(o)} {med(tg) / med(net(o, f)):.2f}" for o in restarts if tg and net(o, f)]
            if parts:
                console.print(f"{f}: trainguard / other, net of torch start-up (medians): " + ", ".join(parts))
    for name, why in unavailable.items():
        console.print(f"{_name(name)} not run: {why}")
    refs = ", ".join(f"{_name(l)} {f} {v:g} s" for (l, f), v in REFERENCE.items())
    console.print(f"reference medians measured earlier on this machine: {refs}")
    load1 = os.getloadavg()
    console.print(
        f"wall {wall:.0f} s; load average at start {load0[0]:.2f}, at end {load1[0]:.2f} (1 min), {load1[1]:.2f} (5 min) "
        f"(2 ranks fill a 2-core machine: other load adds noise)"
    )
    failures = [f"{_name(r['launcher'])} {r['fault']}: {r['error']}" for r in results if r["error"]]
    if args.smoke and failures:
        console.print("smoke: trials that did not recover: " + " | ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
