"""The recovery store trusts nothing unauthenticated (rejoin/auth.py, rejoin/protocol.py): sealed
values, a private key file, stores that listen on the launcher's address only, no environment
copied to a spare, no pickle in the state transfer. The end-to-end refusal of forged values by a
running launch is in tests/test_any_loop.py."""

from __future__ import annotations

import json
import os
import stat
import threading

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainguard.launch_env import RECOVERY_KEY, LaunchEnv, assignment
from trainguard.rejoin.auth import KEY_FILE, KeyFileError, Seal, launch_key
from trainguard.rejoin.boundary import decode, encode
from trainguard.rejoin.protocol import (
    Generation,
    RecoveryStore,
    assign_spare,
    connect,
    serve,
    spare_ready,
    wait_for_assignment,
)
from trainguard.rundir import prepare_run_dir
from trainguard.supervisor.peers import BusyPeers

SEAL = Seal(bytes(range(32)))


def test_a_sealed_value_opens_only_under_its_own_key_name_and_secret():
    blob = SEAL.seal("attempt1/gen/1", '{"number": 1}')
    assert SEAL.open("attempt1/gen/1", blob) == b'{"number": 1}'
    assert SEAL.open("attempt2/gen/1", blob) is None  # replayed into another group start
    assert SEAL.open("attempt1/gen/2", blob) is None  # or under another key
    assert Seal(bytes(32)).open("attempt1/gen/1", blob) is None  # another launch's secret
    assert SEAL.open("attempt1/gen/1", b'{"number": 1}') is None  # not sealed at all
    tampered = blob[:-2] + b"9}"
    assert SEAL.open("attempt1/gen/1", tampered) is None
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Seal(b"short")


def test_the_launch_key_is_made_once_private_and_shared_by_every_launcher_of_the_run(tmp_path):
    key = launch_key(tmp_path)
    path = tmp_path / KEY_FILE
    assert len(key) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert launch_key(tmp_path) == key  # a second launcher (another node) reads the same key
    assert not [p for p in tmp_path.iterdir() if p.name != KEY_FILE]  # no temporary file left
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match="readable by its owner only"):
        launch_key(tmp_path)
    path.chmod(0o600)
    path.write_text("not hex")
    with pytest.raises(KeyFileError, match="expected 32 bytes as hex"):
        launch_key(tmp_path)


def test_the_run_directory_is_private(tmp_path):
    run = tmp_path / "run"
    prepare_run_dir(run)
    assert stat.S_IMODE(run.stat().st_mode) == 0o700


def test_forged_values_are_refused_told_once_and_the_real_ones_still_read():
    server = serve()
    told: list[str] = []
    launcher = RecoveryStore(server, 1, SEAL)
    rank = RecoveryStore(connect("127.0.0.1", server.port), 1, SEAL, told.append)
    gen = Generation(1, "127.0.0.1", 4242, (1,), 2)
    attacker = connect("127.0.0.1", server.port)
    forged = Generation(1, "10.6.6.6", 6666, (0, 1), 2)
    attacker.set("attempt1/gen/1", forged.to_json())  # unsealed
    attacker.set("attempt1/gen/1/joined/1", Seal(bytes(32)).seal("attempt1/gen/1/joined/1", "1"))  # wrong secret
    assert rank.peek(1) is None and told == ["attempt1/gen/1"]
    assert not launcher.all_joined(gen)
    assert rank.wait(1, timeout=0.3) is None and told == ["attempt1/gen/1"]  # told once per value
    threading.Timer(0.3, lambda: launcher.publish(gen)).start()  # the launcher's value overwrites it
    assert rank.wait(1, timeout=10) == gen
    attacker.set("attempt1/declined", "in-process recovery off")
    assert launcher.declined() is None


def test_a_spare_refuses_a_forged_assignment_and_gets_only_its_ranks_variables():
    server = serve()
    told: list[str] = []
    spare = connect("127.0.0.1", server.port)
    result: list[dict] = []
    thread = threading.Thread(target=lambda: result.append(wait_for_assignment(spare, 3, SEAL, told.append)))
    thread.start()
    while not spare_ready(server, 3, SEAL):
        threading.Event().wait(0.01)
    connect("127.0.0.1", server.port).set("spares/3", json.dumps({"RANK": "0", "MASTER_ADDR": "10.6.6.6"}))
    while not told:
        threading.Event().wait(0.01)
    worker = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "TORCHELASTIC_ERROR_FILE": "/tmp/e/1/error.json",
        "TRAINGUARD_JOIN": "2",
        "AWS_SECRET_ACCESS_KEY": "hunter2",
        "HOME": "/root",
        RECOVERY_KEY: SEAL.key.hex(),
    }
    assign_spare(server, 3, worker, SEAL)
    thread.join(30)
    assert told == ["spares/3"]
    assert result == [
        {
            "RANK": "1",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "127.0.0.1",
            "TORCHELASTIC_ERROR_FILE": "/tmp/e/1/error.json",
            "TRAINGUARD_JOIN": "2",
        }
    ]
    assert assignment(worker) == result[0]
    assert b"hunter2" not in server.get("spares/3") and SEAL.key.hex().encode() not in server.get("spares/3")


