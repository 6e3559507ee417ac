"""A seeded fault campaign: the example GPT under ``trainguard run``, random faults at random steps,
invariants checked after every trial.

Each trial (``--trials``, seeds ``--seed``, ``--seed + 1``, ...) trains the tiny example GPT
(``examples/gpt.py``) on 2 CPU ranks for ``--steps`` steps (a checkpoint every 20) and throws one
to three faults at it, drawn from the trial's seed:

* ``kill``: a rank SIGKILLs itself at a step (``--inject rank_killed``);
* ``hang``: a rank stops itself (SIGSTOP) at a step (``--inject rank_hung``), for the supervisor;
* ``sigkill_rank``: this script SIGKILLs a rank process from outside at a random moment;
* ``sigterm``: this script sends the launcher SIGTERM (a preemption): the launch ends with 75 and
  is launched again;
* ``sigkill_launcher``: this script SIGKILLs the launcher (its ranks die with it): launched again;
* ``corrupt``: this script flips a byte in the newest committed checkpoint's files while the run
  goes on (a bad disk); the next resume, if any, must skip it;
* ``nan``: a rank's loss becomes NaN at a step (``--inject nan_loss``): skipped, a rollback, or a
  re-run;
* ``oom``: a rank runs out of memory in a step (``--inject oom``): the micro-batch is split;
* ``disk_full``: the checkpoint directory is a small tmpfs of its own (mounted by this script, as
  root); at the fault's step this script fills it, waits for a save to fail
  (``checkpoint_failed``), then frees it: training goes on, the next save commits;
* ``eio``: this script stops the launch with SIGTERM, and the relaunch runs with
  ``scripts/eio_preload.c`` preloaded: in every process the first one or two opens of a
  ``manifest.json`` fail with EIO (a flaky shared file system): the resume reads the newest
  checkpoint on a later try (trainguard tries 3 times), sets nothing aside, ends bitwise.

Invariants after each trial (a violation is printed with its seed, so it reproduces):

1. the trial ends with exit code 0 (after relaunches for ``sigterm`` and ``sigkill_launcher``), or
   a fault legitimately ended it with its documented code and the newest committed checkpoint
   verifies (three ``oom`` faults: the batch of 4 splits twice, the third gives up with 76);
2. its final state equals the clean run's (``state sha256``), unless a ``nan`` or ``oom`` fault
   legitimately changed the trajectory (then only the end counts);
3. no checkpoint was set aside (``.invalid-*``) that still verifies: only the corrupted one may be;
4. no process of the trial is left (its ranks, spares, launcher);
5. nothing outside the trial's run directory changed (a sentinel directory beside it);
6. the events account for every fault (``fault_injected``, a failure or hang the launcher saw, the
   stop, the skip or the out-of-memory split).

It prints a table: trials, faults by kind, survived, violations (with seeds)::

    .venv/bin/python scripts/fault_campaign.py [--trials 20] [--seed 0] [--steps 120] [--keep]

Left out (no injection layer here yet): a slow-I/O stall. Without the rights to mount a tmpfs a
``disk_full`` fault is skipped, without a C compiler an ``eio`` fault is a plain SIGTERM (said in
its trial's line).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from trainguard.checkpoint import manifest as mf  # noqa: E402
from trainguard.events import read_events  # noqa: E402

GPT = ROOT / "examples" / "gpt.py"
TINY = [
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.seq_len=32",
    "train.batch_size=4",
    "data.max_bytes=200000",
    "train.log_interval=1",
    "train.eval_batches=2",
    "train.warmup_steps=5",
]
KINDS = ("kill", "hang", "sigkill_rank", "sigterm", "sigkill_launcher", "corrupt", "nan", "oom", "disk_full", "eio")
STOPS = ("sigterm", "sigkill_launcher", "eio")  # faults that end a launch (one per trial)
DISK_BYTES = 16 << 20  # the tmpfs of a disk_full trial's checkpoint directory: a few tiny-GPT checkpoints
CHANGES_RESULT = {"nan", "oom"}  # faults after which the final state may differ from the clean run's
TRIAL_CAP = 300.0  # seconds a trial may take in all


def command(run: Path, steps: int, injects: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--run-dir", str(run)]
    for spec in injects:
        cmd += ["--inject", spec]
    cmd.append(str(GPT))
    for item in [*TINY, f"train.max_steps={steps}", "checkpoint.interval=20"]:
        cmd += ["--set", item]
    return cmd


def logged_step(log: Path) -> int:
    """Highest ``step N/M`` rank 0 printed (0 if none)."""
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        return 0
    return max((int(ln.split()[1].split("/")[0]) for ln in text.splitlines() if ln.startswith("step ")), default=0)


def rank_pids(run: Path) -> list[int]:
    """The current rank processes, from the launch record."""
    pids = []
    for path in (run / ".launches").glob("*.json"):
        try:
            pids += [int(r["pid"]) for r in json.loads(path.read_text())["ranks"].values()]
        except (OSError, ValueError, KeyError):
            continue
    return pids


def trial_processes(run: Path) -> list[psutil.Process]:
    """Live processes whose environment names ``run`` as their run directory."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("TRAINGUARD_RUN_DIR") == str(run) or str(run) in " ".join(p.cmdline()):
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def corrupt_newest(run: Path) -> Optional[str]:
    """Flip one byte in the largest file of the newest committed checkpoint; its path, or ``None``."""
    ckpts = sorted(p for p in (run / "checkpoints").glob("step-*") if (p / mf.MANIFEST).exists())
    if not ckpts:
        return None
    files = sorted(
        (p for p in ckpts[-1].rglob("*") if p.is_file() and p.name != mf.MANIFEST), key=lambda p: p.stat().st_size
    )
    if not files:
        return None
    with open(files[-1], "r+b") as f:
        f.seek(files[-1].stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return str(ckpts[-1])


def mount_small_disk(path: Path) -> bool:
    """Mount a :data:`DISK_BYTES` tmpfs at ``path`` (root only); whether it is mounted."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def fill_up(directory: Path) -> Path:
    """Write zeros into ``directory/filler`` until the file system is full; the filler's path."""
    filler, chunk = directory / "filler", b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    return filler


def disk_full(run: Path, proc: subprocess.Popen) -> None:
    """Fill the checkpoint directory's file system until a save fails (at most 30 s, or until the
    launch ends), then free it."""
    filler = fill_up(run / "checkpoints")
    end = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < end and not list(read_events(run, "checkpoint_failed")):
        time.sleep(0.05)
    filler.unlink()


def draw(rng: random.Random, steps: int) -> list[tuple[str, int, int]]:
    """One to three ``(kind, step, rank)`` faults."""
    faults = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(KINDS)
        faults.append((kind, rng.randint(15, steps - 15), rng.randrange(2)))
    kinds = [k for k, _, _ in faults]
    # one launcher-level stop per trial keeps the relaunch logic plain
    while sum(k in STOPS for k in kinds) > 1:
        i = max(i for i, k in enumerate(kinds) if k in STOPS)
        faults.pop(i)
        kinds.pop(i)
    return sorted(faults, key=lambda f: f[1])


def build_preload(base: Path) -> Optional[Path]:
    """Compile ``scripts/eio_preload.c`` into ``base``; ``None`` without a C compiler."""
    out = base / "eio_preload.so"
    src = ROOT / "scripts" / "eio_preload.c"
    try:
        done = subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(src), "-ldl"], capture_output=True)
    except OSError:
        return None
    return out if done.returncode == 0 else None


