"""A lost node replaced by a spare node, end to end: three `trainguard run` agents on loopback
(``--nnodes 2:3``), two training and one waiting as a spare node. One active node's agent is
SIGKILLed together with its ranks at a random step; the other node's ranks keep their processes,
the spare node's warm spares take the lost ranks with their own state from the copy in the leading
node's recovery store, and the run ends with the hash of an uninterrupted run."""

from __future__ import annotations

import random

import psutil
import pytest
from test_multinode import INTERVAL, STEPS, _kill_tree, job_address, logs, start_agent

from conftest import events, launch, shared_hash, wait_for

SETTINGS = (
    f"train.max_steps={STEPS}",
    INTERVAL,
    "recovery.in_process=true",
    "recovery.node_timeout=1.0",
    "launcher.spares=1",
)


def serves(pid: int, port: int) -> bool:
    """Whether process ``pid`` listens on ``port`` (it serves torch's rendezvous store)."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)


def newest_step(run) -> int:
    beats = [e["step"] for e in events(run, "checkpoint_committed")]
    return max(beats, default=0)


@pytest.mark.parametrize(
    "nproc", [1, pytest.param(2, marks=pytest.mark.soak)], ids=["1-rank-per-node", "2-ranks-per-node"]
)
def test_a_node_killed_with_its_ranks_is_replaced_by_a_spare_node_in_process(tmp_path, tmp_path_factory, nproc):
    """``nproc`` ranks per node (2: the soak step, two nodes of 2 ranks and a spare node of 2)."""
    run = tmp_path / "run"
    endpoint, rdzv_id = job_address()
    clean = shared_hash(
        tmp_path_factory,
        f"gpt{STEPS}x{2 * nproc}",
        lambda d: launch(d, f"train.max_steps={STEPS}", INTERVAL, nproc=2 * nproc),
    )
    agents = [start_agent(run, n, endpoint, rdzv_id, *SETTINGS, nnodes="2:3", nproc=nproc) for n in range(2)]
    try:
        wait_for(lambda: len(events(run, "workers_started")) == 2, 240, "both nodes' ranks started")
        agents.append(start_agent(run, 2, endpoint, rdzv_id, *SETTINGS, nnodes="2:3", nproc=nproc))
        wait_for(lambda: events(run, "spare_node_waiting"), 240, "the third agent waits as a spare node")
        kill_after = random.Random().randint(20, 60)
        wait_for(lambda: newest_step(run) >= kill_after, 240, f"a checkpoint at step {kill_after} or later")
        # the leading node serves the rendezvous and recovery stores (not replaceable): lose the other
        survivor = next(i for i in range(2) if serves(agents[i].pid, int(endpoint.split(":")[1])))
        victim = 1 - survivor
        _kill_tree(agents[victim])
        codes = {}
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
    replaced = events(run, "rank_replaced")
    assert [e["details"]["own_state_from"] for e in replaced] == ["recovery store"] * nproc, replaced
    kept = next(e for e in events(run, "workers_started") if e["pid"] == agents[survivor].pid)["details"]["pids"]
    survivors = events(run, "recovery_finished")  # written by each surviving rank, in its own process
    assert sorted(e["pid"] for e in survivors) == sorted(kept.values()), (survivors, kept)
    assert all(e["details"]["steps_lost"] == 0 for e in survivors), survivors
    assert (run / "exclude_nodes").read_text().split() == [lost[0]["details"]["host"]]
    exits = {e["pid"]: e["details"] for e in events(run, "launch_exit")}
    assert exits[agents[survivor].pid]["state_sha256"] == clean, exits
