"""A rank that waits for the test's word before it trains, run under ``trainguard run`` by
tests/test_attacks.py: the launcher's stores are attacked while it waits, and what it computes
after shows that the launch went on unharmed.

It joins the gloo group, waits until ``GO_FILE`` exists (the test writes it once its attacks
were seen; at most ``LIFETIME`` s), all-reduces ``rank + 1`` three times and rank 0 writes the
sum to ``OUT_FILE`` (two ranks: 12.0).

Usage: ``gate_worker.py GO_FILE OUT_FILE``.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

LIFETIME = 120.0


def main(argv: list[str]) -> int:
    go, out = argv[1], argv[2]
    dist.init_process_group("gloo")
    deadline = time.monotonic() + LIFETIME
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            return 3
        time.sleep(0.05)
    x = torch.tensor([float(dist.get_rank() + 1)])
    for _ in range(3):
        dist.all_reduce(x)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            f.write(repr(x.item()))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