def run_trial(base: Path, seed: int, steps: int, clean: Optional[str], preload: Optional[Path] = None) -> dict:
    rng = random.Random(seed)
    faults = draw(rng, steps)
    trial = base / f"trial-{seed}"
    run, sentinel = trial / "run", trial / "sentinel"
    sentinel.mkdir(parents=True)
    (sentinel / "keep.txt").write_text("outside the run directory\n")
    injects = []
    for kind, step, rank in faults:
        if kind == "kill":
            injects.append(f"rank_killed:rank={rank},step={step}")
        elif kind == "hang":
            injects.append(f"rank_hung:rank={rank},step={step},hang=sigstop")
        elif kind == "nan":
            injects.append(f"nan_loss:rank={rank},step={step}")
        elif kind == "oom":
            injects.append(f"oom:rank={rank},step={step}")
    external = [
        (k, s, r)
        for k, s, r in faults
        if k in ("sigkill_rank", "sigterm", "sigkill_launcher", "corrupt", "disk_full", "eio")
    ]
    env = dict(os.environ)  # an eio fault adds the preload for the relaunches
    mounted = "disk_full" in [k for k, _, _ in faults] and mount_small_disk(run / "checkpoints")
    log = trial / "run.log"
    deadline = time.monotonic() + TRIAL_CAP
    codes, corrupted, notes = [], [], []
    launches = 0
    while time.monotonic() < deadline and launches < 4:
        launches += 1
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                command(run, steps, injects),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
                env=env,
            )
        while proc.poll() is None and time.monotonic() < deadline:
            step = logged_step(log)
            while external and step >= external[0][1]:
                kind, at, rank = external.pop(0)
                time.sleep(rng.random() * 0.05)  # a random moment inside the step
                if kind == "sigkill_rank":
                    pids = rank_pids(run)
                    if pids:
                        os.kill(pids[rank % len(pids)], signal.SIGKILL)
                elif kind in ("sigterm", "eio"):
                    proc.send_signal(signal.SIGTERM)
                    if kind == "eio" and preload is not None:
                        env.update(LD_PRELOAD=str(preload), TG_EIO_MANIFEST_OPENS=str(rng.choice((1, 2))))
                elif kind == "sigkill_launcher":
                    proc.send_signal(signal.SIGKILL)
                elif kind == "corrupt":
                    path = corrupt_newest(run)
                    if path:
                        corrupted.append(path)
                elif kind == "disk_full" and mounted:
                    disk_full(run, proc)
                notes.append(f"{kind}@{step}")
            time.sleep(0.05)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        codes.append(proc.returncode)
        if proc.returncode == 0:
            break
        if proc.returncode not in (75, -9):
            break
        wait_gone(run, 30)  # a killed launcher's ranks die with it; a relaunch waits for them
    try:
        result = check(trial, run, sentinel, faults, codes, corrupted, clean, seed, mounted)
        if "eio" in result["faults"] and preload is None:
            result["skipped"].append("eio (no C compiler: a plain SIGTERM)")
        return result
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(run / "checkpoints")], capture_output=True)


