"""trainguard's own object collectives (trainguard.dist) carry no pickle between ranks: values,
containers and CPU tensors travel as step-boundary blobs; a pickle that names a callable, sent by
a peer that is not trainguard, is refused on the receiving rank and never run (issue 46)."""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path

import torch

MARKER = "pwned"


class Evil:
    """What a hostile peer sends: unpickling it would make a directory."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _worker(local_rank: int, tmp: str, out) -> None:
    import torch.distributed as dist

    from trainguard import dist as tgdist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=local_rank, world_size=2)
    result: dict = {}
    try:
        from trainguard.checkpoint.store import Checkpoint

        rich = {
            "step": 7,
            (1, 2): [None, 1.5, "x"],
            3: {"rng": torch.arange(4, dtype=torch.int64), "on": torch.tensor([True, False])},
            "found": Checkpoint(70, Path(tmp) / "step-70"),
        }
        got = tgdist.broadcast_object(rich if local_rank == 0 else None, src=0)
        rng = (got[3]["rng"].tolist(), got[3]["on"].tolist())
        result["broadcast"] = (got["step"], got[(1, 2)], rng, got["found"] == rich["found"], got is rich)
        result["gathered"] = tgdist.gather_objects((local_rank, f"host{local_rank}", torch.ones(local_rank + 1)))
        result["gathered"] = [(r, h, t.tolist()) for r, h, t in result["gathered"]]
        # rank 1 plays a hostile peer: the same wire format (length, then bytes), a pickle inside
        if local_rank == 1:
            data = b"P" + pickle.dumps(Evil(os.path.join(tmp, MARKER)))
            dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=1)
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=1)
        else:
            try:
                tgdist.broadcast_object(None, src=1)
                result["evil"] = "accepted"
            except pickle.UnpicklingError as e:
                result["evil"] = f"refused: {e}"
        dist.barrier()
        result["marker"] = os.path.exists(os.path.join(tmp, MARKER))
    finally:
        dist.destroy_process_group()
    out.put((local_rank, result))
    out.close()
    out.join_thread()  # the result is sent before the process leaves
    os._exit(
        0
    )  # without torch's teardown, which aborts an exit now and then ("terminate called without an active exception")


def test_object_collectives_carry_values_and_tensors_and_refuse_a_peers_pickle():
    import torch.multiprocessing as mp

    out = mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as tmp:
        workers = mp.start_processes(_worker, args=(tmp, out), nprocs=2, start_method="spawn", join=False)
        results = dict(out.get(timeout=120) for _ in range(2))
        while not workers.join():
            pass
        assert not Path(tmp, MARKER).exists()
    sent = (7, [None, 1.5, "x"], ([0, 1, 2, 3], [True, False]), True)
    assert results[0]["broadcast"] == (*sent, True)  # the sender keeps its very object
    assert results[1]["broadcast"] == (*sent, False)
    expected = [(0, "host0", [1.0]), (1, "host1", [1.0, 1.0])]
    assert results[0]["gathered"] == results[1]["gathered"] == expected
    assert results[0]["evil"] == "refused: an object sent between ranks may not name posix.mkdir", results[0]
    assert results[0]["marker"] is False and results[1]["marker"] is False
