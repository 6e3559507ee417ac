"""One rank of a generation's process group formed on a ``FileStore`` (one node,
:mod:`trainguard.rejoin.stores`), run by tests/test_private_stores.py: as a survivor does
(``regroup``: :func:`~trainguard.rejoin.regroup.rebuild_default_group` of a generation with a
``path``) or as a replacement's script does (``script``: ``init_process_group("gloo",
init_method="env://")`` changed by :func:`~trainguard.rejoin.stores.init_on_file`, as the
replacement runner changes it). It all-reduces ``rank + 1`` and prints the sum.

Usage: ``file_group_worker.py regroup|script PATH`` with ``RANK`` and ``WORLD_SIZE`` set.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.rejoin.protocol import Generation
from trainguard.rejoin.regroup import rebuild_default_group
from trainguard.rejoin.stores import init_on_file


def main(argv: list[str]) -> int:
    how, path = argv[1], Path(argv[2])
    world = int(os.environ["WORLD_SIZE"])
    if how == "regroup":
        rebuild_default_group(Generation(1, "", 0, (1,), world, path=str(path)), "gloo", 30.0)
    else:
        args, kwargs = init_on_file(path, 30.0, ("gloo",), {"init_method": "env://"})
        dist.init_process_group(*args, **kwargs)
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    print(f"sum {x.item()}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
