"""trainguard's own object collectives (trainguard.dist) carry no pickle between ranks: values,
containers and CPU tensors travel as step-boundary blobs; a pickle that names a callable, sent by
a peer that is not trainguard, is refused on the receiving rank and never run (issue 46)."""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path

import pytest
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
        # rank 1 announces a length no object has (a peer that would make rank 0 allocate it)
        if local_rank == 1:
            dist.broadcast(torch.tensor([-5], dtype=torch.int64), src=1)
        else:
            try:
                tgdist.broadcast_object(None, src=1)
                result["length"] = "accepted"
            except tgdist.PeerValueError as e:
                result["length"] = f"refused: {e}"
            except Exception as e:  # noqa: BLE001 (what the rank met without the cap)
                result["length"] = f"{type(e).__name__}: {e}"
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
    assert results[0]["length"].startswith("refused: a peer announced an object of -5 bytes"), results[0]


# ---- what a peer may send: named dataclasses, fields by type, private checkpoint paths ----------


def _sent_dataclass(name: str, fields: dict) -> bytes:
    """The bytes a peer sends to have ``name`` built with ``fields`` (as the unpickler reads them)."""
    from trainguard import dist as tgdist

    class Sent:  # a path as the sender's pickler writes it
        def __init__(self, path):
            self.path = path

        def __reduce__(self):
            return tgdist._path, (str(self.path),)

    class Forged:
        def __reduce__(self):
            return tgdist._dataclass, (name, {k: Sent(v) if isinstance(v, Path) else v for k, v in fields.items()})

    return b"P" + pickle.dumps(Forged(), protocol=5)


CKPT = "trainguard.checkpoint.store:Checkpoint"


def test_a_listed_dataclass_crosses_and_another_is_refused_on_both_sides(tmp_path):
    from trainguard import dist as tgdist
    from trainguard.checkpoint.store import Checkpoint
    from trainguard.launcher.node_join import NodeRecord

    tmp_path.chmod(0o700)
    ckpt = Checkpoint(7, tmp_path / "step-7")
    assert tgdist.decode(tgdist.encode({"found": ckpt})) == {"found": ckpt}
    with pytest.raises(TypeError, match="CROSSING"):
        tgdist.encode(NodeRecord(True, 2, "h", False, "00"))  # not a dataclass that crosses ranks
    forged = _sent_dataclass("trainguard.launcher.node_join:NodeRecord", {"running": True})
    with pytest.raises(tgdist.PeerValueError, match="not one of the dataclasses"):
        tgdist.decode(forged)


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"step": "7", "path": Path("/x")}, "step: expected int, got str"),
        ({"step": True, "path": Path("/x")}, "step: expected int, got bool"),
        ({"step": 7, "path": "/x"}, "path: expected Path, got str"),
        ({"step": 7, "path": Path("/x"), "extra": 1}, "expected the fields"),
        ({"step": 7}, "expected the fields"),
        ({"step": 7, "path": Path("../x")}, "absolute and without"),
    ],
)
def test_a_peers_checkpoint_with_other_fields_or_types_is_refused(fields, why):
    from trainguard import dist as tgdist

    with pytest.raises(tgdist.PeerValueError, match=why):
        tgdist.decode(_sent_dataclass(CKPT, fields))


@pytest.mark.parametrize("how", ["another user's", "world-writable", "a symbolic link", "a planted file"])
def test_a_peers_checkpoint_that_could_be_another_users_is_refused_before_it_is_read(tmp_path, how):
    """Issue 54: rank 0's resume point decoded by another rank reached ``check_compatible``, whose
    DCP ``pickle.load`` of the directory's ``.metadata`` ran a planted pickle. Now a checkpoint
    directory from a peer is checked as a local one is (owner, mode, no link) while decoding."""
    from trainguard import dist as tgdist

    tmp_path.chmod(0o700)
    step = tmp_path / "step-7"
    step.mkdir(mode=0o700)
    (step / ".metadata").write_bytes(b"planted")
    os.chmod(step / ".metadata", 0o600)
    target = step
    if how == "another user's":
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(step, 65534, 65534)
    elif how == "world-writable":
        step.chmod(0o777)
    elif how == "a symbolic link":
        target = tmp_path / "step-8"
        target.symlink_to(step)
    else:
        os.chmod(step / ".metadata", 0o666)
    with pytest.raises(tgdist.PeerValueError, match="not private"):
        tgdist.decode(_sent_dataclass(CKPT, {"step": 7, "path": target}))