def wait_gone(run: Path, seconds: float) -> None:
    end = time.monotonic() + seconds
    while trial_processes(run) and time.monotonic() < end:
        time.sleep(0.1)


def check(trial, run, sentinel, faults, codes, corrupted, clean, seed, mounted=False) -> dict:
    kinds = [k for k, _, _ in faults]
    violations = []
    final = [e for e in read_events(run, "launch_exit") if e["details"]["code"] == 0]
    ended = legitimate_end(run, kinds, codes)
    if ended is not None:
        violations += ended
    elif not codes or codes[-1] != 0:
        violations.append(f"exit codes {codes}: the trial did not end with 0")
    sha = final[-1]["details"].get("state_sha256") if final else None
    if clean is not None and sha is not None and sha != clean and not CHANGES_RESULT & set(kinds):
        violations.append(f"final state {sha[:12]} differs from the clean run's {clean[:12]}")
    aside = list((run / "checkpoints").glob(".invalid-*")) if (run / "checkpoints").exists() else []
    for p in aside:
        try:
            valid = mf.verify(p) is None
        except OSError:
            valid = False
        if valid:
            violations.append(f"{p.name} was set aside but verifies")
    wait_gone(run, 10)
    left = trial_processes(run)
    if left:
        violations.append(f"processes left: {[p.pid for p in left]}")
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
    if sorted(x.name for x in sentinel.iterdir()) != ["keep.txt"] or (sentinel / "keep.txt").read_text() != (
        "outside the run directory\n"
    ):
        violations.append("a file outside the run directory changed")
    ev = list(read_events(run))
    seen = Counter(e["kind"] for e in ev)
    evidence = {
        "sigkill_rank": ("workers_failed", "recovery_started", "group_restart"),
        "sigterm": ("signal_received",),
        "sigkill_launcher": ("launch",),
        "corrupt": (),
        "disk_full": ("checkpoint_failed",) if mounted else (),
        "eio": ("signal_received",),
    }
    injected = {(e["details"].get("fault"), e["details"].get("rank")) for e in ev if e["kind"] == "fault_injected"}
    names = {"kill": "rank_killed", "hang": "rank_hung", "nan": "nan_loss", "oom": "oom"}
    for kind, step, rank in faults:
        if kind in names:  # fires once, in the rank's first process: not in its replacement, not after a relaunch
            replaced = any(
                e["kind"] in ("rank_replaced", "group_restart", "recovery_started") and (e["step"] or 0) < step
                for e in ev
            )
            if (names[kind], rank) not in injected and not replaced and seen["launch"] < 2:
                violations.append(f"the {kind} fault on rank {rank} at step {step} never fired")
            if kind == "hang" and (names[kind], rank) in injected and not seen["hang_detected"]:
                violations.append("a rank hung and no hang was detected")
        elif evidence[kind] and not any(seen[k] for k in evidence[kind]):
            violations.append(f"no event accounts for the {kind} fault")
    if "sigkill_launcher" in kinds and seen["launch"] < 2 and len(codes) > 1:
        violations.append("the relaunch after the launcher's SIGKILL left no launch event")
    return {
        "seed": seed,
        "faults": kinds,
        "codes": codes,
        "survived": bool(codes) and (codes[-1] == 0 or ended == []),
        "skipped": ["disk_full (no tmpfs: not root?)"] if "disk_full" in kinds and not mounted else [],
        "violations": violations,
        "trial": str(trial),
    }


