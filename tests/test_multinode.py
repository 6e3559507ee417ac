"""End to end on two "nodes": two `trainguard run` agents on loopback (c10d rendezvous, one gloo rank
each) sharing one run directory, as the nodes of a cluster share a filesystem."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator, Optional

import psutil
import pytest
import torch

from conftest import GPT, REPO, TINY, events, pinned, sets, wait_for
from trainguard.checkpoint.io import rank_file

STEPS = 150  # as test_launcher.py: the clean_hash fixture's run is shared
INTERVAL = "checkpoint.interval=10"  # the clean_hash fixture's interval
DEADLINE = 240.0  # seconds for a whole two-node launch (2 CPU cores shared with other jobs)


class HealthyRankBlamed(AssertionError):
    """The supervisor of the healthy node reported its own rank as hung (bug 1 below)."""


class TeardownFalseHang(AssertionError):
    """A launch failed after a rank was reported hung once training had ended (bug 2 below)."""


# Regression guards for two racy bugs this test found (both fixed; the exceptions below name them):
#
# 1. When the hung node's agent comes back to the rendezvous, the healthy node's agent often
#    restarts its group through torch's `_restart_workers` (membership change), which bypasses
#    `TrainguardAgent._start_group`: no `workers_started` event, and the HangMonitor keeps its
#    attempt number and start time, reads the OLD worker's heartbeat record (same attempt directory:
#    the restart count did not change), finds it silent for over the learned 2 s step timeout and
#    SIGKILLs the freshly started worker as "hung" (a `hang_detected` for rank 0 at step 60). When
#    the healthy rank instead fails first with its killed peer, the restart goes through
#    `_handle_failure` and the bug does not show.
# 2. What follows the last step (evaluation, process group teardown, interpreter exit) is timed
#    with the learned between-steps timeout (`out_of_section`, 2 s here): a slow teardown is taken
#    for a hang and the group is restarted from the final checkpoint. On one node that costs a
#    restart; on two, when only one node's rank is caught, its agent waits in the rendezvous for a
#    peer that is already in the exit barrier, and it dies of RendezvousTimeoutError (exit 1).
MEMBERSHIP_RESTART_BUG = (
    "a membership-change restart (torch's _restart_workers) bypasses TrainguardAgent._start_group: "
    "the HangMonitor reads the old worker's heartbeat record and kills the new worker as hung"
)
TEARDOWN_BUG = (
    "the code after the last step is timed with the learned out_of_section timeout (2 s): a slow "
    "teardown is a false hang, and on two nodes the restarted agent times out in the rendezvous"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_log(run: Path, node: int) -> Path:
    return Path(f"{run}.node{node}.log")


def logs(run: Path, chars: int = 3000) -> str:
    return "\n".join(
        f"--- node {n} ---\n{node_log(run, n).read_text(errors='replace')[-chars:]}"
        for n in range(2)
        if node_log(run, n).exists()
    )


def _kill_tree(agent: subprocess.Popen) -> None:
    """SIGKILL a still running agent and its workers (stopped first, so it starts no new ones)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(agent.pid, signal.SIGSTOP)
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(agent.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    agent.kill()
    agent.wait(timeout=30)


def start_agent(
    run: Path,
    node: int,
    endpoint: str,
    rdzv_id: str,
    *overrides: str,
    nnodes: str = "2",
    extra: tuple[str, ...] = (),
    nproc: int = 1,
    script: Path = GPT,
) -> subprocess.Popen:
    """One agent of a job on loopback (``--nproc-per-node nproc``, c10d rendezvous at ``endpoint``)
    running ``script`` (the GPT's tiny settings apply), its output in ``node_log(run, node)``."""
    with open(node_log(run, node), "ab") as log:
        cmd = [
            sys.executable,
            "-m",
            "trainguard.cli",
            "run",
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            rdzv_id,
            # a lone agent gives up on the rendezvous after 1 min, not torch's 10; with MIN:MAX nodes
            # the rendezvous closes 1 s after MIN joined (torch: 30 s)
            "--rdzv-conf",
            "join_timeout=60,last_call_timeout=1",
            "--run-dir",
            str(run),
            *extra,
            str(script),
            *sets(*TINY, *pinned(overrides)),
        ]
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def job_address() -> tuple[str, str]:
    """A fresh rendezvous endpoint and job id."""
    return f"127.0.0.1:{free_port()}", f"tg-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def two_nodes(run: Path, *overrides: str, extra: tuple[str, ...] = ()) -> Iterator[list[subprocess.Popen]]:
    """Start two agents of one job (``--nnodes 2 --nproc-per-node 1``) on the run dir ``run``;
    on exit, kill whatever is left of them."""
    endpoint, rdzv_id = job_address()
    agents: list[subprocess.Popen] = []
    try:
        for node in range(2):
            agents.append(start_agent(run, node, endpoint, rdzv_id, *overrides, extra=extra))
        yield agents
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_tree(agent)


def finish_both(run: Path, agents: list[subprocess.Popen], timeout: float = DEADLINE) -> list[Optional[int]]:
    """Wait for both agents and return their exit codes. When one exits with an error, give its peer
    5 s and return (None for a peer still running: it could wait in the rendezvous for minutes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [a.poll() for a in agents]
        if None not in codes:
            return codes
        if any(c not in (None, 0) for c in codes):
            grace = time.monotonic() + 5
            while time.monotonic() < grace and None in [a.poll() for a in agents]:
                time.sleep(0.1)
            return [a.poll() for a in agents]
        time.sleep(0.1)
    pytest.fail(f"two-node launch did not finish in {timeout} s\n{logs(run)}")


def check_finished(run: Path, codes: list[Optional[int]]) -> None:
    if codes != [0, 0]:
        ends = events(run, "end")
        late = [h for h in events(run, "hang_detected") if ends and h["time"] > ends[0]["time"]]
        if late:
            raise TeardownFalseHang(
                f"exit codes {codes} after hangs reported past the end of training: {late}\n{logs(run)}"
            )
    assert codes == [0, 0], f"exit codes {codes}\n{logs(run)}"


def exits_by_agent(run: Path, agents: list[subprocess.Popen]) -> dict[int, dict]:
    """The ``launch_exit`` event of each agent (both write into the shared events.jsonl), by agent pid."""
    exits = {e["pid"]: e["details"] for e in events(run, "launch_exit")}
    assert set(exits) == {a.pid for a in agents}, exits
    return exits


def training_events(run: Path, kind: str) -> list[dict]:
    """Events of ``kind`` up to the end of training (rank 0's first ``end`` event).

    What follows the last step (evaluation, process group teardown, interpreter exit) is timed by
    the supervisor with the learned between-steps timeout: a slow teardown can be taken for a hang
    and the group restarted from the final checkpoint (bug 2 above); when the launch still ends with
    0 and the clean hash, that is not this test's concern."""
    ends = events(run, "end")
    until = ends[0]["time"] if ends else float("inf")
    return [e for e in events(run, kind) if e["time"] <= until]


def node_of_worker(run: Path, agents: list[subprocess.Popen], worker_pid: int) -> int:
    """Index of the agent that started the worker process ``worker_pid``."""
    for node, agent in enumerate(agents):
        for e in events(run, "workers_started"):
            if e["pid"] == agent.pid and worker_pid in map(int, e["details"]["pids"].values()):
                return node
    pytest.fail(f"no agent started worker {worker_pid}")


@pytest.mark.soak  # moved out of the README suite to keep it under 15 min on 2 cores (CI took 16 min); CI runs it in the soak step
def test_two_node_clean_run_matches_single_node_hash(tmp_path, clean_hash):
    run = tmp_path / "run"
    with two_nodes(run, f"train.max_steps={STEPS}", INTERVAL) as agents:
        codes = finish_both(run, agents)
    check_finished(run, codes)

    started = training_events(run, "workers_started")
    assert sorted(e["pid"] for e in started) == sorted(a.pid for a in agents), started
    assert all(e["details"]["world_size"] == 2 and e["details"]["restart"] == 0 for e in started), started
    assert len(training_events(run, "start")) == 1 and events(run, "start")[0]["details"]["world_size"] == 2
    assert not training_events(run, "hang_detected") and not training_events(run, "group_restart"), logs(run)
    for pid, exit_ in exits_by_agent(run, agents).items():
        assert exit_["code"] == 0, (pid, exit_)
        # world size 2 either way (2 nodes × 1 rank, 1 node × 2 ranks): bitwise the same training
        assert exit_["state_sha256"] == clean_hash(STEPS), (pid, exit_)


@pytest.mark.soak  # moved out of the README suite to keep it under 15 min on 2 cores; CI runs it in the soak step
def test_hang_on_second_node_is_detected_there_both_nodes_restart_and_match_clean_run(tmp_path, clean_hash):
    run = tmp_path / "run"
    # c10d ranks nodes by (address, agent pid): which node hosts rank 1 is read from the events,
    # so both agents get the injection (each rank keeps only its own faults)
    with two_nodes(run, f"train.max_steps={STEPS}", INTERVAL, extra=("--inject", "rank_hung:rank=1,step=60")) as agents:
        codes = finish_both(run, agents)
    check_finished(run, codes)

    faults = events(run, "fault_injected")
    assert len(faults) == 1 and faults[0]["rank"] == 1 and faults[0]["step"] == 60, faults
    hung_node = node_of_worker(run, agents, faults[0]["pid"])
    healthy_node = 1 - hung_node

    # the supervisor of the hung rank's node sees it, in its step
    hangs = training_events(run, "hang_detected")
    mine = [h for h in hangs if h["pid"] == agents[hung_node].pid and h["details"]["rank"] == 1]
    assert mine and mine[0]["details"]["section"] == "step", hangs
    assert mine[0]["details"]["stacks"] and Path(mine[0]["details"]["stacks"]).is_file()
    assert len(mine) == 1, hangs
    # rank 0 waits for its peer (in the step-60 checkpoint save, untimed, or in the stop check after
    # it): it is not blamed after the restart (bug 1). Its own supervisor cannot see the other node,
    # so when it waits in a timed section it may be reported within the same poll window as the
    # hung rank (two equal 2.0 s timeouts; seen once in eight runs): that is the same group restart.
    at = mine[0]["details"]["detected_at"]
    if any(h["details"]["rank"] != 1 and abs(h["details"]["detected_at"] - at) >= 1.0 for h in hangs):
        raise HealthyRankBlamed(f"a healthy rank reported hung: {hangs}")

    # both nodes start new workers: the hung node through a restart, the healthy one because its
    # rank fails with its killed peer, or because the rendezvous sees the hung node come back
    started = {
        n: [e for e in training_events(run, "workers_started") if e["pid"] == a.pid] for n, a in enumerate(agents)
    }
    assert [e["details"]["restart"] for e in started[hung_node]] == [0, 1], started
    assert len(started[healthy_node]) == 2, started
    first_pids = {int(p) for n in (0, 1) for p in started[n][0]["details"]["pids"].values()}
    resumed = [e for e in training_events(run, "start") if e["time"] > faults[0]["time"]]
    assert len(resumed) == 1 and resumed[0]["pid"] not in first_pids, resumed
    # the newest checkpoint before the restart: 50; 60 when the stack dump's SIGCONT let the
    # stopped rank finish the step-60 save its peer was waiting in before it was killed; 40 when
    # step 50's background save was still in flight when rank 1 stopped. The restart resumes from
    # the newest on disk: the last one reported, or the next when its background save committed on
    # disk after its event's last chance (rank 0 reports a commit at a step boundary, and it waits in
    # step 60's collective; seen once in the soak, 2026-11-28: events up to 40, resumed from 50)
    # (each node's just-in-time copies are their own event, kind "jit": the resume takes them only when
    # every rank of both nodes has one of the same step)
    persistent = [e for e in training_events(run, "checkpoint_committed") if e["details"].get("kind") != "jit"]
    committed = [e["step"] for e in persistent if e["time"] < resumed[0]["time"]]
    first = resumed[0]["details"]["first_step"]
    if resumed[0]["details"]["resumed_from"] and "/jit/" in resumed[0]["details"]["resumed_from"]:
        assert first >= committed[-1], (first, committed)
    else:
        assert committed[-1] >= 40 and first in (committed[-1], committed[-1] + 10) and first <= 60, (first, committed)

    for pid, exit_ in exits_by_agent(run, agents).items():
        assert exit_["code"] == 0, (pid, exit_)
        assert exit_["state_sha256"] == clean_hash(STEPS), (pid, exit_)


def test_rank_killed_on_either_node_is_replaced_in_process_across_nodes(tmp_path, clean_hash):
    """In-process recovery on two nodes: rank 1 SIGKILLs itself at step 77; the agent of its node
    replaces it (a warm spare of that node), drawing the generation from node 0's recovery store;
    rank 0, on the other node, keeps its process; both agents end with the clean hash."""
    run = tmp_path / "run"
    overrides = (f"train.max_steps={STEPS}", INTERVAL, "recovery.in_process=true", "launcher.spares=1")
    with two_nodes(run, *overrides, extra=("--inject", "rank_killed:rank=1,step=77")) as agents:
        codes = finish_both(run, agents)
    check_finished(run, codes)

    faults = events(run, "fault_injected")
    assert len(faults) == 1 and faults[0]["rank"] == 1, faults
    lost_node = node_of_worker(run, agents, faults[0]["pid"])
    assert not events(run, "group_restart") and not events(run, "recovery_fallback"), logs(run)
    assert sorted(e["pid"] for e in events(run, "workers_started")) == sorted(a.pid for a in agents)
    started = [e for e in events(run, "recovery_started") if e["rank"] is None]
    assert [(e["pid"], e["details"]["generation"], e["details"]["warm"]) for e in started] == [
        (agents[lost_node].pid, 1, [1])
    ], started
    replaced = events(run, "rank_replaced")
    assert [(e["rank"], e["step"]) for e in replaced] == [(1, 77)], replaced
    starts, ends = events(run, "start"), events(run, "end")
    assert [e["pid"] for e in starts if e["rank"] == 0] == [e["pid"] for e in ends if e["rank"] == 0]
    done = events(run, "recovery_finished")
    assert len(done) == 1 and done[0]["details"]["steps_lost"] == 0, done
    joined = events(run, "generation_joined")
    assert [e["pid"] for e in joined] == [agents[lost_node].pid], joined
    for pid, exit_ in exits_by_agent(run, agents).items():
        assert exit_["code"] == 0 and exit_["state_sha256"] == clean_hash(STEPS), (pid, exit_)


@pytest.mark.soak  # over 40 s on 2 cores: scripts/test_soak.sh (CI)
# interval 1: the growth lands on a save step. Found by the soak (2026-11-28, a growth at step 1100
# with interval 20): the ranks that grew saved that step, which the newcomer, joining after it, does
# not; from then on the writer groups' collectives were paired wrongly, the checkpoints held two
# ranks' files of three, and the final save hung
@pytest.mark.parametrize("interval", [20, 1])
def test_a_3_rank_job_that_lost_a_rank_goes_on_as_2_and_a_returning_node_makes_it_3_in_place(tmp_path, interval):
    """``--nnodes 1:2``: the first node trains alone with 3 ranks (4 sequences each). Rank 1 dies:
    ``elastic.min_ranks = 2``, no spare, no regrow, so ranks 0 and 2 go on in place as 2 ranks of 6
    (no restart). A node (1 rank) comes back while they run: the first node's agent joins the new
    rendezvous round beside its running ranks, the newcomer starts as rank 2 of 3 and the others
    send it the model, optimizer and data position at their next stop check: 3 ranks of 4 again,
    no rank stopped, no step redone, no checkpoint read. The job is then stopped (SIGTERM to both
    launchers, exit 75): 12 sequences per step throughout."""
    run = tmp_path / "run"
    endpoint, rdzv_id = job_address()
    settings = (
        "train.max_steps=1000000",  # runs until stopped
        "train.batch_size=4",
        "data.max_bytes=2000000",  # 57,000 sequences: the epoch does not end however fast the steps are
        f"checkpoint.interval={interval}",
        "recovery.in_process=true",
        "launcher.spares=0",
        "elastic.min_ranks=2",
        "elastic.regrow=false",
    )
    kill = ("--inject", "rank_killed:rank=1,step=15")
    agents = [start_agent(run, 0, endpoint, rdzv_id, *settings, nnodes="1:2", extra=kill, nproc=3)]
    try:
        wait_for(lambda: events(run, "world_size_changed"), what="the shrink to 2 ranks")
        shrunk = events(run, "world_size_changed")[0]["time"]
        wait_for(lambda: [e for e in events(run, "checkpoint_committed") if e["time"] > shrunk], what="a step on 2")
        agents.append(start_agent(run, 1, endpoint, rdzv_id, *settings, nnodes="1:2"))
        wait_for(lambda: events(run, "group_grown"), what="the grow to 3 ranks")
        grown = events(run, "group_grown")[0]["time"]
        wait_for(lambda: [e for e in events(run, "checkpoint_committed") if e["time"] > grown], what="a step on 3")
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
        codes = finish_both(run, agents)
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_tree(agent)
    assert codes == [75, 75], logs(run)
    for kind in ("membership_restart", "group_restart", "recovery_fallback", "resume"):
        assert not events(run, kind), (kind, logs(run))
    # one change that grew the group; the CI's soak (2026-12-07, interval 20) recorded a second
    # membership change here, whose events were not printed: they are now, and the test asks only
    # that every change was an in-place one of the first node's launcher (the grow is checked below)
    changes = events(run, "membership_change")
    assert changes and all(c["pid"] == agents[0].pid and c["details"]["in_place"] for c in changes), (
        changes,
        logs(run),
    )
    [started] = [e for e in events(run, "workers_started") if e["pid"] == agents[1].pid]
    [newcomer] = map(int, started["details"]["pids"].values())
    [joined] = events(run, "rank_joined")
    assert (joined["rank"], joined["pid"]) == (2, newcomer), joined
    [grow] = events(run, "group_grown")
    assert grow["details"]["joined"] == [2] and grow["details"]["world_size"] == 3, grow
    changed = events(run, "world_size_changed")
    sizes = sorted((e["details"]["from_world_size"], e["details"]["to_world_size"], e["rank"]) for e in changed)
    assert sizes == [(2, 3, 0), (2, 3, 1), (3, 2, 0), (3, 2, 1)], sizes
    assert sorted(e["step"] for e in changed) == [15, 15, grow["step"], grow["step"]], changed
    assert joined["step"] == grow["step"]
    saved = events(run, "checkpoint_committed")
    final = Path(saved[-1]["details"]["path"])
    assert saved[-1]["step"] > grow["step"] and not (final / rank_file(3)).exists()
    states = [torch.load(final / rank_file(r), weights_only=True) for r in range(3)]
    assert [s["sampler"]["consumed"] for s in states] == [12 * saved[-1]["step"]] * 3
    report = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "report", str(run)], capture_output=True, text=True, cwd=REPO
    )
    print(report.stdout)
    assert report.returncode == 0, report.stderr
