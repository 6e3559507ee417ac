"""A whole node lost (its launcher and ranks SIGKILLed): a spare node against the group restart, in
the same run.

For each of ``--models`` (default all three; ``--smoke``: ``ddp`` only):

* ``ddp``: the README's plain loop (``examples/plain_loop.py``), 3000 steps;
* ``fsdp2``: the FSDP2 example (``examples/fsdp2.py``, a small GPT sharded over the 4 ranks),
  400 steps, ``[recovery] snapshot_interval`` 10: the spare node's ranks take the lost shards
  from the snapshot copies the leading node's ranks hold, every rank rolling back to that
  snapshot (goal: at most 10 completed steps trained again);
* ``hsdp``: the same with ``fsdp.replicas=2`` (a replica group per node): the lost shards come
  from the other replica group (goal: no step trained again).

The job runs on two "nodes": two ``trainguard run``
launchers on loopback (``--nnodes 2:3``, c10d rendezvous, ``--nproc-per-node 2``: 4 ranks). Once
uninterrupted for its final state hash, then ``--trials`` times per arm with the launcher of the
node that does not lead (the one that does serves the rendezvous and recovery stores) SIGKILLed
together with its ranks at a random step (20 to 200 steps after the spare node is ready) plus a
random fraction of a step:

* ``spare node``: a third launcher waits as a spare node (``[recovery] spare_nodes``, node timeout
  ``--node-timeout``); its warm spares take the lost ranks in-process;
* ``group restart``: no spare node and ``recovery.in_process=false``; a new launcher is started for
  the lost node at once (the scheduler's replacement node) and the group restarts from the newest
  checkpoint (the baseline; torch's c10d rendezvous waits for the dead node's keep-alive to expire).

* ``torchrun``: the same as the group restart under ``python -m torch.distributed.run --nnodes 2:3
  --max-restarts 3`` (c10d rendezvous, the same endpoint settings), the script's Guard resuming
  from its checkpoints (``run.dir``); ``ddp`` only (``--torchrun``, default on).

For each trial: in-process (no group restart, no fallback), bitwise (final hash equal to the
uninterrupted run's), completed steps trained again, kill → training again (the kill to the last
survivor's ``recovery_finished``, or to the restarted group's first ``start``). Then the state
transfer's bytes/s (its ``state_transferred`` event) against this machine's loopback bandwidth
(one TCP stream, measured here), and the cost of the copy of a step-boundary file into the
recovery store that a node replaceable by a spare pays every step (µs per call, a real file's size).

Run: ``python benchmarks/node_loss.py [--trials 5]``; ``--smoke`` for one short trial per arm.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
from _common import final_hash, kill_outcome, run_events, trainguard_cmd

REPO = Path(__file__).resolve().parents[1]
CONF = "join_timeout=120,last_call_timeout=1"
SMALL_GPT = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32", "train.batch_size=4"]
SMALL_GPT += ["train.log_interval=1", "data.max_bytes=200000", "recovery.snapshot_interval=10"]
# model → (script, the step-count key, default steps, its settings)
MODELS = {
    "ddp": (REPO / "examples" / "plain_loop.py", "worker.max_steps", 3000, []),
    "fsdp2": (REPO / "examples" / "fsdp2.py", "train.max_steps", 400, SMALL_GPT),
    "hsdp": (REPO / "examples" / "fsdp2.py", "train.max_steps", 400, [*SMALL_GPT, "fsdp.replicas=2"]),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(
    run: Path,
    name: str,
    endpoint: str,
    job: str,
    nnodes: str,
    settings: list[str],
    script: Path,
    torchrun: bool = False,
) -> subprocess.Popen:
    sets = [x for s in settings for x in ("--set", s)]
    if torchrun:  # torch's own launcher: the Guard finds its run directory in the config
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "2"]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--rdzv-conf", CONF]
        cmd += ["--max-restarts", "3", str(script), *sets, "--set", f"run.dir={run}"]
        return subprocess.Popen(cmd, stdout=open(f"{run}.{name}.log", "ab"), stderr=subprocess.STDOUT, cwd=REPO)
    cmd = [
        *trainguard_cmd(),
        "run",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        job,
        "--rdzv-conf",
        CONF,
        "--run-dir",
        str(run),
        str(script),
        *sets,
    ]
    return subprocess.Popen(cmd, stdout=open(f"{run}.{name}.log", "ab"), stderr=subprocess.STDOUT, cwd=REPO)


def _printed_step(run: Path) -> int:
    steps = [0]
    for log in run.parent.glob(f"{run.name}.*.log"):
        lines = log.read_text(errors="replace").splitlines()
        steps += [int(x.split()[1].split("/")[0]) for x in lines if x.startswith("step ")]
    return max(steps)


def _kill_tree(proc: subprocess.Popen) -> None:
    with contextlib.suppress(psutil.Error):
        proc_ = psutil.Process(proc.pid)
        proc_.suspend()
        for child in proc_.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    proc.kill()
    proc.wait()


def _leads(pid: int, port: int) -> bool:
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _settings(model: str, steps: int) -> tuple[Path, list[str]]:
    """``model``'s script and its settings for ``steps`` steps (one checkpoint every 50)."""
    script, key, _, own = MODELS[model]
    return script, [f"{key}={steps}", "checkpoint.interval=50", "launcher.spares=0", *own]


