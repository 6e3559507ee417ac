"""One node's in-process recovery stores are files (issue 54 item 2, :mod:`trainguard.rejoin.stores`):
what torch's ``FileStore`` does that the recovery protocol relies on, checked on the installed
torch, and the protocol and a generation's process group over it, between real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from trainguard.rejoin.auth import PROBE, Seal, read_now
from trainguard.rejoin.protocol import Generation, RecoveryStore
from trainguard.rejoin.stores import (
    file_address,
    file_path,
    file_store,
    group_store_path,
    init_on_file,
    open_store,
)

HERE = Path(__file__).resolve().parent
SEAL = Seal(bytes(range(32)), b"n" * 16)


def test_file_store_does_what_the_recovery_protocol_uses(tmp_path):
    """Every operation the protocol and torch's groups use works on the installed torch's
    ``FileStore``; a read (``read_now``'s probe) does not grow the file; a timeout is rounded up
    to whole seconds; a missing directory is refused at once (torch's constructor would wait
    300 s for it); with ``numWorkers=-1`` the file outlives its clients (the launcher removes it)."""
    path = tmp_path / "s"
    a, b = file_store(path, 5.0), file_store(path, 5.0)
    a.set("k", b"v")
    size = path.stat().st_size
    assert read_now(b, "k") == b"v" and read_now(b, "absent") is None
    assert b.compare_set("absent", PROBE, PROBE) == PROBE.encode()
    assert path.stat().st_size == size  # reads append nothing
    assert a.add("n", 2) == 2 and b.add("n", 0) == 2
    assert b.check(["k", "n"]) and not b.check(["absent"])
    assert b.multi_get(["k"]) == [b"v"]
    keys = b.num_keys()  # torch counts a key of its own too
    a.multi_set(["x", "y"], [b"1", b"2"])
    assert b.num_keys() == keys + 2
    assert b.delete_key("x") and not a.check(["x"])
    assert b.compare_set("k", "v", "w") == b"w" and a.get("k") == b"w"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="[Tt]imeout"):
        a.wait(["never"], timedelta(seconds=0.3))
    assert 0.3 <= time.monotonic() - t0 < 2.5  # torch counts whole seconds: ~1 s
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        file_store(tmp_path / "gone" / "s", 5.0)
    assert time.monotonic() - t0 < 1
    del a, b
    assert path.exists()


def test_addresses_name_a_file_or_a_tcp_store(tmp_path):
    address = file_address(tmp_path / "recovery")
    assert address == f"file://{tmp_path.resolve()}/recovery"
    assert file_path(address) == tmp_path.resolve() / "recovery" and file_path("node7:29500") is None
    with pytest.raises(ValueError, match="ABSOLUTE"):
        file_path("file://relative/x")
    assert group_store_path(address, 2, 3) == tmp_path.resolve() / "group-2-3"
    assert group_store_path("node7:29500", 2, 3) is None and group_store_path(None, 2, 3) is None
    gen = Generation(3, "127.0.0.1", 0, (1,), 2, path=str(group_store_path(address, 2, 3)))
    assert Generation.from_json(gen.to_json()) == gen
    args, kwargs = init_on_file(tmp_path / "g", 7.0, ("gloo", "env://"), {"rank": 1, "world_size": 2})
    assert args == ("gloo",) and "init_method" not in kwargs and (kwargs["rank"], kwargs["world_size"]) == (1, 2)
    assert isinstance(kwargs["store"], dist.FileStore) and kwargs["store"].timeout == timedelta(seconds=7)


def test_the_recovery_protocol_runs_between_processes_over_a_file_store(tmp_path):
    """The launcher publishes a generation in its file store; a rank, another process, waits for
    it, says it joined and stepped; the launcher sees both, and its polls of the step counter
    append nothing to the file. A value another process writes without the seal is refused there
    as over a TCPStore."""
    address = file_address(tmp_path / "recovery")
    told: list[str] = []
    launcher = RecoveryStore(open_store(address, 10.0), 1, SEAL, told.append)
    rank = subprocess.Popen(
        [sys.executable, str(HERE / "recovery_store_client.py"), address, SEAL.key.hex(), SEAL.nonce.hex()],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        raw = file_store(tmp_path / "recovery", 10.0)
        raw.set("attempt1/declined", b"forged")  # another writer without the seal
        assert launcher.declined() is None and told == ["attempt1/declined"]
        gen = Generation(1, "127.0.0.1", 0, (1,), 2, path=str(group_store_path(address, 1, 1)))
        launcher.publish(gen)
        assert rank.stdout.readline().strip() == f"generation {gen.to_json()}"
        assert rank.stdout.readline().strip() == "done"
        assert launcher.all_joined(gen) and launcher.steps_after(1) == 1
        size = (tmp_path / "recovery").stat().st_size
        assert launcher.steps_after(1) == 1 and launcher.steps_after(2) == 0
        assert (tmp_path / "recovery").stat().st_size == size  # the launcher's polls append nothing
        raw.set("attempt1/gen/2/stepped", b"x")  # counters are not sealed: another writer's reads as 0
        assert launcher.steps_after(2) == 0
    finally:
        assert rank.wait(timeout=60) == 0


@pytest.mark.parametrize("other", ["regroup", "script"])
def test_a_generations_group_forms_on_its_file_store(tmp_path, other):
    """A survivor (:func:`~trainguard.rejoin.regroup.rebuild_default_group`) and a replacement
    whose script calls ``init_process_group(init_method="env://")`` (changed by the runner) meet
    on the generation's file and all-reduce; no ``MASTER_ADDR``/``MASTER_PORT`` is read."""
    path = tmp_path / "group-1-1"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "file_group_worker.py"), how, str(path)],
            env={**env, "RANK": str(rank), "WORLD_SIZE": "2"},
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank, how in enumerate(["regroup", other])
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert all("sum 3.0" in out for out in outs), outs
