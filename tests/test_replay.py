"""Replay across launches (issue 46): the key names of the recovery store repeat in every launch
(``attempt1/gen/1``, ``spares/1``) and the key in ``RUN_DIR/.recovery-key`` is reused by the next
launch on the same run directory; the per-launch nonce bound into every seal
(:class:`trainguard.rejoin.auth.Seal`) makes values recorded in one launch refused in the next."""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from conftest import events, finish, launch, wait_for
from trainguard.launch_env import RECOVERY_STORE
from trainguard.launcher.node_join import JOIN_KEY, NODE_KEY, NodeJoin
from trainguard.rejoin.auth import Seal, new_nonce
from trainguard.rejoin.protocol import connect, parse_address, serve
from trainguard.rejoin.stores import open_store

# what a co-tenant records from the first launch's recovery store: the spare's assignment, the
# generation and the replacement's join of the first in-process recovery
RECORDED = ("spares/1", "attempt1/gen/1", "attempt1/gen/1/joined/1")


def test_a_value_sealed_in_another_launch_is_refused_and_told_as_a_replay():
    key = bytes(range(32))
    first, second = Seal(key, new_nonce()), Seal(key, new_nonce())
    blob = first.seal("attempt1/gen/1", '{"number": 1}')
    assert first.open("attempt1/gen/1", blob) == b'{"number": 1}'
    assert second.open("attempt1/gen/1", blob) is None  # the same key file, the next launch
    assert second.why("attempt1/gen/1", blob) == "replayed"
    assert second.why("attempt1/gen/1", Seal(bytes(32), second.nonce).seal("attempt1/gen/1", "1")) == "forged"
    assert second.why("attempt1/gen/1", b"1") == "forged"
    swapped = second.nonce.hex().encode() + blob[blob.index(b":") :]  # the nonce rewritten: the MAC binds it
    assert second.open("attempt1/gen/1", swapped) is None and second.why("attempt1/gen/1", swapped) == "forged"


def _store_of(proc) -> dist.Store:
    """A co-tenant's connection to the launch's recovery store, found as one would: in a rank's
    environment (same user: ``/proc/PID/environ``; on one node the store is a file only that user
    can open)."""

    def address():
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                value = child.environ().get(RECOVERY_STORE)
            except psutil.Error:
                continue
            if value:
                return value
        return None

    return open_store(wait_for(address, what="a rank with the recovery store in its environment"), 120)


@pytest.mark.soak  # moved out of the README suite to keep it under 15 minutes on 2 cores (issue 51); CI runs it
def test_values_recorded_in_one_launch_are_refused_in_the_next_and_recovery_still_succeeds(tmp_path):
    """Launch 1 loses rank 1 at step 30 and replaces it in-process with its warm spare; a co-tenant
    records the spare's assignment, the generation and the replacement's join from its recovery
    store. Launch 2 on the same run directory (the same key file) gets those values written into
    its own store as soon as its spare waits: each is refused with a ``security`` event (the
    spare does not take launch 1's rank, the launcher does not count launch 1's join), and when
    rank 1 is lost again at step 90 the recovery succeeds in-process."""
    run = tmp_path / "run"
    common = ("checkpoint.interval=10", "recovery.in_process=true", "launcher.spares=1")
    first = launch(run, "train.max_steps=60", *common, extra=("--inject", "rank_killed:rank=1,step=30"))
    store = _store_of(first)
    store.wait(list(RECORDED))
    recorded = {k: store.get(k) for k in RECORDED}
    assert finish(first) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert len(events(run, "rank_replaced")) == 1 and not events(run, "security")

    second = launch(run, "train.max_steps=120", *common, extra=("--inject", "rank_killed:rank=1,step=90"))
    store = _store_of(second)
    store.wait(["spares/1/ready"])  # launch 2's spare waits for its assignment under spares/1
    for k, blob in recorded.items():
        store.set(k, blob)
    assert finish(second) == 0, Path(f"{run}.log").read_text()[-3000:]

    replaced = events(run, "rank_replaced")
    assert [(e["rank"], e["details"]["generation"], e["step"]) for e in replaced] == [(1, 1, 30), (1, 1, 90)]
    assert [e["details"]["exit_codes"] for e in events(run, "workers_failed")] == [{"1": -signal.SIGKILL}] * 2
    assert not events(run, "group_restart") and not events(run, "recovery_fallback")
    started = [e for e in events(run, "recovery_started") if e["rank"] is None]
    assert [e["details"]["warm"] for e in started] == [[1], [1]]  # launch 2's spare took the real assignment
    refused = {e["details"]["key"] for e in events(run, "security")}
    assert "spares/1" in refused and refused <= set(RECORDED), refused
    assert events(run, "launch_exit")[-1]["details"]["code"] == 0


