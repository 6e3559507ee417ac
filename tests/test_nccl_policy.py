"""NCCL: the backend policy (group restart by default, ``in_process = "nccl-experimental"`` opts into
the communicator abort), the launcher's immediate kill of the survivors when rank 0 declines, and
the abort path itself, run on gloo (docs/recovery.md, NCCL)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import events, finish, launch, wait_for
from trainguard.config import ConfigError, load_config
from trainguard.rejoin import abort
from trainguard.rejoin.auth import Seal
from trainguard.rejoin.backend_policy import EXPERIMENTAL, BackendPolicy, decide, is_nccl, parts
from trainguard.rejoin.protocol import Generation, RecoveryStore, serve

HERE = Path(__file__).resolve().parent
WORKER = HERE / "nccl_policy_worker.py"
ABORT_WORKER = HERE / "comm_abort_worker.py"

NCCL_REASON = f'not verified on NCCL here; [recovery] in_process = "{EXPERIMENTAL}" opts in'

# (backend of the default group, [recovery] in_process) -> (in_process, abort, declined: substring or None)
TABLE = [
    ("gloo", True, (True, True, None)),  # the loss learned from the launcher on gloo too (issue 52)
    ("gloo", EXPERIMENTAL, (True, True, None)),
    ("gloo", False, (False, False, None)),
    ("nccl", True, (False, False, NCCL_REASON)),
    ("nccl", EXPERIMENTAL, (True, True, None)),
    ("nccl", False, (False, False, None)),
    ("NCCL", True, (False, False, NCCL_REASON)),
    ("cpu:gloo,cuda:nccl", True, (False, False, NCCL_REASON)),  # init_process_group()'s default on a GPU machine
    ("cpu:gloo,cuda:nccl", EXPERIMENTAL, (True, True, None)),
    ("xccl", True, (False, False, 'not verified on backend "xccl"')),
    ("xccl", EXPERIMENTAL, (False, False, 'not verified on backend "xccl"')),
    ("mpi", True, (False, False, 'not verified on backend "mpi"')),
    ("tg_registered", True, (False, False, 'not verified on backend "tg_registered"')),
    ("tg_registered", False, (False, False, None)),
    (None, True, (True, False, None)),  # no process group: one process, nothing to decline
    (None, EXPERIMENTAL, (True, False, None)),
    (None, False, (False, False, None)),
]


@pytest.mark.parametrize(("backend", "value", "expected"), TABLE)
def test_policy_table(backend, value, expected):
    policy = decide(backend, value)
    in_process, aborts, reason = expected
    assert (policy.in_process, policy.abort) == (in_process, aborts)
    if reason is None:
        assert policy.declined is None
    else:
        assert policy.declined is not None and reason in policy.declined


def test_backend_strings_are_read_by_their_parts():
    assert parts("cpu:gloo,cuda:nccl") == ("gloo", "nccl")
    assert parts(" Gloo ") == ("gloo",) and parts(None) == () and parts("") == ()
    assert is_nccl("cpu:gloo, cuda:nccl") and not is_nccl("gloo") and not is_nccl("ncclx")


def test_a_value_that_is_not_true_false_or_experimental_is_refused():
    with pytest.raises(ValueError, match="nccl-experimental"):
        decide("nccl", "nccl")
    assert load_config(overrides=["recovery.in_process=nccl-experimental"]).recovery.in_process == EXPERIMENTAL
    assert load_config(overrides=["recovery.in_process=false"]).recovery.in_process is False
    with pytest.raises(ConfigError, match=r"recovery\.in_process.*nccl-experimental"):
        load_config(overrides=["recovery.in_process=nccl"])


BACKENDS = st.one_of(
    st.none(),
    st.sampled_from(["gloo", "nccl", "cpu:gloo,cuda:nccl", "xccl", "ucc", "mpi", "GLOO", "cuda:nccl"]),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_:,", min_size=1, max_size=12),
)
VALUES = st.sampled_from([True, False, EXPERIMENTAL])


@given(BACKENDS, VALUES)
def test_policy_invariants(backend, value):
    """Off stays off; a declined job is never in-process and says why; the abort runs only
    in-process and only when opted in; NCCL is in-process only when opted in; gloo keeps what it had."""
    policy = decide(backend, value)
    assert isinstance(policy, BackendPolicy)
    if value is False:
        assert policy == BackendPolicy(False, False)
    assert (policy.declined is not None) == (value is not False and not policy.in_process)
    assert not policy.abort or policy.in_process
    assert not policy.abort or value == EXPERIMENTAL or set(parts(backend)) <= {"gloo"}
    if is_nccl(backend):
        assert policy.in_process == (value == EXPERIMENTAL) and policy.abort == (value == EXPERIMENTAL)
    if parts(backend) and set(parts(backend)) <= {"gloo"}:
        assert policy.in_process == bool(value)


def test_installed_torch_has_the_members_the_abort_uses():
    """The private torch names the abort uses (listed in trainguard/compat.py) exist in the installed
    torch; where NCCL is not built in (this CPU build) its members are reported missing, and the
    abort path is then declined with a reason naming them."""
    from trainguard import compat

    assert compat.missing_abort(nccl=False) == []
    assert abort.why_unsupported("gloo") is None
    import torch.distributed as dist

    if dist.is_nccl_available():
        assert compat.missing_abort(nccl=True) == []
    else:
        missing = compat.missing_abort(nccl=True)
        assert missing == ["ProcessGroupNCCL._group_start", "ProcessGroupNCCL._group_end"]
        why = abort.why_unsupported("nccl")
        assert why is not None and "ProcessGroupNCCL._group_start" in why and "communicator abort" in why
    assert abort.init_options("gloo") == {}  # eager NCCL creation only for NCCL (and only with a GPU)


def _lost_at(run: Path) -> float:
    return float((run / "lost_at").read_text())


def test_a_declined_backend_restarts_the_group_at_once_killing_the_survivor(tmp_path):
    """A default group on a backend in-process recovery is not verified on (registered through torch's
    public ``Backend.register_backend``; NCCL takes the same path): rank 0 declines at start, and
    when rank 1 dies holding its connections open (the survivor's collective never fails, as on
    NCCL), the launcher kills the survivor within a couple of seconds (not after ``[recovery]
    timeout``, 30 s, nor the collective's 300 s), after the survivor's thread saved the last completed
    step from memory (its main thread still blocked in that collective): the group restarts from it,
    not from the checkpoint of step 10 (issue 55)."""
    run = tmp_path / "run"
    proc = launch(
        run,
        "worker.backend=registered",
        "worker.lose_at=12",
        "checkpoint.interval=5",
        "checkpoint.async_save=false",  # step 10 committed before the loss at 12: the newest checkpoint
        "recovery.in_process=true",
        script=WORKER,
        tiny=False,
    )
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    log = Path(f"{run}.log").read_text()
    assert 'in-process recovery does not apply (not verified on backend "tg_registered" here' in log
    lost = _lost_at(run)
    fallback = events(run, "recovery_fallback")
    assert len(fallback) == 1 and "not verified on backend" in fallback[0]["details"]["reason"]
    failed = events(run, "workers_failed")
    assert failed[0]["details"]["stopped_by_launcher"] == [0]  # the survivor did not end on its own
    assert failed[0]["details"]["exit_codes"]["1"] == -signal.SIGKILL
    restart = events(run, "group_restart")
    assert len(restart) == 1 and restart[0]["time"] - lost < 2.0, restart[0]["time"] - lost
    assert failed[0]["time"] - lost < 2.0
    assert not events(run, "recovery_started") and not events(run, "rank_replaced")
    resumes = [e["details"] for e in events(run, "resume")]
    assert len(resumes) == 1 and resumes[0]["tier"] == "jit" and resumes[0]["from_step"] >= 11, resumes
    saved = [e["details"] for e in events(run, "checkpoint_committed") if e["details"].get("kind") == "jit"]
    assert saved[0]["answers"]["0"]["why"] == "the launcher restarts the group"  # from the survivor's thread
    # the warm spare of the first launch was stopped at its first completed step, none started after
    stopped = events(run, "spares_stopped")
    assert len(stopped) == 1 and "not verified on backend" in stopped[0]["details"]["reason"]
    assert len(stopped[0]["details"]["pids"]) == 1 and stopped[0]["time"] < lost
    assert "warm spares stopped: in-process recovery does not apply" in log
    assert not (run / "spares").exists() or all(f.stat().st_mtime < lost for f in (run / "spares").iterdir())
    assert events(run, "launch_exit")[-1]["details"]["code"] == 0


@pytest.mark.soak  # a second launch of ~30 s; the abort path itself is tested below without the launcher
def test_the_abort_watcher_ends_a_collective_that_never_fails_and_the_rank_is_replaced_in_process(tmp_path):
    """``in_process = "nccl-experimental"`` on gloo: rank 1 dies holding its connections open, so the
    survivor's collective would wait (30 s of ``[recovery] timeout`` and a group restart with
    ``true``); the abort watcher ends it when the launcher publishes the replacement, and the rank
    is replaced in-process within a couple of seconds of the loss, with the result of the
    restarted run (same steps, same data)."""
    run = tmp_path / "run"
    proc = launch(
        run,
        "worker.lose_at=12",
        "checkpoint.interval=5",
        f"recovery.in_process={EXPERIMENTAL}",
        script=WORKER,
        tiny=False,
    )
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    lost = _lost_at(run)
    assert not events(run, "group_restart") and not events(run, "recovery_fallback")
    finished = events(run, "recovery_finished")
    assert len(finished) == 1 and finished[0]["details"]["steps_lost"] == 0
    assert finished[0]["time"] - lost < 2.0, finished[0]["time"] - lost
    assert [e["rank"] for e in events(run, "rank_replaced")] == [1]


def test_abort_ends_a_gloo_collective_blocked_on_a_stopped_peer_and_the_group_is_made_again(tmp_path):
    """The abort path without the launcher, on real gloo ranks: rank 1 is stopped (SIGSTOP: alive,
    connections open), rank 0 blocks in an all-reduce with it (60 s timeout). The test publishes
    generation 1 in a real recovery store, as the launcher does; rank 0's abort watcher aborts its
    groups and the collective ends within a second with an error the catch takes for a lost peer.
    Rank 0 then drops the old world, creates the generation's group, re-binds DDP, sends the state
    to a fresh replacement and both train a step to the same parameters."""
    key = secrets.token_bytes(32)
    recovery, gen_store = serve(), serve()
    launcher = RecoveryStore(recovery, 1, Seal(key))
    address = f"127.0.0.1:{recovery.port}"
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)])}

    def start(role: str) -> subprocess.Popen:
        log = open(tmp_path / f"{role}.log", "wb")
        cmd = [sys.executable, str(ABORT_WORKER), role, str(tmp_path), address, key.hex(), port]
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    survivor, peer = start("survivor"), start("peer")
    replacement = None
    try:
        wait_for(lambda: (tmp_path / "ready").exists() and (tmp_path / "blocked").exists(), 60, "both ranks")
        wait_for(lambda: psutil.Process(peer.pid).status() == psutil.STATUS_STOPPED, 10, "rank 1 stopped")
        published = time.time()
        launcher.publish(Generation(1, "127.0.0.1", gen_store.port, (1,), 2))
        (tmp_path / "published").write_text(f"{published:.6f}")  # for a look at the times after the test
        replacement = start("replacement")
        assert replacement.wait(90) == 0, (tmp_path / "replacement.log").read_text()[-3000:]
        assert survivor.wait(30) == 0, (tmp_path / "survivor.log").read_text()[-3000:]
    finally:
        for p in (survivor, peer, replacement):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    said = json.loads((tmp_path / "survivor.json").read_text())
    assert said["by"] == "watcher" and said["groups"] >= 1 and said["cut"] >= 1, said
    assert said["aborted"], said  # already true when the collective returned: any error then is the lost peer
    assert said["peer_failure"] and "Connection closed by peer" in said["error"], said
    # still blocked when the generation was published; out within a second (the watcher looks every
    # 0.1 s), where gloo's own timeout is 60 s
    assert published <= said["ended"] < published + 1.0, (said, published)
    assert said["initialized_after_clear"] is False  # the old world dropped before the new group
    assert (tmp_path / "survivor.hash").read_text() == (tmp_path / "replacement.hash").read_text()


# (the generation the launcher publishes, whether the rank's main thread entered it first) -> who aborts
TRIGGERS = [
    (Generation(1, "127.0.0.1", 1, (1,), 2), False, "watcher"),  # a lost rank replaced
    (Generation(1, "127.0.0.1", 1, (), 1, left=(1,)), False, "watcher"),  # a shrink: the group goes on without it
    (Generation(1, "127.0.0.1", 1, (2,), 3, grown=(2,)), False, None),  # a growth: met at a step boundary
    (Generation(1, "127.0.0.1", 1, (1,), 2), True, "recovery"),  # the rank caught the loss and got there first
]


@pytest.mark.parametrize(("gen", "main_first", "by"), TRIGGERS)
def test_the_watcher_aborts_once_per_lost_generation_and_never_a_newer_group(gen, main_first, by):
    """The abort watcher on a real recovery store (no process group in this process: nothing to
    abort, what is decided is who aborts and when): a generation that replaces or drops ranks is
    aborted once, by the watcher unless the main thread entered it first (then by the main
    thread, and the watcher leaves the new generation's groups alone); a growth is not aborted."""
    key = secrets.token_bytes(32)
    server = serve()
    launcher = RecoveryStore(server, 1, Seal(key))
    current = {"generation": 0}
    watcher = abort.CommAbort(f"127.0.0.1:{server.port}", 1, Seal(key), lambda: current["generation"], set)
    try:
        assert not watcher.aborted()
        if main_first:
            current["generation"] = 1  # the main thread has the generation (Rejoin.wait_generation) ...
            watcher.before_regroup(1)  # ... and aborts the old world itself before the new group
        launcher.publish(gen)
        if by == "watcher":
            wait_for(lambda: watcher.last is not None, 10, "the watcher's abort")
            assert watcher.aborted()  # any collective error from now on is the lost peer
            current["generation"] = 1
            watcher.before_regroup(1)  # the main thread: done already, not again
        else:
            # the watcher's look is every 0.1 s: two looks, and it has not aborted (again)
            deadline = time.monotonic() + 0.3
            wait_for(lambda: time.monotonic() > deadline, 5, "two looks")
        assert (watcher.last.by if watcher.last else None) == by
        assert not watcher.aborted()
    finally:
        watcher.stop()