def trial(run: Path, model: str, steps: int, arm: str, seed: int, node_timeout: float) -> dict:
    """One launch that loses a node at a seeded random moment; its measurements."""
    rng = random.Random(seed)
    port = _free_port()
    endpoint, job = f"127.0.0.1:{port}", uuid.uuid4().hex[:8]
    script, settings = _settings(model, steps)
    settings += (
        ["recovery.in_process=true", f"recovery.node_timeout={node_timeout}"]
        if arm == "spare node"
        else ["recovery.in_process=false"]
    )
    torchrun = arm == "torchrun"
    agents = [_agent(run, f"node{n}", endpoint, job, "2:3", settings, script, torchrun) for n in range(2)]
    try:
        started, need = ("start", 1) if torchrun else ("workers_started", 2)  # torchrun: the Guard's own event
        _wait(lambda: sum(e["kind"] == started for e in run_events(run)) >= need, 300, "both nodes started")
        if arm == "spare node":
            agents.append(_agent(run, "spare", endpoint, job, "2:3", settings, script))
            _wait(lambda: any(e["kind"] == "spare_node_waiting" for e in run_events(run)), 300, "a spare node is ready")
        kill_step = _printed_step(run) + rng.randint(20, 200)  # a random step once the spare node is hot
        if kill_step >= steps:
            raise RuntimeError(
                f"the run reached step {kill_step - 20} before the spare node was ready: use more --steps"
            )
        _wait(lambda: _printed_step(run) >= kill_step, 300, f"step {kill_step}")
        time.sleep(rng.random() * 0.02)
        leader = next(i for i in range(2) if _leads(agents[i].pid, port))
        printed, killed_at = _printed_step(run), time.time()
        _kill_tree(agents[1 - leader])
        if arm != "spare node":  # the scheduler's replacement for the lost node
            agents.append(_agent(run, "renode", endpoint, job, "2:3", settings, script, torchrun))
        codes = [agents[i].wait(timeout=600) for i in range(len(agents)) if i != 1 - leader]
    finally:
        for a in agents:
            if a.poll() is None:
                _kill_tree(a)
    ev = run_events(run)
    in_process, again, redone = kill_outcome(ev, killed_at, printed, last=True)
    moved = [e["details"] for e in ev if e["kind"] == "state_transferred"]
    moved += [  # a sharded model's rollback: the copies its replacements received
        {"bytes": e["details"]["bytes"], "seconds": float("nan")}
        for e in ev
        if e["kind"] == "snapshot_restored" and e["details"]["from_step"] is None
    ]
    rate = moved[0]["bytes"] / moved[0]["seconds"] if moved and moved[0]["seconds"] > 0 else float("nan")
    return {
        "codes": codes,
        "in_process": in_process,
        "hash": final_hash(run) or _ended_hash(ev),
        "again": again,
        "redone": redone,
        "rate": rate,
        "moved": moved[0]["bytes"] if moved else 0,
    }


def _ended_hash(events: list[dict]) -> str | None:
    """The state hash of the run's last ``end`` event (under torchrun no launcher writes ``launch_exit``)."""
    ends = [e for e in events if e["kind"] == "end"]
    return ends[-1]["details"].get("state_sha256") if ends else None


