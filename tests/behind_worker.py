"""An example script, unchanged, with one survivor left one step behind its peers, as when a
collective that lost a peer completes on some ranks only (gloo's ring): ``examples/fsdp2.py``, or
the example named by ``TG_BEHIND_EXAMPLE`` (``plain_loop.py``: DDP).

At optimizer step ``TG_BEHIND_STEP`` (after that step's last collective), a global optimizer
pre-hook makes rank 3 SIGKILL itself and rank 0 wait in a broadcast from rank 3. So rank 0 catches
the lost peer inside step N, before its update (which is dropped), while ranks 1 and 2 complete
step N. Each fires once per run (a file in ``TG_BEHIND_DIR``), not again in a replacement.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / os.environ.get("TG_BEHIND_EXAMPLE", "fsdp2.py")
BEHIND = int(os.environ["TG_BEHIND_STEP"])
updates = [0]


def leave_rank_0_behind(optimizer, args, kwargs) -> None:
    updates[0] += 1
    fired = Path(os.environ["TG_BEHIND_DIR"]) / f"fired-rank{dist.get_rank()}"
    if updates[0] != BEHIND or dist.get_rank() not in (0, 3) or fired.exists():
        return
    fired.touch()
    if dist.get_rank() == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.broadcast(torch.zeros(1), src=3)  # fails when rank 3 dies; caught (trainguard.rejoin.catch)


if __name__ == "__main__":
    register_optimizer_step_pre_hook(leave_rank_0_behind)
    sys.path.insert(0, str(EXAMPLE.parent))
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
