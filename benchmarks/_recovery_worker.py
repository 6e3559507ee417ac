"""Training script of the recovery benchmarks (``hang_detection.py``, ``recovery_compare.py``).

A small 2-layer MLP trained with DDP on gloo, each step padded with a sleep to ``--step-ms``
(default 30 ms), so that the step time is steady and the CPU mostly idle. Three modes:

* ``trainguard``: the loop under ``trainguard.Guard`` (resume, checkpoints, heartbeats);
  faults come from ``trainguard run --inject``;
* ``plain``: the same loop without trainguard, for ``torchrun --max-restarts``: rank 0 saves
  ``torch.save`` checkpoints every ``--ckpt-every`` steps (temp file + rename), every rank resumes
  from the newest one; the fault is injected by the script itself (``--fault``);
* ``ft``: ``plain`` plus one ``RankMonitorClient.send_heartbeat()`` per step, for NVIDIA's
  ``ft_launcher`` (nvidia-resiliency-ext).

In every mode the script writes events to ``RUN_DIR/events.jsonl`` in trainguard's format (rank
0: ``start`` with ``first_step``, ``first_step_done``; every rank: ``worker_timing`` with the
process start, torch import and process-group ready times; ``fault_injected`` in the baseline
modes), so the benchmarks read the same events for the three launchers. ``--pause-rank R
--pause-step S --pause-s T`` makes rank R do T seconds of rank-local work (no collective; under
trainguard inside ``guard.section("eval")``) after step S in every attempt, while its peers wait in
their next collective. It is not a benchmark by
itself: it is started by the launchers.

    python benchmarks/_recovery_worker.py --mode plain --run-dir D [--fault kill --fault-rank 1 --fault-step 40]
"""

from __future__ import annotations

import time

T_PROCESS = time.time()  # as early as possible: process start → this line is interpreter start-up

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

T_TORCH = time.time()

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def _parse() -> tuple[argparse.Namespace, list[str]]:
    """This script's own options, and the rest (``--config``/``--set``: trainguard's, trainguard mode only)."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--mode", choices=["trainguard", "plain", "ft"], required=True)
    p.add_argument(
        "--run-dir", default=None, help="plain/ft: where events.jsonl and checkpoints go (trainguard: the launcher's)"
    )
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-ms", type=float, default=30.0, help="pad every step to this duration with a sleep")
    p.add_argument("--width", type=int, default=64)
    p.add_argument(
        "--ckpt-every", type=int, default=10, help="plain/ft: checkpoint interval (trainguard: checkpoint.interval)"
    )
    p.add_argument("--pg-timeout", type=float, default=1800.0, help="init_process_group timeout (seconds)")
    p.add_argument("--fault", choices=["none", "kill", "sigstop", "collective"], default="none", help="plain/ft only")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=40)
    p.add_argument(
        "--pause-rank",
        type=int,
        default=-1,
        help="this rank pauses --pause-s seconds (no collective) after step --pause-step, every attempt",
    )
    p.add_argument(
        "--guard-api",
        action="store_true",
        help="trainguard mode: forward/backward through guard.run_step and the update through guard.should_step "
        "(what in-process recovery needs to redo an interrupted step)",
    )
    p.add_argument("--pause-step", type=int, default=0)
    p.add_argument(
        "--mark-step", type=int, default=-1, help="trainguard mode: rank 0 emits a 'mark' event after this step"
    )
    p.add_argument("--pause-s", type=float, default=0.0)
    return p.parse_known_args()  # --set/--config are trainguard's


class Events:
    """trainguard's event format (one JSON line, one O_APPEND write), without importing trainguard."""

    def __init__(self, run_dir: Path, rank: int):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.fd = os.open(run_dir / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, kind: str, step=None, /, **details) -> None:
        event = {
            "time": round(time.time(), 6),
            "rank": self.rank,
            "kind": kind,
            "step": step,
            "attempt": self.attempt,
            "pid": os.getpid(),
            "details": details,
        }
        os.write(self.fd, (json.dumps(event, separators=(",", ":")) + "\n").encode())


