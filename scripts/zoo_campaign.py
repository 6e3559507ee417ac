"""The zoo's full fault campaign: every loop shape of ``tests/zoo`` killed at random moments and hung.

For each shape (``tests/zoo/drive.py``'s ``SHAPES``): one uninterrupted launch for the final
weights' hash, then ``--kills`` launches (default 3) with one rank SIGKILLed from outside at a
seeded random step plus a random fraction of a step, and ``--hangs`` launches (default 1) with one
rank SIGSTOPped from outside (the hang supervisor finds it stopped and kills it), all with the
default recovery settings (in-process recovery, one warm spare) and ``checkpoint.interval=10``.
When a fault ended in a group restart (``fallback``), the same fault (same seed) is run again with
``recovery.in_process=false`` for the restart's own time, the bound a fallback must keep (+ 2 s).

Prints one table row per fault: shape, fault, the step printed before it, path (in-process,
fallback, failed), seconds from the fault to training again, completed steps redone, bitwise
(final weights equal the uninterrupted run's), ``rank_replaced`` events, the fallback's reason;
then one line per shape with the verdict of issue 43's rule ("in-process bitwise, or a fallback
within the restart's time + 2 s with its reason on the console, never more than one replacement
per fault"). Exits 1 when a fault broke the rule. Not run in CI (about 20 minutes on 2 cores for
the 12 shapes); CI's soak step runs tests/test_zoo.py, one kill per shape.

The resume arm (issue 53; ``--resumes``, default on): per shape, the whole launch stopped at a
seeded random step, once by SIGTERM to the launcher (it saves and exits 75) and once by SIGKILL of
the launcher and its ranks, then the same command run again (``drive.resume_trial``). Its rule: the
relaunch ends 0, resumed from a checkpoint, with the uninterrupted run's weights ("bitwise") or a
``resume_not_bitwise`` event naming why ("said"). One row per resume, after the faults' table.

Run: ``python scripts/zoo_campaign.py [--kills 3] [--hangs 1] [--no-resumes] [--shapes nanogpt,fsdp2] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "zoo"))

import drive  # noqa: E402

SLACK = 2.0  # seconds a fallback may take beyond the group restart's own time (issue 43)


def said_not_bitwise(t: drive.Trial) -> bool:
    """Whether the trial's console said its resume cannot be bitwise (``resume_not_bitwise``)."""
    try:
        return "a resume cannot be bitwise identical" in Path(f"{t.run}.log").read_text(errors="replace")
    except OSError:
        return False


def verdict(t: drive.Trial, restart: drive.Trial | None) -> str:
    """``ok`` or what broke the rule for one fault (bitwise, or said not to be: ``ok, not bitwise, said``)."""
    if t.replaced > 1:
        return f"{t.replaced} replacements for one fault"
    if t.path == "in-process":
        return "ok" if t.bitwise else "ok, not bitwise, said" if said_not_bitwise(t) else "in-process but not bitwise"
    if t.path == "fallback":
        if not t.console_reason:
            return "fallback without its reason on the console"
        if restart is None or restart.seconds != restart.seconds:
            return "fallback (no restart time to compare)"
        if t.seconds > restart.seconds + SLACK:
            return f"fallback {t.seconds:.1f} s > restart {restart.seconds:.1f} s + {SLACK:g} s"
        return "ok" if t.bitwise else "ok, not bitwise, said" if said_not_bitwise(t) else "fallback, not bitwise"
    return f"{t.path} (exit {t.code})"