def test_a_store_listens_on_the_launchers_address_only():
    store = serve("127.0.0.1")
    listening = [
        c.laddr
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port
    ]
    assert listening and all(a.ip == "127.0.0.1" for a in listening), listening
    assert connect("127.0.0.1", store.port).check(["nothing"]) is False


def test_the_launch_key_travels_in_the_environment_never_in_repr():
    env = LaunchEnv(recovery_key=SEAL.key)
    assert LaunchEnv.from_environ(env.to_environ()).recovery_key == SEAL.key
    assert SEAL.key.hex() not in repr(env)


def test_the_state_transfer_blob_refuses_classes():
    """What a rank receives in a state transfer is a boundary blob: values and raw tensors come
    back; a pickle that names a callable is refused, not run."""
    import pickle

    assert decode(encode({"step": 3, "layout": [[0, 1]], "hosts": ["n0"]})) == {
        "step": 3,
        "layout": [[0, 1]],
        "hosts": ["n0"],
    }
    evil = b"P" + pickle.dumps(os.system)
    with pytest.raises(pickle.UnpicklingError, match="only built-in values"):
        decode(evil)


def test_a_node_hears_of_another_nodes_slow_rank_only_if_recent_sealed_and_not_its_own():
    """The hang supervisors' word across nodes (trainguard.supervisor.peers): node 0 says a rank of
    its is slow, not hung; node 1 hears it while it is recent, node 0 does not hear itself, and a
    forged word (no seal) is not heard."""
    server = serve()
    node0 = RecoveryStore(server, 1, SEAL)
    node1 = RecoveryStore(connect("127.0.0.1", server.port), 1, SEAL)
    assert node1.busy_elsewhere(1, 2, since=0.0) is None
    node0.busy(0, at=100.0)
    assert node1.busy_elsewhere(1, 2, since=99.0) == 0
    assert node1.busy_elsewhere(1, 2, since=101.0) is None  # stale: the slow rank went on
    assert node0.busy_elsewhere(0, 2, since=0.0) is None
    server.set("attempt1/busy/1", b"1e12")  # forged: written without the launch's secret
    assert node0.busy_elsewhere(0, 2, since=0.0) is None
    peers = BusyPeers(node0, 0, 2)
    peers.tell()  # now: node 1 hears it within BUSY_FRESH
    assert BusyPeers(node1, 1, 2).busy_node() == 0


