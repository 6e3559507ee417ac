"""The membership state machine at scale, simulated: 4,096 ranks on 512 nodes under a fault trace
shaped like Llama 3's.

Each node's launcher runs its own state machine (:mod:`trainguard.launcher.membership`) over its
local ranks, so the simulation drives 512 of them: every simulated poll (1 s) each node's machine
gets a ``Look`` at its 8 ranks; faults arrive from a trace drawn with a seed, with the mix of the
419 unexpected interruptions Meta reported for 54 days of Llama 3 405B pre-training on 16,384 GPUs
(Llama 3 paper, table 5: about 78 % hardware — faulty GPU 30.1 %, HBM3 17.2 %, other GPU/host
parts —, the rest software, network and host maintenance; a few silent data corruptions), scaled to
4,096 GPUs and compressed in time (``--hours``), plus bursts (``--bursts``: a rack of 8 nodes lost
at once). Kinds simulated:

* a rank lost (a GPU or HBM failure, a software crash): its exit code in the next ``Look``; the
  replacement joins ``--join-polls`` polls later;
* a rank hung (a network flap): ``Hang``, then the killed rank's exit code;
* a node lost (a host failure; a burst: 8 nodes): ``NodeLost`` on every other node's machine;
* silent data corruption: the rank is excluded like a lost one.

After every decision the invariants of ``tests/test_membership.py`` are checked (one live generation
per machine, budgets, nothing after an end). It prints the decision time (median, p99, max, µs)
at several world sizes: it must stay under 1 ms and not grow with the world size::

    .venv/bin/python benchmarks/membership_scale.py [--smoke] [--seed 0] [--hours 24] [--bursts 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from _common import SMOKE_HELP  # noqa: E402

from trainguard.launcher.membership import (  # noqa: E402
    Collect,
    Collected,
    End,
    Fallback,
    Hang,
    Joined,
    KillSurvivors,
    Limits,
    Look,
    Machine,
    NodeLost,
    Replace,
    Restart,
    Shrink,
    initial,
)

LOCAL = 8  # ranks per node
# share of each fault kind in the trace (Llama 3, table 5, grouped by what the launcher sees)
MIX = {"rank_lost": 0.78, "rank_hung": 0.12, "node_lost": 0.08, "sdc": 0.02}
LLAMA3_PER_GPU_HOUR = 419 / (54 * 24 * 16384)  # unexpected interruptions per GPU-hour


def trace(rng: random.Random, nodes: int, hours: float, bursts: int, compress: float) -> list[tuple[int, str, int]]:
    """``[(poll, kind, target)]``: faults at Llama 3's rate on ``nodes`` × 8 GPUs over ``hours``
    hours, ``compress`` times denser, plus ``bursts`` racks of 8 nodes; target: a global rank
    (a node for ``node_lost``)."""
    polls = int(hours * 3600)
    count = max(1, round(LLAMA3_PER_GPU_HOUR * nodes * LOCAL * hours * compress))
    faults = []
    for _ in range(count):
        kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        target = rng.randrange(nodes) if kind == "node_lost" else rng.randrange(nodes * LOCAL)
        faults.append((rng.randrange(polls), kind, target))
    for _ in range(bursts):
        at, rack = rng.randrange(polls), rng.randrange(0, nodes, 8)
        faults += [(at, "node_lost", n) for n in range(rack, min(rack + 8, nodes))]
    return sorted(faults)


def simulate(nodes: int, faults: list[tuple[int, str, int]], polls: int, join_polls: int) -> dict:
    """Run ``nodes`` machines through ``polls`` polls with ``faults``; decision times and counts."""
    limits = Limits(in_process=True, max_replacements=10_000, max_restarts=10_000)
    world = nodes * LOCAL
    machines = [Machine(initial(limits, world, frozenset(range(LOCAL)))) for _ in range(nodes)]
    dead: dict[int, dict[int, int]] = {n: {} for n in range(nodes)}  # node -> {local rank: poll it joins}
    times: list[float] = []
    by_poll: dict[int, list[tuple[str, int]]] = {}
    for at, kind, target in faults:
        by_poll.setdefault(at, []).append((kind, target))
    violations = 0
    for poll in range(polls):
        lost_nodes = sorted({t for k, t in by_poll.get(poll, ()) if k == "node_lost"})
        if lost_nodes:  # a host or a rack: every other node learns of it once, and the group restarts
            for n, m in enumerate(machines):
                if n not in lost_nodes:
                    t0 = time.perf_counter()
                    decided = m.feed(NodeLost(f"node(s) {lost_nodes} vanished"))
                    times.append(time.perf_counter() - t0)
                    if any(isinstance(d, Restart) for d in decided):
                        dead[n] = {}
        for kind, target in by_poll.get(poll, ()):
            node, local = divmod(target, LOCAL)
            if kind == "node_lost":
                continue
            if kind == "rank_hung":
                t0 = time.perf_counter()
                machines[node].feed(Hang(f"rank {target} silent"))
                times.append(time.perf_counter() - t0)
                dead[node][local] = -1
            else:
                dead[node][local] = -1
        for n, m in enumerate(machines):
            codes = {r: (-9 if dead[n].get(r, 0) == -1 else None) for r in range(LOCAL)}
            before = m.state
            t0 = time.perf_counter()
            decided = m.feed(Look(codes, spares_ready=1))
            if any(isinstance(d, Collect) for d in decided):
                decided += m.feed(Collected({r: -9 for r, c in codes.items() if c is not None}))
            times.append(time.perf_counter() - t0)
            changes = [d for d in decided if isinstance(d, (Replace, Shrink))]
            if len(changes) > 1 or (changes and before.forming is not None):
                violations += 1
            if any(isinstance(d, KillSurvivors) for d in decided) and before.forming is not None:
                violations += not any(isinstance(d, Fallback) for d in decided)
            for d in changes:
                for r in d.ranks:
                    dead[n][r] = poll + join_polls
            if any(isinstance(d, (Restart, End)) for d in decided):
                dead[n] = {}
            if m.state.forming is not None and all(v <= poll for v in dead[n].values() if v > 0):
                t0 = time.perf_counter()
                m.feed(Joined())
                times.append(time.perf_counter() - t0)
                dead[n] = {r: v for r, v in dead[n].items() if v > poll or v == -1}
    counts: dict[str, int] = {}
    for m in machines:
        for d in m.decided:
            counts[type(d).__name__] = counts.get(type(d).__name__, 0) + 1
    return {
        "times": times,
        "counts": counts,
        "violations": violations,
        "ended": sum(m.state.ended is not None for m in machines),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hours", type=float, default=None, help="simulated hours (default 0.5, smoke 0.05)")
    p.add_argument("--compress", type=float, default=400.0, help="faults this many times denser than Llama 3's")
    p.add_argument("--bursts", type=int, default=2, help="racks of 8 nodes lost at once")
    p.add_argument("--join-polls", type=int, default=2, help="polls until a replacement has joined")
    args = p.parse_args()
    hours = args.hours or (0.05 if args.smoke else 0.5)
    sizes = [64, 512] if args.smoke else [32, 128, 512]
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"membership decisions at scale ({hours:g} simulated hours, faults {args.compress:g}× Llama 3's rate, "
        f"{args.bursts} rack burst(s), seed {args.seed})"
    )
    for col in ("nodes", "ranks", "faults", "decisions", "median µs", "p99 µs", "max µs", "violations", "decided"):
        table.add_column(col, justify="right")
    worst = 0.0
    for nodes in sizes:
        rng = random.Random(args.seed)
        faults = trace(rng, nodes, hours, args.bursts, args.compress)
        r = simulate(nodes, faults, int(hours * 3600), args.join_polls)
        t = sorted(r["times"])
        p99 = t[int(len(t) * 0.99)]
        worst = max(worst, p99)
        decided = ", ".join(f"{k} {v}" for k, v in sorted(r["counts"].items()))
        table.add_row(
            str(nodes),
            str(nodes * LOCAL),
            str(len(faults)),
            str(len(t)),
            f"{statistics.median(t) * 1e6:.1f}",
            f"{p99 * 1e6:.1f}",
            f"{t[-1] * 1e6:.0f}",
            str(r["violations"]),
            decided,
        )
        if r["violations"]:
            print(f"invariant violations at {nodes} nodes (seed {args.seed})", file=sys.stderr)
    Console(width=200).print(table)
    print(f"goal: p99 < 1000 µs per decision, flat in the world size: {'met' if worst < 1e-3 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