def resume_verdict(r: drive.Resume) -> str:
    """``ok`` (bitwise), ``ok, not bitwise, said``, ``ok, finished before the stop ...`` (SIGTERM
    reached a run in its last second) or what broke the resume arm's rule."""
    if r.how == "sigterm" and r.first == 0:  # the stop check runs about once a second: a fast run may end first
        return "ok, finished before the stop took effect (nothing resumed)"
    if r.how == "sigterm" and r.first != 75:
        return f"SIGTERM ended the launch with {r.first}, not 75"
    if r.second != 0:
        return f"the relaunch ended {r.second}"
    if r.from_step < 0:  # stopped before its first checkpoint was committed (the first save is checked too)
        return (
            "ok, no checkpoint committed before the stop (started anew)" if r.bitwise else "started anew, not bitwise"
        )
    return "ok" if r.bitwise else "ok, not bitwise, said" if r.said else "resumed not bitwise, silently"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=3, help="SIGKILLs per shape (default 3)")
    p.add_argument("--hangs", type=int, default=1, help="SIGSTOPs per shape (default 1)")
    p.add_argument("--shapes", default=",".join(drive.SHAPES), help="comma-separated shape names (default: all)")
    p.add_argument("--resumes", action=argparse.BooleanOptionalAction, default=True, help="the resume arm (default on)")
    p.add_argument("--seed", type=int, default=0, help="base of the per-fault seeds")
    p.add_argument("--dir", type=Path, default=None, help="where the runs go (default: a new temporary directory)")
    p.add_argument("--json", type=Path, default=None, help="also write every trial's fields here")
    args = p.parse_args()
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in drive.SHAPES]
    if unknown:
        print(f"zoo_campaign: error: unknown shape(s) {unknown}; known: {', '.join(drive.SHAPES)}", file=sys.stderr)
        return 2
    base = args.dir or Path(tempfile.mkdtemp(prefix="zoo-campaign-"))
    trials: list[drive.Trial] = []
    resumes: list[tuple[str, drive.Resume]] = []
    verdicts: dict[str, list[str]] = {}
    for n, name in enumerate(names):
        shape = drive.SHAPES[name]
        clean = drive.clean_run(shape, base / name / "clean")
        if clean is None:
            print(f"{name}: the uninterrupted run failed: {base / name / 'clean'}.log", flush=True)
            verdicts[name] = ["clean run failed"]
            continue
        faults = ["kill"] * args.kills + ["hang"] * args.hangs
        for i, fault in enumerate(faults):
            seed = args.seed * 100_000 + n * 100 + i
            t = drive.fault_trial(shape, base / name / f"{fault}-{i}", seed, fault, clean=clean)
            restart = None
            if t.path == "fallback":
                restart = drive.fault_trial(
                    shape, base / name / f"{fault}-{i}-restart", seed, fault, settings=drive.RESTART, clean=clean
                )
            trials.append(t)
            verdicts.setdefault(name, []).append(verdict(t, restart))
            print(drive.table([t]).splitlines()[-1], f"→ {verdicts[name][-1]}", flush=True)
        for i, how in enumerate(("sigterm", "kill") if args.resumes else ()):
            r = drive.resume_trial(
                shape, base / name / f"resume-{how}", args.seed * 100_000 + n * 100 + 50 + i, how, clean
            )
            resumes.append((name, r))
            verdicts.setdefault(name, []).append(resume_verdict(r))
            print(f"{name} resume ({how}) at step {r.at}: {verdicts[name][-1]}", flush=True)
    print(f"\nzoo campaign: {args.kills} kill(s) and {args.hangs} hang(s) per shape, 2 ranks, runs in {base}")
    print(drive.table(trials))
    if resumes:
        print(
            "\n| shape | resume | stopped at | exits | resumed from | bitwise | said |\n|---|---|---|---|---|---|---|"
        )
        for name, r in resumes:
            said = "; ".join(sorted({c[:90] for c in r.said})) or "-"
            print(f"| {name} | {r.how} | {r.at} | {r.first}, {r.second} | {r.from_step} | {r.bitwise} | {said} |")
    print("\n| shape | verdict |\n|---|---|")
    for name, vs in verdicts.items():
        bad = [v for v in vs if v != "ok"]
        print(f"| {name} | {'ok' if not bad else '; '.join(bad)} |")
    if args.json:
        args.json.write_text(json.dumps([t.row() for t in trials], indent=1))
    return 1 if any(not v.startswith("ok") for vs in verdicts.values() for v in vs) else 0


if __name__ == "__main__":
    sys.exit(main())
