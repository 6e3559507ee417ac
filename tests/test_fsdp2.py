"""FSDP2 (``fully_shard``) end to end on gloo ranks (examples/fsdp2.py): a rank SIGKILLed at a random
moment is replaced in-process, every rank rolling back to its in-memory snapshot (the lost shard
from a peer's copy) or, with HSDP, the lost shard coming from its replica; a killed rank without
in-process recovery restarts the group from the node-local tier's shards; a loss spike rolls back
in-process. Every run ends bitwise equal to an uninterrupted one."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Callable

import pytest

from conftest import REPO, events, final_hash, finish, launch, logged_step, shared_hash, wait_for

FSDP2 = REPO / "examples" / "fsdp2.py"
STEPS = 60


SNAPSHOT_INTERVAL = 5
IN_PROCESS = ("recovery.in_process=true", f"recovery.snapshot_interval={SNAPSHOT_INTERVAL}")
LOGGED = ("train.log_interval=1", "checkpoint.interval=20")  # a step number on the console at every step


def fsdp2(run: Path, *overrides: str, extra: tuple[str, ...] = (), nproc: int = 2, script: Path = FSDP2):
    return launch(
        run, f"train.max_steps={STEPS}", "model.n_layers=2", *overrides, script=script, extra=extra, nproc=nproc
    )


@pytest.fixture(scope="session")
def fsdp2_clean_hash(tmp_path_factory) -> Callable[[int, int], str]:
    """The final hash of an uninterrupted run on ``nproc`` ranks in ``replicas`` replica groups."""
    return lambda nproc, replicas: shared_hash(
        tmp_path_factory,
        f"fsdp2-{nproc}x{replicas}",
        lambda run: fsdp2(run, *LOGGED, f"fsdp.replicas={replicas}", nproc=nproc),
    )


def kill_at_random(run: Path, seed: int, nproc: int, replicas: int) -> int:
    """Launch the FSDP2 example with in-process recovery; SIGKILL a rank drawn from ``seed`` at a
    random moment (a random step from 12 to 40, then a random fraction of a step: forward's
    all-gather, backward's reduce-scatter, the gradient norm's all-reduce, a snapshot's copy);
    check that it finished with the other ranks' processes and no group restart. Returns the victim."""
    rng = random.Random(seed)
    proc = fsdp2(run, *LOGGED, *IN_PROCESS, f"fsdp.replicas={replicas}", nproc=nproc)
    kill_at, victim = rng.randint(12, 40), rng.randrange(nproc)
    wait_for(lambda: logged_step(run) >= kill_at, what=f"step {kill_at}")
    time.sleep(rng.random() * 0.1)
    pids = events(run, "workers_started")[0]["details"]["pids"]
    os.kill(int(pids[str(victim)]), signal.SIGKILL)
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert not events(run, "group_restart") and not events(run, "recovery_fallback")
    survivors = sorted(int(pids[str(r)]) for r in range(nproc) if r != victim)
    assert sorted(e["pid"] for e in events(run, "recovery_finished")) == survivors
    assert [e["rank"] for e in events(run, "rank_replaced")] == [victim]
    return victim


def check_rolled_back(run: Path, victim: int, nproc: int) -> None:
    """Every rank rolled back to the same snapshot, at most SNAPSHOT_INTERVAL completed steps
    back; the replacement's shard came from its holder's memory (the next rank, one node)."""
    restored = events(run, "snapshot_restored")
    assert len({e["step"] for e in restored}) == 1 and len(restored) == nproc, restored
    lost = [e["details"]["steps_lost"] for e in events(run, "recovery_finished")]
    assert all(0 <= n <= SNAPSHOT_INTERVAL for n in lost), lost
    sources = {e["rank"]: e["details"]["source"] for e in restored}
    assert sources.pop(victim) == f"rank {(victim + 1) % nproc}'s memory"
    assert set(sources.values()) == {"own memory"}


@pytest.mark.soak  # 30 s on 2 cores: the README suite keeps its 15 minutes (the decisions: tests/test_shards.py)
def test_fsdp2_rank_killed_at_a_random_moment_rolls_back_in_memory_bitwise(tmp_path, fsdp2_clean_hash):
    """Plain FSDP2 on 2 ranks: no replica of the lost shard exists at the current step, so every
    rank rolls back in memory to the newest snapshot they all hold (the lost rank's from the copy
    its peer holds): no process restarts, no file read, at most ``K`` steps trained again, bitwise."""
    run = tmp_path / "run"
    victim = kill_at_random(run, seed=5, nproc=2, replicas=1)
    check_rolled_back(run, victim, 2)
    assert final_hash(run) == fsdp2_clean_hash(2, 1)


@pytest.mark.soak
@pytest.mark.parametrize("seed", [21, 24])
def test_fsdp2_campaign_of_kills_at_random_moments(tmp_path, fsdp2_clean_hash, seed):
    """More seeded moments of the test above (scripts/test_soak.sh)."""
    run = tmp_path / "run"
    victim = kill_at_random(run, seed=seed, nproc=2, replicas=1)
    check_rolled_back(run, victim, 2)
    assert final_hash(run) == fsdp2_clean_hash(2, 1)


@pytest.mark.soak  # 4 ranks on 2 cores: scripts/test_soak.sh (CI)
@pytest.mark.parametrize("seed", [12, 31])
def test_hsdp_rank_killed_takes_its_shard_from_its_replica_no_step_lost(tmp_path, fsdp2_clean_hash, seed):
    """HSDP on 4 ranks (2 replica groups of 2 shards): the lost shard exists in the other replica
    group, so it is sent from there, the lost rank's own state comes from its step boundary and the
    interrupted step is done again (a survivor one step behind takes the completed step from its
    own replica): no snapshot is restored, no step lost, bitwise. A snapshot rollback (bitwise too)
    is allowed only after survivors ended one step apart where no replica holds the newer step."""
    run = tmp_path / "run"
    victim = kill_at_random(run, seed=seed, nproc=4, replicas=2)
    restored = events(run, "snapshot_restored")
    if restored:  # only when the survivors were one step apart and no replica held a shard of the
        # newer step (a behind rank's replica lost, or both behind: replica_plan, tests/test_shards.py)
        assert len({e["details"]["from_step"] for e in restored if e["details"]["from_step"] is not None}) == 2
    else:
        assert {e["details"]["steps_lost"] for e in events(run, "recovery_finished")} == {0}
        # every shard from its replica (victim + 2): the victim's, and a survivor's that was one step
        # behind (a collective that completed on some ranks only; the test below)
        received = {r: e["rank"] for e in events(run, "state_transferred") for r in e["details"]["to_ranks"]}
        assert victim in received and all(src == (r + 2) % 4 for r, src in received.items()), received
    assert final_hash(run) == fsdp2_clean_hash(4, 2)


@pytest.mark.soak  # 4 ranks on 2 cores: scripts/test_soak.sh (CI)
def test_hsdp_a_survivor_one_step_behind_takes_the_completed_step_from_its_replica(
    tmp_path, fsdp2_clean_hash, monkeypatch
):
    """HSDP on 4 ranks; rank 3 dies in step 13 after its last collective, while rank 0 still waits
    on it (tests/behind_worker.py): ranks 1 and 2 complete step 13, rank 0
    abandons it. Rank 0 takes step 13 from its shard's replica (rank 2), rank 3's replacement from
    rank 1: no snapshot restored, no step lost, nothing redone on rank 0, bitwise."""
    monkeypatch.setenv("TG_BEHIND_STEP", "13")
    monkeypatch.setenv("TG_BEHIND_DIR", str(tmp_path))
    run = tmp_path / "run"
    args = (*LOGGED, *IN_PROCESS, "fsdp.replicas=2")
    proc = fsdp2(run, *args, nproc=4, script=REPO / "tests" / "behind_worker.py")
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert not events(run, "group_restart") and not events(run, "snapshot_restored")
    behind = [e["details"]["during"] for e in events(run, "recovery_started") if e["rank"] == 0]
    assert behind == ["dist.broadcast"], behind  # in step 13, before its update
    received = {r: e["rank"] for e in events(run, "state_transferred") for r in e["details"]["to_ranks"]}
    assert received == {0: 2, 3: 1}, received
    finished = {e["rank"]: e for e in events(run, "recovery_finished")}
    assert {r: (e["step"], e["details"]["steps_lost"]) for r, e in finished.items()} == {
        0: (13, 0),
        1: (13, 0),
        2: (13, 0),
    }, finished
    assert finished[0]["details"]["redo_step"] is None  # it took step 13: nothing done again
    assert final_hash(run) == fsdp2_clean_hash(4, 2)


@pytest.mark.soak  # over 40 s on 2 cores: scripts/test_soak.sh (CI)
@pytest.mark.slow
def test_a_killed_rank_resumes_from_the_local_shards_bitwise(tmp_path):
    clean = tmp_path / "clean"
    assert finish(fsdp2(clean, "checkpoint.interval=20")) == 0, Path(f"{clean}.log").read_text()[-3000:]
    run = tmp_path / "run"
    local = (f"checkpoint.local.dir={tmp_path / 'local'}", "checkpoint.local.interval=5", "checkpoint.interval=20")
    proc = fsdp2(run, *local, extra=("--inject", "rank_killed:rank=1,step=37"))
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    resume = events(run, "resume")[-1]["details"]
    # local saves run in the background: step 35's may still be in flight when rank 1 dies at 37
    assert resume["tier"] == "local" and resume["from_step"] in (30, 35), resume
    assert final_hash(run) == final_hash(clean)


@pytest.mark.slow
def test_a_loss_spike_rolls_back_to_the_known_good_shards(tmp_path):
    run = tmp_path / "run"
    spike = ("--inject", "loss_spike:rank=0,step=45,factor=1000")
    rules = ("checkpoint.interval=10", "instability.loss_spike=rollback", "instability.known_good_after=5")
    rules += ("instability.min_history=20",)
    assert finish(fsdp2(run, *rules, extra=spike)) == 0, Path(f"{run}.log").read_text()[-3000:]
    rollback = events(run, "rollback")[0]["details"]
    assert rollback["from_step"] == 45 and rollback["to_step"] in (30, 40), rollback
    assert events(run, "end")[-1]["step"] == STEPS and not events(run, "group_restart")  # in-process