def legitimate_end(run: Path, kinds: list[str], codes: list[int]) -> Optional[list[str]]:
    """A trial that a fault legitimately ended: the documented exit code, and its violations (the
    newest committed checkpoint must verify). ``None`` when the trial did not end so. The one such
    end the faults here can cause: a third out-of-memory fault at micro-batch size 1 (the tiny
    GPT's batch of 4 splits twice), 76 with ``oom_give_up``."""
    if not codes or codes[-1] != 76 or kinds.count("oom") < 3 or not list(read_events(run, "oom_give_up")):
        return None
    committed = sorted(p for p in (run / "checkpoints").glob("step-*") if (p / mf.MANIFEST).exists())
    if committed and mf.verify(committed[-1]) is not None:
        return [f"the run gave up (76, out of memory) and its newest checkpoint {committed[-1].name} does not verify"]
    return []


def clean_hash(base: Path, steps: int) -> Optional[str]:
    run = base / "clean" / "run"
    run.parent.mkdir(parents=True)
    with open(run.parent / "run.log", "wb") as out:
        subprocess.run(command(run, steps, []), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=TRIAL_CAP)
    done = [e for e in read_events(run, "launch_exit") if e["details"]["code"] == 0]
    return done[-1]["details"].get("state_sha256") if done else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="seed of the first trial (then +1, +2, ...)")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--keep", action="store_true", help="keep the trials' directories (printed)")
    args = p.parse_args()
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    base = Path(tempfile.mkdtemp(prefix="tg-campaign-"))
    t0 = time.monotonic()
    try:
        clean, preload = clean_hash(base, args.steps), build_preload(base)
        console.print(f"clean run: state sha256 {clean}")
        results = []
        for seed in range(args.seed, args.seed + args.trials):
            r = run_trial(base, seed, args.steps, clean, preload)
            results.append(r)
            mark = "ok" if not r["violations"] else "VIOLATION: " + "; ".join(r["violations"])
            skipped = f" (skipped: {', '.join(r['skipped'])})" if r["skipped"] else ""
            console.print(f"seed {seed}: {', '.join(r['faults'])}{skipped}; exit codes {r['codes']}: {mark}")
    finally:
        if args.keep:
            console.print(f"trial directories kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    faults = Counter(k for r in results for k in r["faults"])
    table = Table(title=f"fault campaign: {len(results)} trials, seeds {args.seed}–{args.seed + args.trials - 1}")
    for col in ("trials", "faults", *KINDS, "survived", "violations", "seeds with a violation"):
        table.add_column(col, justify="right")
    bad = [r["seed"] for r in results if r["violations"]]
    table.add_row(
        str(len(results)),
        str(sum(faults.values())),
        *[str(faults[k]) for k in KINDS],
        f"{sum(r['survived'] for r in results)}/{len(results)}",
        str(sum(len(r["violations"]) for r in results)),
        ", ".join(map(str, bad)) or "—",
    )
    console.print(table)
    console.print(f"wall {time.monotonic() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