def test_a_store_offer_from_another_round_is_refused(tmp_path):
    """The rendezvous store (torch's; anyone who reaches it can write): the leader's offer of its
    recovery store, sealed for one round, is refused in the next one (its challenges differ)."""
    from concurrent.futures import ThreadPoolExecutor

    from trainguard.launcher import node_join

    seal = Seal(bytes(range(32)))
    told: list[tuple[str, str]] = []
    rdzv = serve()
    views = [dist.PrefixStore("round1", s) for s in (rdzv, connect("127.0.0.1", rdzv.port))]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(node_join.announce, v, n, 2, False, 1, seal) for n, v in enumerate(views)]
        records = [f.result(timeout=60) for f in futures]
    assert records[0] == records[1] and len({r.challenge for r in records[0]}) == 2
    offer = node_join.StoreOffer("127.0.0.1:4242", 1, new_nonce().hex())
    node_join.offer_store(views[0], records[0], offer, seal)
    assert node_join.read_store(views[1], records[1], seal, lambda k, w: told.append((k, w))) == offer
    old = views[0].get(node_join.STORE_KEY)

    views = [dist.PrefixStore("round2", s) for s in (rdzv, connect("127.0.0.1", rdzv.port, timeout=2))]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(node_join.announce, v, n, 2, False, 1, seal) for n, v in enumerate(views)]
        records = [f.result(timeout=60) for f in futures]
    views[0].set(node_join.STORE_KEY, old)  # the last round's offer, replayed
    try:
        node_join.read_store(views[1], records[1], seal, lambda k, w: told.append((k, w)))
        raise AssertionError("a replayed offer was taken")
    except dist.DistStoreError:
        pass
    assert told == [(node_join.STORE_KEY, "forged")]


@pytest.mark.soak  # moved out of the README suite to keep it under 15 minutes on 2 cores (issue 51); CI runs it
def test_a_forged_join_offer_on_two_loopback_nodes_is_refused_and_the_node_joins_in_place(tmp_path):
    """Two nodes on loopback (``--nnodes 1:2``, in-process recovery, ``elastic.min_ranks``): node 0
    trains alone with 2 ranks; before node 1 arrives, a co-tenant that found torch's rendezvous
    store (the endpoint) and its key names writes, for the next round, a join offer for either
    group rank that points the joining node's workers at its own address. Node 1's agent refuses
    it (a ``security`` event for its ``trainguard/join/N`` key), takes the host's sealed offer
    and its 2 workers join the running group in place as ranks 2 and 3.

    The host writes its real offer to the same key: when it does so before node 1's first read
    (seen under load), node 1 never meets the forged value and nothing is refused. Such a trial
    proves nothing of the refusal (its node still joins in place): it is run again, up to 3 times."""
    for trial in range(3):
        run = tmp_path / f"run{trial}"
        refused = _forged_offer_trial(run)
        if refused:
            break
    assert [e["details"]["key"] for e in refused] in ([JOIN_KEY.format(0)], [JOIN_KEY.format(1)])
    assert not [k for k in (NODE_KEY.format(0), NODE_KEY.format(1)) if k in str(refused)]


def _forged_offer_trial(run: Path) -> list[dict]:
    """One launch of the two nodes with the forged offer; asserts the grow in place and the
    stop, returns node 1's ``security`` events."""
    from test_multinode import _kill_tree, finish_both, job_address, logs, start_agent

    from trainguard.rejoin.protocol import Generation

    endpoint, rdzv_id = job_address()
    settings = (
        "train.max_steps=1000000",
        "train.batch_size=4",
        "data.max_bytes=2000000",
        "checkpoint.interval=20",
        "recovery.in_process=true",
        "launcher.spares=0",
        "elastic.min_ranks=2",
        "elastic.regrow=false",
    )
    agents = [start_agent(run, 0, endpoint, rdzv_id, *settings, nnodes="1:2", nproc=2)]
    try:
        wait_for(lambda: events(run, "checkpoint_committed"), what="node 0 training")
        rdzv = connect(*parse_address(endpoint), 30)
        prefix = f"torch.rendezvous.{rdzv_id}."
        rounds = [int(k[len(prefix) :].split("/")[0]) for k in rdzv.list_keys() if k.startswith(prefix)]
        evil = NodeJoin("10.6.6.6:6666", 1, Generation(1, "10.6.6.6", 6666, (2, 3), 4, grown=(2, 3)), (2, 3), "00")
        for rank in (0, 1):  # the joining node's group rank in the next round is torch's choice
            rdzv.set(f"{prefix}{max(rounds) + 1}/{JOIN_KEY.format(rank)}", evil.to_json())
        agents.append(start_agent(run, 1, endpoint, rdzv_id, *settings, nnodes="1:2", nproc=2))
        wait_for(lambda: events(run, "group_grown"), what="the grow to 4 ranks", timeout=180)
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
        codes = finish_both(run, agents)
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_tree(agent)
    assert codes == [75, 75], logs(run)
    [grow] = events(run, "group_grown")
    assert grow["details"]["joined"] == [2, 3] and grow["details"]["world_size"] == 4, grow
    for kind in ("group_restart", "recovery_fallback", "membership_restart"):
        assert not events(run, kind), (kind, logs(run))
    return [e for e in events(run, "security") if e["pid"] == agents[1].pid]
