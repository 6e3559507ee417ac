"""A lost node replaced by a spare node, end to end: three `trainguard run` agents on loopback
(``--nnodes 2:3``), two training and one waiting as a spare node. One active node's agent is
SIGKILLed together with its ranks at a random step; the other node's ranks keep their processes,
the spare node's warm spares take the lost ranks with their own state from the copy in the leading
node's recovery store, and the run ends with the hash of an uninterrupted run."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
from test_multinode import INTERVAL, STEPS, _kill_tree, free_port, job_address, logs, node_log, start_agent

from conftest import GPT, REPO, TINY, events, launch, pinned, sets, shared_hash, wait_for

FSDP2 = REPO / "examples" / "fsdp2.py"

SETTINGS = (
    f"train.max_steps={STEPS}",
    INTERVAL,
    "recovery.in_process=true",
    "recovery.node_timeout=1.0",
    "recovery.timeout=120",  # a loss before the spare node's warm-up ends (seconds on loaded cores) waits for it
    "launcher.spares=1",
)


pytestmark = pytest.mark.soak  # three launchers and their ranks: over a minute each on 2 cores (CI's soak step)


# the job waits for its spare node, however long that takes to start: rank 0 stops itself at step 5
# (nothing watches for hangs) until wake_when_the_spare_node_is_ready()
HOLD = ("--inject", "rank_hung:rank=0,step=5")
UNWATCHED = ("supervisor.enabled=false", "health.ping=false")


def wake_when_the_spare_node_is_ready(run: Path) -> None:
    """Wait for rank 0 to have stopped itself and for the spare node's warm spares (in either
    order), then wake rank 0 (SIGCONT)."""
    pids = [int(p) for e in events(run, "workers_started") for r, p in e["details"]["pids"].items() if r == "0"]

    def stopped() -> bool:
        with contextlib.suppress(psutil.Error):
            return any(psutil.Process(p).status() == psutil.STATUS_STOPPED for p in pids)
        return False

    wait_for(stopped, 240, "rank 0 stopped at step 5")
    wait_for(lambda: events(run, "spare_node_waiting"), 240, "the spare node's warm spares ready")
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def serves(pid: int, port: int) -> bool:
    """Whether process ``pid`` listens on ``port`` (it serves torch's rendezvous store)."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)


def newest_step(run) -> int:
    beats = [e["step"] for e in events(run, "checkpoint_committed")]
    return max(beats, default=0)


def lose_a_node(run: Path, nproc: int, *overrides: str, script: Path = GPT) -> tuple[int, list[subprocess.Popen]]:
    """Two nodes of ``nproc`` ranks train ``script`` (``--nnodes 2:3``), a third waits as a spare
    node; at a random checkpoint step the non-leading node's agent is SIGKILLed with its ranks.
    Waits for the leading node and the spare node to end, checks both exited 0, that one node was
    lost with a spare waiting, that the spare node took exactly its ranks, and that the group did
    not restart. Returns (the surviving agent's index, the agents)."""
    endpoint, rdzv_id = job_address()
    # the job waits for the spare node: rank 0 stops itself at step 5 (nothing watches for hangs)
    # and is woken once the spare node's warm spares are ready, however long they take to start
    settings = (*SETTINGS, *overrides, *UNWATCHED)
    agents = [
        start_agent(run, n, endpoint, rdzv_id, *settings, nnodes="2:3", nproc=nproc, script=script, extra=HOLD)
        for n in range(2)
    ]
    try:
        wait_for(lambda: len(events(run, "workers_started")) == 2, 240, "both nodes' ranks started")
        agents.append(start_agent(run, 2, endpoint, rdzv_id, *settings, nnodes="2:3", nproc=nproc, script=script))
        wake_when_the_spare_node_is_ready(run)
        kill_after = random.Random().randint(20, 60)
        wait_for(lambda: newest_step(run) >= kill_after, 240, f"a checkpoint at step {kill_after} or later")
        # the leading node serves the rendezvous and recovery stores (not replaceable): lose the other
        survivor = next(i for i in range(2) if serves(agents[i].pid, int(endpoint.split(":")[1])))
        _kill_tree(agents[1 - survivor])
        wait_for(
            lambda: all(agents[i].poll() is not None for i in (survivor, 2)), 300, "the survivor and the spare node end"
        )
        codes = {i: agents[i].poll() for i in (survivor, 2)}
    finally:
        for a in agents:
            if a.poll() is None:
                _kill_tree(a)
    text = logs(run)
    assert codes == {survivor: 0, 2: 0}, (codes, text)
    lost = events(run, "node_lost")
    assert [e["details"]["spare_nodes"] for e in lost] == [1], (lost, text)
    assigned = events(run, "spare_node_assigned")
    assert [e["details"]["ranks"] for e in assigned] == [lost[0]["details"]["ranks"]], assigned
    assert not events(run, "group_restart") and not events(run, "recovery_fallback"), text
    assert (run / "exclude_nodes").read_text().split() == [lost[0]["details"]["host"]]
    kept = next(e for e in events(run, "workers_started") if e["pid"] == agents[survivor].pid)["details"]["pids"]
    survivors = events(run, "recovery_finished")  # written by each surviving rank, in its own process
    assert sorted(e["pid"] for e in survivors) == sorted(kept.values()), (survivors, kept)
    return survivor, agents


def final_of(run: Path, agent: subprocess.Popen) -> str:
    """The state hash ``agent``'s launch ended with."""
    return {e["pid"]: e["details"] for e in events(run, "launch_exit")}[agent.pid]["state_sha256"]


@pytest.mark.parametrize("nproc", [1, 2], ids=["1-rank-per-node", "2-ranks-per-node"])
def test_a_node_killed_with_its_ranks_is_replaced_by_a_spare_node_in_process(tmp_path, tmp_path_factory, nproc):
    """``nproc`` ranks per node (2: two nodes of 2 ranks and a spare node of 2)."""
    run = tmp_path / "run"
    clean = shared_hash(
        tmp_path_factory,
        f"gpt{STEPS}x{2 * nproc}",
        lambda d: launch(d, f"train.max_steps={STEPS}", INTERVAL, nproc=2 * nproc),
    )
    survivor, agents = lose_a_node(run, nproc)
    replaced = events(run, "rank_replaced")
    assert [e["details"]["own_state_from"] for e in replaced] == ["recovery store"] * nproc, replaced
    assert all(e["details"]["steps_lost"] == 0 for e in events(run, "recovery_finished"))
    assert final_of(run, agents[survivor]) == clean


@pytest.mark.parametrize("replicas", [1, 2], ids=["fsdp2", "hsdp"])
def test_a_sharded_model_loses_a_node_to_a_spare_node_in_process(tmp_path, tmp_path_factory, replicas):
    """Two nodes of 2 ranks and a spare node of 2, the model sharded with FSDP2 over the 4 ranks
    (``replicas`` 1) or HSDP (2 replica groups, one per node). FSDP2: every rank rolls back in
    memory to the newest snapshot, the lost node's shards from the copies the leading node's ranks
    hold (the same local rank on the next node), at most ``snapshot_interval`` steps lost. HSDP:
    the lost replica group's shards come from the other one, no step lost (unless the survivors
    ended one step apart: the behind one's replica was on the lost node, so a snapshot rollback).
    Both bitwise."""
    run = tmp_path / "run"
    sharded = (f"fsdp.replicas={replicas}", "model.n_layers=2", "recovery.snapshot_interval=5")
    clean = shared_hash(
        tmp_path_factory,
        f"fsdp2-{STEPS}x4x{replicas}",
        lambda d: launch(d, f"train.max_steps={STEPS}", INTERVAL, *sharded, nproc=4, script=FSDP2),
    )
    survivor, agents = lose_a_node(run, 2, *sharded, script=FSDP2)
    lost_ranks = events(run, "node_lost")[0]["details"]["ranks"]
    steps_lost = {e["details"]["steps_lost"] for e in events(run, "recovery_finished")}
    restored = {e["rank"]: e["details"]["source"] for e in events(run, "snapshot_restored")}
    if replicas == 1:  # survivors may be one step apart (a collective that completed on some only)
        assert min(steps_lost) <= 5 and max(steps_lost) - min(steps_lost) <= 1, steps_lost
        assert {restored[r] for r in lost_ranks} == {f"rank {(r + 2) % 4}'s memory" for r in lost_ranks}, restored
    elif restored:  # survivors one step apart, the behind one's replica on the lost node (replica_plan)
        survivors_at = {e["details"]["from_step"] for e in events(run, "snapshot_restored")} - {None}
        assert len(survivors_at) == 2, survivors_at
    else:
        assert steps_lost == {0}
    assert final_of(run, agents[survivor]) == clean


# ---- each node with its own address: network namespaces ------------------------------------------


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


LEADER = "10.77.0.1"  # the leader's address: here, on a link of its own (to an otherwise empty namespace)


@contextlib.contextmanager
def nodes_with_addresses(count: int):
    """Network namespaces joined to this one by a veth pair each, on its own /24 (10.77.<i>.1 here,
    10.77.<i>.2 inside, the namespace's default route): the first (i = 0) only gives the leader here
    the address :data:`LEADER` on a link of its own; the ``count`` others are nodes. Yields
    ``(leader link, [(namespace, address, host-side link, inside link)])``. Needs root; removed
    after (a namespace's processes must be gone first)."""
    tag = uuid.uuid4().hex[:6]
    made = []
    try:
        for i in range(count + 1):
            ns, here, there = f"tg{tag}{i}", f"tgh{tag}{i}", f"tgn{tag}{i}"
            added = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
            if added.returncode != 0 and i == 0:  # a container without CAP_SYS_ADMIN, say
                pytest.skip(f"cannot make a network namespace here: {added.stderr.strip()}")
            added.check_returncode()
            made.append((ns, here))
            # the host's name server is out of a namespace's reach: a name lookup fails at once, not
            # after the resolver's timeouts (`ip netns exec` mounts this file over /etc/resolv.conf)
            Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{ns}/resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
            _ip("link", "add", here, "type", "veth", "peer", "name", there)
            _ip("link", "set", there, "netns", ns)
            _ip("addr", "add", f"10.77.{i}.1/24", "dev", here)
            _ip("link", "set", here, "up")
            _ip("-n", ns, "addr", "add", f"10.77.{i}.2/24", "dev", there)
            _ip("-n", ns, "link", "set", there, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", f"10.77.{i}.1")
        nodes = [(ns, f"10.77.{i}.2", here, f"tgn{tag}{i}") for i, (ns, here) in enumerate(made) if i > 0]
        yield made[0][1], nodes
    finally:
        for ns, here in made:
            subprocess.run(["ip", "link", "del", here], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir("/etc/netns")  # if this test made it


def _agent_at(run, n, endpoint, job, addr, iface, ns=None) -> subprocess.Popen:
    """A `trainguard run` agent of a ``--nnodes 2:3`` job at ``addr`` (its rendezvous and recovery
    addresses; gloo on ``iface``), inside the network namespace ``ns`` (``None``: this one)."""
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nnodes", "2:3", "--nproc-per-node", "1"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--local-addr", addr]
    host = int(ns is None)  # the leader serves torch's rendezvous store (its address is not the host name's)
    cmd += ["--rdzv-conf", f"join_timeout=60,last_call_timeout=1,is_host={host}", "--run-dir", str(run)]
    cmd += [*HOLD, str(GPT), *sets(*TINY, *pinned((*SETTINGS, *UNWATCHED)))]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": iface}
    with open(node_log(run, n), "ab") as log:
        return subprocess.Popen(
            (["ip", "netns", "exec", ns] if ns else []) + cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env
        )


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and iproute2 (network namespaces)")
def test_a_node_whose_host_stops_answering_is_replaced_by_a_spare_node_on_its_own_address(tmp_path, clean_hash):
    """Three nodes with their own addresses: the leader here (10.77.0.1), a node and a spare node each
    in a network namespace (10.77.1.2, 10.77.2.2). The node's link goes down mid-run: its launcher
    and rank live on but nothing of theirs arrives any more (no connection is closed). The leader
    finds the node silent, its rank cuts its connections on the word of the loss, the spare node
    takes the rank, and the run ends with the clean hash."""
    run = tmp_path / "run"
    agents: list[subprocess.Popen] = []
    with nodes_with_addresses(2) as (dummy, ((ns_b, addr_b, link_b, in_b), (ns_c, addr_c, _, in_c))):
        endpoint, job = f"{LEADER}:{free_port()}", f"tg-{uuid.uuid4().hex[:8]}"
        try:
            agents.append(_agent_at(run, 0, endpoint, job, LEADER, dummy))
            wait_for(lambda: (tmp_path / "run" / "events.jsonl").exists(), 60, "the leader started")
            agents.append(_agent_at(run, 1, endpoint, job, addr_b, in_b, ns_b))
            wait_for(lambda: len(events(run, "workers_started")) == 2, 240, "both nodes' ranks started")
            agents.append(_agent_at(run, 2, endpoint, job, addr_c, in_c, ns_c))
            wake_when_the_spare_node_is_ready(run)
            kill_after = random.Random().randint(20, 60)
            wait_for(lambda: newest_step(run) >= kill_after, 240, f"a checkpoint at step {kill_after} or later")
            _ip("link", "set", link_b, "down")  # the host stops answering: nothing is closed
            wait_for(lambda: agents[0].poll() is not None and agents[2].poll() is not None, 300, "leader and spare end")
        finally:
            for a in agents:
                if a.poll() is None:
                    _kill_tree(a)
    text = logs(run) + "\n" + node_log(run, 2).read_text(errors="replace")[-3000:]
    assert (agents[0].returncode, agents[2].returncode) == (0, 0), text
    lost = events(run, "node_lost")
    assert [e["details"]["spare_nodes"] for e in lost] == [1] and len(lost[0]["details"]["ranks"]) == 1, (lost, text)
    assert not events(run, "group_restart") and not events(run, "recovery_fallback"), text
    replaced = events(run, "rank_replaced")
    assert [(e["rank"], e["details"]["own_state_from"]) for e in replaced] == [
        (lost[0]["details"]["ranks"][0], "recovery store")
    ], replaced
    exits = {e["pid"]: e["details"] for e in events(run, "launch_exit")}
    assert exits[agents[0].pid]["state_sha256"] == clean_hash(STEPS), exits