def test_a_forged_or_replayed_join_offer_is_refused_and_the_hosts_is_taken():
    """Two nodes on loopback trade their records in a rendezvous round's store (torch's: anyone who
    reaches it writes its keys). A co-tenant leaves the joining node a join offer that points its
    workers at its own store: unsealed, then one sealed with the launch's key for another round (a
    replay). Both are refused (told with the key; the joining node waits on) and the host's offer,
    sealed for this round, is taken."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    from trainguard.launcher import node_join

    rdzv = serve()
    host_view, joining_view, attacker = (dist.PrefixStore("round7", connect("127.0.0.1", rdzv.port)) for _ in range(3))
    gen = Generation(1, "127.0.0.1", 4242, (1,), 2, grown=(1,))
    real = node_join.NodeJoin("127.0.0.1:5555", 1, gen, (1,), "ab" * 16)
    evil = node_join.NodeJoin("10.6.6.6:6666", 1, Generation(1, "10.6.6.6", 6666, (1,), 2, grown=(1,)), (1,), "")
    told: list[tuple[str, str]] = []
    with ThreadPoolExecutor(2) as pool:
        host = pool.submit(node_join.announce, host_view, 0, 2, True, 0, SEAL)
        mine = pool.submit(node_join.announce, joining_view, 1, 2, False, 1, SEAL)
        records, joining_records = host.result(timeout=60), mine.result(timeout=60)
        assert records == joining_records and records[0].running
        key = node_join.JOIN_KEY.format(1)
        attacker.set(key, evil.to_json())  # unsealed
        offer = pool.submit(
            node_join.read_offer, joining_view, 1, joining_records, SEAL, lambda k, w: told.append((k, w))
        )
        while len(told) < 1:
            threading.Event().wait(0.01)
        old_round = [node_join.NodeRecord(True, 0, challenge="00" * 16), joining_records[1]]
        node_join.offer(attacker, 1, evil, old_round, SEAL)  # sealed with the key, for another round
        while len(told) < 2:
            threading.Event().wait(0.01)
        assert not offer.done()
        node_join.offer(host_view, 1, real, records, SEAL)
        assert offer.result(timeout=30) == real
    assert told == [(key, "forged"), (key, "forged")]


def test_node_records_in_the_rendezvous_store_are_sealed():
    """A node's record (whether its group runs, how many workers) is sealed: a forged one saying
    'my group runs' is refused, told, and the real one is read once it is written."""
    import torch.distributed as dist

    from trainguard.launcher import node_join

    rdzv = serve()
    view = dist.PrefixStore("round3", connect("127.0.0.1", rdzv.port))
    told: list[tuple[str, str]] = []
    view.set(node_join.NODE_KEY.format(1), json.dumps({"running": True, "nproc": 64, "host": "evil"}))
    result: list = []
    thread = threading.Thread(
        target=lambda: result.append(
            node_join.announce(view, 0, 2, False, 1, SEAL, on_forged=lambda k, w: told.append((k, w)))
        )
    )
    thread.start()
    while not told:
        threading.Event().wait(0.01)
    other = dist.PrefixStore("round3", connect("127.0.0.1", rdzv.port))
    mine = node_join.NodeRecord(False, 2, "n1", False, "cd" * 16)
    other.set(node_join.NODE_KEY.format(1), SEAL.seal(node_join.NODE_KEY.format(1), json.dumps(mine.__dict__)))
    thread.join(30)
    assert told == [(node_join.NODE_KEY.format(1), "forged")]
    assert result[0][1] == mine and not result[0][0].running


def test_a_forged_ready_of_a_spare_is_not_taken_and_is_told():
    """The launcher's read of a spare's ready word refuses (and tells of) one without the seal."""
    server = serve()
    told: list[str] = []
    connect("127.0.0.1", server.port).set("spares/4/ready", b"1")
    assert not spare_ready(server, 4, SEAL, told.append) and told == ["spares/4/ready"]
    server.set("spares/4/ready", SEAL.seal("spares/4/ready", "1"))
    assert spare_ready(server, 4, SEAL, told.append) and told == ["spares/4/ready"]


@given(
    name=st.text(min_size=1, max_size=40),
    value=st.binary(max_size=200),
    ours=st.binary(min_size=16, max_size=16),
    theirs=st.binary(min_size=16, max_size=16),
)
def test_a_value_opens_only_under_the_nonce_and_name_it_was_sealed_for(name, value, ours, theirs):
    """Property: a value sealed in one launch (nonce) opens there under its own name only, never in
    a launch with another nonce, where it is told apart as a replay."""
    sealed = SEAL.under(theirs).seal(name, value)
    assert SEAL.under(theirs).open(name, sealed) == value
    assert SEAL.under(theirs).open(name + "x", sealed) is None
    if ours != theirs:
        assert SEAL.under(ours).open(name, sealed) is None
        assert SEAL.under(ours).why(name, sealed) == "replayed"
    assert Seal(bytes(32), theirs).why(name, sealed) == "forged"  # another run's key


def test_a_one_node_launch_listens_on_loopback_only(tmp_path):
    """A one-node launch of the tiny GPT with in-process recovery (the default) and a warm spare:
    once the ranks train, every listening socket of the launcher and of every process it started
    (ranks, spares) is on 127.0.0.1. Before, rank 0 served its process group's store on every
    interface (``*:PORT``); now the launcher serves it on loopback, a new one per group start
    (``launcher.pg_store``), and every rank is its client."""
    from conftest import events, finish, launch, wait_for

    run = tmp_path / "run"
    proc = launch(run, "checkpoint.interval=1000", "launcher.spares=1", default_recovery=True)
    wait_for(lambda: events(run, "checkpoint_committed") or events(run, "start"), what="training")
    wait_for(lambda: len(psutil.Process(proc.pid).children(recursive=True)) >= 3, what="ranks and a spare")
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    listening = []
    for p in tree:
        try:
            listening += [(p.pid, c.laddr) for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            pass
    proc.send_signal(15)
    assert finish(proc) == 75, (run / "..").resolve()
    assert len(listening) >= 3, listening  # the rendezvous, recovery and process-group stores at least
    assert all(addr.ip == "127.0.0.1" for _, addr in listening), listening