def _pad(t0: float, step_ms: float) -> None:
    left = step_ms / 1e3 - (time.perf_counter() - t0)
    if left > 0:
        time.sleep(left)


def _pause(ev, step: int, seconds: float) -> None:
    """Rank-local work without a collective (an evaluation, a log upload): the peers wait meanwhile."""
    ev.emit("pause_begin", step, seconds=seconds)
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # short sleeps: a Python signal handler runs between them
        time.sleep(0.01)
    ev.emit("pause_end", step)


def main() -> None:
    args, rest = _parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    t_pg = time.time()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)
    )
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, args.width)
    y = torch.randn(32, 1)

    def train_step() -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    if args.mode == "trainguard":
        t_import = time.time()
        import trainguard

        t_imported = time.time()
        cfg = trainguard.config_from_argv(argv=rest)  # only --config/--set: it refuses this script's own options
        guard = trainguard.Guard(cfg, model=ddp, optimizer=opt)
        ev = guard.events
        ev.emit(
            "worker_timing",
            process=T_PROCESS,
            torch_imported=T_TORCH,
            pg_ready=t_pg,
            trainguard_import=t_import,
            trainguard_imported=t_imported,
            guard_ready=time.time(),
        )
        first = True
        for _ in guard.steps(args.steps):
            t0 = time.perf_counter()
            if args.guard_api:
                opt.zero_grad(set_to_none=True)
                loss = guard.run_step(lambda b: torch.nn.functional.mse_loss(ddp(b[0]), b[1]), (x, y))
                if guard.should_step(loss):
                    opt.step()
            else:
                loss = train_step()
            _pad(t0, args.step_ms)
            guard.step_end(loss=loss)
            if first and rank == 0:
                ev.emit("first_step_done", guard.step)
            if rank == 0 and guard.step == args.mark_step:  # steady-state timing starts here
                ev.emit("mark", guard.step)
            if rank == args.pause_rank and guard.step == args.pause_step:
                with guard.section("eval"):  # a named section: the supervisor gives it its own timeout
                    _pause(ev, guard.step, args.pause_s)
            first = False
        dist.destroy_process_group()
        return

    run_dir = Path(args.run_dir or os.environ.get("TRAINGUARD_RUN_DIR") or "runs/recovery-worker")
    ev = Events(run_dir, rank)
    client = None
    if args.mode == "ft":
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        client = RankMonitorClient()
        client.init_workload_monitoring()
    ev.emit("worker_timing", process=T_PROCESS, torch_imported=T_TORCH, pg_ready=t_pg, guard_ready=time.time())
    ckpt = run_dir / "ckpt.pt"
    step = 0
    t_resume = time.perf_counter()
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = int(state["step"])
        if rank == 0:
            ev.emit("resume", step, from_step=step, seconds=round(time.perf_counter() - t_resume, 4))
    if rank == 0:
        ev.emit("start", step, first_step=step)
    first = True
    while step < args.steps:
        t0 = time.perf_counter()
        train_step()
        _pad(t0, args.step_ms)
        step += 1
        if client is not None:
            client.send_heartbeat()
        if args.fault != "none" and ev.attempt == 0 and rank == args.fault_rank and step == args.fault_step:
            ev.emit(
                "fault_injected",
                step,
                fault="rank_killed" if args.fault == "kill" else "rank_hung",
                rank=rank,
                hang=None if args.fault == "kill" else args.fault,
                injected=True,
            )
            if args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif args.fault == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                while True:
                    time.sleep(3600)
        if rank == 0 and step % args.ckpt_every == 0:
            tmp = ckpt.with_name(f".ckpt.tmp-{os.getpid()}")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
        if first and rank == 0:
            ev.emit("first_step_done", step)
        first = False
        if rank == args.pause_rank and step == args.pause_step:
            _pause(ev, step, args.pause_s)
    if client is not None:
        client.shutdown_workload_monitoring()
    ev.emit("end", step) if rank == 0 else None
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