def loopback_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s of one TCP stream over loopback (a thread sends ``nbytes``, this one reads them)."""
    server = socket.create_server(("127.0.0.1", 0))
    chunk = b"\0" * (1 << 20)

    def send() -> None:
        with socket.create_connection(server.getsockname()) as c:
            for _ in range(nbytes // len(chunk)):
                c.sendall(chunk)

    threading.Thread(target=send, daemon=True).start()
    conn, _ = server.accept()
    got, t0 = 0, time.perf_counter()
    while got < nbytes:
        got += len(conn.recv(1 << 20))
    return got / (time.perf_counter() - t0)


def mirror_cost(size: int, calls: int = 2000) -> float:
    """µs per copy of a ``size``-byte step-boundary slot into a recovery store on loopback (the
    per-step cost of a node a spare node may replace)."""
    sys.path.insert(0, str(REPO / "src"))
    from trainguard.rejoin.auth import Seal
    from trainguard.rejoin.protocol import RecoveryStore, connect, serve

    server = serve()
    store = RecoveryStore(connect("127.0.0.1", server.port), 1, Seal(b"k" * 32))
    data = bytes(size)
    for _ in range(50):
        store.mirror_boundary(0, 0, data)
    t0 = time.perf_counter()
    for i in range(calls):
        store.mirror_boundary(0, i % 2, data)
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=5, help="node losses per arm")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: ddp 3000, fsdp2 and hsdp 400)")
    p.add_argument("--models", default="ddp,fsdp2,hsdp", help="comma-separated: ddp, fsdp2, hsdp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--node-timeout", type=float, default=1.0, help="[recovery] node_timeout of the spare-node arm")
    p.add_argument("--smoke", action="store_true", help="ddp only, one trial per arm, 1000 steps, no torchrun arm")
    p.add_argument("--no-torchrun", dest="torchrun", action="store_false", help="leave out the ddp torchrun arm")
    args = p.parse_args()
    models = ["ddp"] if args.smoke else args.models.split(",")
    if args.smoke:
        args.trials, args.steps = 1, 1000
    base = Path(tempfile.mkdtemp(prefix="node-loss-"))
    failed = False
    for model in models:
        steps = args.steps or MODELS[model][2]
        clean = base / f"{model}-clean"
        port = _free_port()
        script, settings = _settings(model, steps)
        pair = [_agent(clean, f"node{n}", f"127.0.0.1:{port}", "clean", "2", settings, script) for n in range(2)]
        if [a.wait(timeout=900) for a in pair] != [0, 0]:
            print(f"the uninterrupted run failed: {clean}.*.log", file=sys.stderr)
            return 1
        want = final_hash(clean)
        rows = []
        arms = ["spare node", "group restart"] + (
            ["torchrun"] if model == "ddp" and args.torchrun and not args.smoke else []
        )
        for arm in arms:
            results = [
                trial(
                    base / f"{model}-{arm.replace(' ', '-')}-{i}",
                    model,
                    steps,
                    arm,
                    args.seed * 1000 + i,
                    args.node_timeout,
                )
                for i in range(args.trials)
            ]
            rows.append((arm, results))
        # torchrun is a baseline: its job failing to recover is a result (shown), not a broken benchmark
        failed |= any(c != 0 for arm, rs in rows if arm != "torchrun" for r in rs for c in r["codes"])
        _table(model, MODELS[model][0], steps, rows, want)
    loop = loopback_bandwidth()
    print(f"\nloopback: one TCP stream {loop / 1e6:.0f} MB/s (the limit of a peer transfer)")
    boundary_bytes = 25_000
    print(
        f"boundary copy per step: {mirror_cost(boundary_bytes):.0f} µs for a {boundary_bytes}-byte slot into the recovery store "
        f"on loopback (paid on the nodes a spare node may replace)"
    )
    print(
        "goal (spare node): every trial in-process and bitwise; ddp: kill → training again ≤ 2 s; "
        f"fsdp2: at most 10 completed steps redone; hsdp: none; runs in {base}"
    )
    return 1 if failed else 0


def _table(model: str, script: Path, steps: int, rows: list, want: str | None) -> None:
    """One model's table: each arm's trials, and the spare node's state transfer."""
    base_again = statistics.median(r["again"] for r in rows[1][1])
    print(
        f"\n{model}: {script.relative_to(REPO)}, 2 nodes × 2 ranks on loopback, {steps} steps, "
        "the non-leading node's launcher SIGKILLed with its ranks at a random moment"
    )
    print(
        "| arm | trials | in-process | bitwise | completed steps redone (median, max) | kill → training again (median s) | vs restart |"
    )
    print("|---|---|---|---|---|---|---|")
    for arm, results in rows:
        n = len(results)
        times = [r["again"] for r in results if r["again"] == r["again"]]  # NaN: it never trained again
        again = statistics.median(times) if times else float("nan")
        redone = [r["redone"] for r in results]
        never = f" ({n - len(times)} never: the job failed)" if len(times) < n else ""
        cells = f"{again:.2f}{never} | {again / base_again:.3f}×" if times else f"never{never} | —"
        print(
            f"| {arm} | {n} | {sum(r['in_process'] for r in results)}/{n} | {sum(r['hash'] == want for r in results)}/{n} "
            f"| {statistics.median(redone):g}, {max(redone)} | {cells} |"
        )
    rates = [r["rate"] for r in rows[0][1] if r["rate"] == r["rate"]]
    moved = rows[0][1][0]["moved"]
    if rates:
        print(f"state transfer: {moved} bytes at {statistics.median(rates) / 1e6:.1f} MB/s")
    elif moved:
        print(f"state transfer: {moved} bytes per lost rank (snapshot copies, sent while training)")


if __name__ == "__main__":
    sys.exit(main())
