"""One rank of a checkpoint save that loses a peer inside DCP (tests/test_checkpoint_crash.py).

    python save_kill_worker.py RANK WORLD_SIZE INIT_FILE CKPT_DIR OUT_DIR VICTIM

Rank ``VICTIM`` SIGKILLs itself inside DCP's planning, before its plan is gathered: the
coordinator's gather fails, the others wait for the plan it scatters. Every other rank writes ``OUT_DIR/rank-R.json``: the error
``write_checkpoint`` raised (its type, whether it is a lost peer, the line of
``trainguard/checkpoint/io.py`` it left from), then exits at once, which closes
its connections as a process that leaves its collectives does."""

import json
import os
import signal
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from trainguard.checkpoint.io import write_checkpoint
from trainguard.checkpoint.store import CheckpointStore
from trainguard.rejoin.protocol import is_peer_failure

rank, world, init, ckpt, out, victim = sys.argv[1:7]
rank, world, victim = int(rank), int(world), int(victim)
# the collective timeout is far beyond the test's wait: a rank blocked on the dead one fails the test
dist.init_process_group(
    "gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
)
if rank == victim:
    FileSystemWriter.prepare_local_plan = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
state = {"model": {"w": torch.full((1000,), float(rank))}}
try:
    write_checkpoint(CheckpointStore(ckpt), 10, state, {"step": 10})
    said = {"error": None, "peer_lost": False}
except BaseException as e:  # noqa: BLE001 - what it raises is the point
    where = [f.line for f in traceback.extract_tb(e.__traceback__) if f.filename.endswith("checkpoint/io.py")]
    said = {"error": f"{type(e).__name__}: {e}"[:300], "peer_lost": is_peer_failure(e), "raised_at": where[-1]}
Path(out, f"rank-{rank}.json").write_text(json.dumps(said))
os._exit(0)
