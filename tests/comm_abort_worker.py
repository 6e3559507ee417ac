"""One rank of tests/test_nccl_policy.py's abort test: ``python comm_abort_worker.py ROLE OUT STORE KEY PORT``.

ROLE ``survivor`` (rank 0): joins a 2-rank gloo group on ``127.0.0.1:PORT``, trains one DDP step,
starts the abort watcher (:class:`trainguard.rejoin.abort.CommAbort`) on the recovery store
``STORE`` (attempt 1, sealed with the hex ``KEY``), writes ``OUT/blocked`` and all-reduces:
its peer is stopped, so that collective waits until something ends it. Then it writes
``OUT/survivor.json`` (the error, its time, what the abort did), waits for generation 1, aborts
and drops the old world, creates the generation's group eagerly, re-binds DDP, sends the state
and trains one more step with the replacement.

ROLE ``peer`` (rank 1): joins, trains the DDP step, writes ``OUT/ready`` and SIGSTOPs itself
(its connections stay open: the collective does not fail, as an NCCL one on one node does not).

ROLE ``replacement`` (rank 1 of generation 1): joins the generation's group, takes the state
from rank 0 and trains the same step. Both write ``OUT/ROLE.hash``: the parameters' bytes after it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainguard.rejoin import abort, regroup, sever
from trainguard.rejoin.auth import Seal
from trainguard.rejoin.protocol import RecoveryStore, connect, is_peer_failure, parse_address


def model(init_sync: bool = True) -> DDP:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return DDP(net, init_sync=init_sync)


def train_step(net: DDP, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step * 2 + dist.get_rank())
    loss = net(torch.randn(4, 8, generator=g)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def params_hash(net: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()


def main() -> None:
    role, out, address, key, port = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    seal = Seal(bytes.fromhex(key))
    if role == "replacement":
        store = RecoveryStore(connect(*parse_address(address)), 1, seal)
        gen = store.wait(1, 60)
        os.environ.update(RANK="1", WORLD_SIZE="2")
        regroup.rebuild_default_group(gen, "gloo", 60)
        net = model(init_sync=False)  # as trainguard's replacement does: the survivor sends the state below
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        regroup.transfer_state(net, opt, 0, None)
        train_step(net, opt, 1)
        (out / "replacement.hash").write_text(params_hash(net))
        # its work is done: no teardown (gloo's at the interpreter's exit ended once in std::terminate
        # under load, and destroy_process_group once waited past the test's 90 s for the survivor's
        # group, already destroyed)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    rank = 0 if role == "survivor" else 1
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    gathered: list = [None, None]
    dist.all_gather_object(gathered, sever.listening_ports())
    ports = {p for ps in gathered for p in ps}
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    train_step(net, opt, 0)
    if role == "peer":
        (out / "ready").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)
    generation = 0
    watcher = abort.CommAbort(address, 1, seal, lambda: generation, lambda: ports)
    t = torch.ones(4)
    (out / "blocked").write_text(f"{time.time():.6f}")
    t0 = time.perf_counter()
    try:
        dist.all_reduce(t)
        error = None
    except Exception as e:  # noqa: BLE001 - the collective's error is what is measured
        error = e
    ended, waited = time.time(), time.perf_counter() - t0
    said = {
        "ended": ended,
        "waited": waited,
        "error": None if error is None else f"{type(error).__name__}: {str(error)[:200]}",
        "peer_failure": error is not None and is_peer_failure(error),
        "aborted": watcher.aborted(),  # as Rejoin.caught asks it, at once
    }
    store = RecoveryStore(connect(*parse_address(address)), 1, seal)
    gen = store.wait(1, 60)
    generation = gen.number
    regroup.release_ddp(net)
    t1 = time.perf_counter()
    watcher.before_regroup(gen.number)  # after the watcher's abort returned: its record is complete
    said["clear_ms"] = round((time.perf_counter() - t1) * 1000, 3)
    last = watcher.last
    said.update(
        groups=last.groups if last else 0,
        cut=last.cut if last else 0,
        abort_ms=round(last.seconds * 1000, 3) if last else None,
        by=last.by if last else None,
    )
    said["initialized_after_clear"] = dist.is_initialized()
    regroup.rebuild_default_group(gen, "gloo", 60, **abort.init_options("gloo"))  # waits for the replacement
    regroup.rebind_ddp(net)
    regroup.transfer_state(net, opt, 0, None)
    train_step(net, opt, 1)
    watcher.stop()
    (out / "survivor.json").write_text(json.dumps(said))
    (out / "survivor.hash").write_text(params_hash(net))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
