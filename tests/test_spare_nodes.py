"""A lost node replaced by a spare node, end to end: three `trainguard run` agents on loopback
(``--nnodes 2:3``), two training and one waiting as a spare node. One active node's agent is
SIGKILLed together with its ranks at a random step; the other node's rank keeps its process, the
spare node's warm spare takes the lost rank with its own state from the copy in node 0's recovery
store, and the run ends with the hash of an uninterrupted run."""

from __future__ import annotations

import random

import psutil
from test_multinode import INTERVAL, STEPS, _kill_tree, job_address, logs, start_agent

from conftest import events, wait_for

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


def test_a_node_killed_with_its_ranks_is_replaced_by_a_spare_node_in_process(tmp_path, clean_hash):
    run = tmp_path / "run"
    endpoint, rdzv_id = job_address()
    agents = [start_agent(run, n, endpoint, rdzv_id, *SETTINGS, nnodes="2:3") for n in range(2)]
    try:
        wait_for(lambda: len(events(run, "workers_started")) == 2, 240, "both nodes' ranks started")
        agents.append(start_agent(run, 2, endpoint, rdzv_id, *SETTINGS, nnodes="2:3"))
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
    assert [e["details"]["own_state_from"] for e in replaced] == ["recovery store"], replaced
    starts, ends = events(run, "start"), events(run, "end")
    assert [e["pid"] for e in starts if e["rank"] == 0] == [e["pid"] for e in ends if e["rank"] == 0], (
        "rank 0 restarted"
    )
    assert [e["details"]["steps_lost"] for e in events(run, "recovery_finished")] == [0]
    assert (run / "exclude_nodes").read_text().split() == [lost[0]["details"]["host"]]
    exits = {e["pid"]: e["details"] for e in events(run, "launch_exit")}
    assert exits[agents[survivor].pid]["state_sha256"] == clean_hash(STEPS), exits
