"""The group restart with and without the just-in-time save, and in-process recovery, in one run.

For each loop shape of the zoo (``tests/zoo``, by default the two that fall back to a group restart
by design, nanoGPT and timm, the ``run_step`` + barrier shape of issue 55 and the README-like
``resume_barrier`` loop): one uninterrupted launch (the final weights' hash), then the same seeded
SIGKILL (a random rank at a random step plus a random fraction of a step, ``tests/zoo/drive.py``)
in three arms:

* ``restart``: ``recovery.in_process=false``, ``checkpoint.jit.enabled=false``: the group restart
  from the newest checkpoint (a checkpoint every 10 steps), as before issue 55 (the baseline);
* ``restart+jit``: ``recovery.in_process=false``: the survivors save the last completed step
  before the group restarts, and it resumes from there;
* ``in-process``: the defaults (in-process recovery, one warm spare; a fallback restarts the group,
  with the just-in-time save).

Reported per shape and arm: kill → training again (the first step printed after the restarted
group started, or after the survivors recovered), kill → the restarted group's start, the save's
own time (the launcher's request to the last copy committed, stopping the ranks included),
completed steps trained again (the interrupted
step is not counted: it was not completed), bitwise (the final weights equal the uninterrupted
run's), and the path taken. Goals (issue 55): 0 steps redone on every restart with the save,
kill → training again ≤ the restart's + 1 s, bitwise on every row. Reports, does not assert
(``--smoke`` exits 1 when a launch failed).

Run: ``python benchmarks/jit_restart.py [--shapes a,b] [--trials 1] [--seed 0]``; ``--smoke``: one
shape (``resume_barrier``), 40 steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "zoo"))

import drive  # noqa: E402

ARMS = {
    "restart": (*drive.RESTART, "checkpoint.jit.enabled=false"),
    "restart+jit": drive.RESTART,
    "in-process": (),
}
DEFAULT_SHAPES = "nanogpt,timm,run_step_barrier,resume_barrier"
SLACK = 1.0  # seconds: the goal's bound over the restart without the save


def _save_seconds(t: drive.Trial) -> float | None:
    """The launcher's just-in-time save in trial ``t``: request to commit (stopping the ranks included)."""
    for e in drive.read_events(Path(t.run), "checkpoint_committed"):
        if e["details"].get("kind") == "jit":
            return float(e["details"]["seconds"])
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma-separated shape names (default: {DEFAULT_SHAPES})")
    p.add_argument("--trials", type=int, default=1, help="kills per shape and arm (default 1)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per launch (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="one shape (resume_barrier), 40 steps, one trial per arm")
    args = p.parse_args()
    if args.smoke:
        args.shapes, args.steps, args.trials = "resume_barrier", 40, 1
    names = [s for s in args.shapes.split(",") if s]
    unknown = drive.unknown_shapes(names)
    if unknown:
        print(f"jit_restart: error: unknown shape(s) {unknown}; known: {', '.join(drive.SHAPES)}", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="jit-restart-"))
    rows, failed = drive.kill_arms(names, ARMS, base, args.trials, args.steps, args.seed)

    def med(trials: list[drive.Trial], key: str) -> float:
        values = [getattr(t, key) for t in trials if getattr(t, key) == getattr(t, key)]
        return statistics.median(values) if values else float("nan")

    print(
        f"\njust-in-time save: 2 ranks, {args.steps} steps, a checkpoint every 10, {args.trials} kill(s) per shape "
        f"and arm; load average {os.getloadavg()[0]:.1f}"
    )
    print(
        "| shape | arm | path | kill → training again (s) | kill → group restarted (s) | the save (s) "
        "| steps redone | bitwise | − restart (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    met = total = 0
    for name, arms in rows:
        base_s = med(arms["restart"], "seconds")
        for arm, trials in arms.items():
            s = med(trials, "seconds")
            paths = ",".join(sorted({t.path for t in trials}))
            bitwise = sum(t.bitwise for t in trials)
            saves = [x for x in (_save_seconds(t) for t in trials) if x is not None]
            save = f"{statistics.median(saves):.2f}" if saves else "—"
            print(
                f"| {name} | {arm} | {paths} | {s:.2f} | {med(trials, 'to_restart'):.2f} | {save} "
                f"| {med(trials, 'redone'):g} | {bitwise}/{len(trials)} | {s - base_s:+.2f} |"
            )
            if arm == "restart+jit":
                total += len(trials)
                met += sum(
                    t.redone == 0 and t.bitwise and t.seconds <= r.seconds + SLACK
                    for t, r in zip(trials, arms["restart"])
                )
    print(
        f"goal: with the just-in-time save, 0 steps redone, bitwise and ≤ the restart + {SLACK:g} s: "
        f"{met} of {total} kills; runs in {base}"
    )
    return 1 if failed and args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
