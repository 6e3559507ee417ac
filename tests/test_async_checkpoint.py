"""Asynchronous saves and the node-local tier, with real processes, real files and real kills.

* 2 gloo ranks, async saves + local tier + a rank SIGKILLed: resumes from the local tier and ends
  bitwise identical to a synchronous, uninterrupted run;
* the torture script with --async-save --local: SIGKILL at random moments, every resume verified;
* local copies deleted or corrupted → the replica, then the persistent tier;
* ENOSPC on a real (tmpfs) filesystem: older checkpoints intact, nothing partial, stop or continue;
* bad input.

The single-process cases use the torture script's writer (an MLP under a Guard) as the training job.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, events, launch
from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.store import CheckpointStore
from trainguard.exitcodes import ExitCode

TORTURE = REPO / "scripts" / "ckpt_torture.py"


def writer(
    run_dir: Path, max_steps: int, *overrides: str, hidden: int = 64, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run the torture script's writer (MLP + Guard, checkpoint every step unless overridden)."""
    cmd = [
        sys.executable,
        str(TORTURE),
        "--child",
        str(run_dir),
        "--max-steps",
        str(max_steps),
        "--hidden",
        str(hidden),
    ]
    for item in overrides:
        cmd += ["--set", item]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def end_sha(run_dir: Path) -> str:
    return events(run_dir, "end")[-1]["details"]["state_sha256"]


def steps_in(root: Path) -> list[int]:
    return [c.step for c in CheckpointStore(root).committed()]


def run_local(local: Path, run_dir: Path) -> Path:
    """The run's own part of a node-local directory (``LOCAL/<run id>``)."""
    return local / (run_dir / ".run-id").read_text().strip()


# ---------------------------------------------------------------------------------------------
# 2 ranks: async + local tier + a killed rank


@pytest.mark.soak  # moved out of the README suite to keep it under 15 minutes on 2 cores (issue 51); CI runs it
@pytest.mark.timeout(240)
def test_async_local_tier_kill_resume_matches_sync_run(tmp_path, clean_hash):
    common = ["train.max_steps=40", "checkpoint.interval=10"]  # as clean_hash's synchronous run

    run = tmp_path / "faulty"
    local = tmp_path / "node-local"
    p = launch(
        run,
        *common,
        "checkpoint.async_save=true",
        f"checkpoint.local.dir={local}",
        "checkpoint.local.interval=3",
        "checkpoint.jit.enabled=false",  # (the local tier is what this test resumes from)
        extra=("--inject", "rank_killed:rank=1,step=17"),
    )
    assert p.wait(timeout=180) == 0, Path(f"{run}.log").read_text()[-3000:]

    resumes = events(run, "resume")
    assert len(resumes) == 1 and resumes[0]["details"]["tier"] == "local", resumes
    # the newest local step (persistent: step 10): 15, or 12 when 15's background write was not
    # committed yet when rank 1 died two steps later (a loaded machine)
    assert resumes[0]["details"]["from_step"] in (12, 15), resumes
    commits = events(run, "checkpoint_committed")
    assert commits and all(e["details"]["asynchronous"] for e in commits if e["details"]["reason"] == "interval")
    assert end_sha(run) == clean_hash(40)
    # both ranks' own copies and their replicas (single node: in the persistent tier) exist and verify
    for r in (0, 1):
        for root in (run_local(local, run) / f"rank-{r:05d}", run / "checkpoints" / "local-replicas" / f"rank-{r:05d}"):
            kept = CheckpointStore(root).committed()
            assert [c.step for c in kept] == [36, 39], (root, kept)  # every 3 steps, keep_last 2
            assert all(mf.verify(c.path) is None for c in kept)


# ---------------------------------------------------------------------------------------------
# torture: SIGKILL during async saves to both tiers


@pytest.mark.soak
@pytest.mark.timeout(240)
def test_torture_async_local(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(TORTURE),
            "--trials",
            "20",
            "--kills-per-dir",
            "5",
            "--max-steps",
            "20",
            "--jobs",
            "2",
            "--seed",
            "3",
            "--async-save",
            "--local",
            "--workdir",
            str(tmp_path / "w"),
            "--progress",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=220,
        cwd=REPO,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("SUMMARY"))
    summary = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
    assert int(summary["kills"]) == 20 and int(summary["failures"]) == 0, out[-2000:]
    assert int(summary["dirs_ok"]) == int(summary["trial_dirs"]) >= 4, out[-2000:]


# ---------------------------------------------------------------------------------------------
# local tier lost or corrupted


@pytest.mark.soak  # 38 s: the README suite stays under 15 min on 2 cores; CI runs it in the soak step
@pytest.mark.timeout(240)
def test_local_tier_deleted_or_corrupt_falls_back(tmp_path):
    tiers = ["checkpoint.interval=5", "checkpoint.local.interval=1", "checkpoint.save_final=false"]
    ref = tmp_path / "ref"
    assert writer(ref, 30).returncode == 0
    base = tmp_path / "base"
    r = writer(base, 14, *tiers, f"checkpoint.local.dir={base}/local")
    assert r.returncode == 0, r.stderr[-3000:]
    assert steps_in(base / "checkpoints") == [5, 10]
    assert steps_in(run_local(base / "local", base) / "rank-00000") == [13, 14]
    assert steps_in(base / "checkpoints" / "local-replicas" / "rank-00000") == [13, 14]

    def scenario(name: str, damage) -> list[dict]:
        run = tmp_path / name
        shutil.copytree(base, run)
        damage(run)
        r = writer(run, 30, *tiers, f"checkpoint.local.dir={run}/local")
        assert r.returncode == 0, r.stderr[-3000:]
        assert end_sha(run) == end_sha(ref), name
        return [e for e in events(run) if e["kind"] in ("resume", "checkpoint_invalid")]

    def flip_byte(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    # own copy of step 14 corrupted: the replica of step 14 is used
    evs = scenario(
        "corrupt", lambda run: flip_byte(run_local(run / "local", run) / "rank-00000" / "step-00000014" / "state.pt")
    )
    invalid = [e for e in evs if e["kind"] == "checkpoint_invalid"]
    assert invalid and invalid[0]["details"]["tier"] == "local" and "checksum" in invalid[0]["details"]["reason"]
    resume = [e for e in evs if e["kind"] == "resume"][-1]["details"]
    assert (resume["tier"], resume["from_step"]) == ("local", 14)
    assert "local-replicas" in resume["path"] or "rank-00000" in resume["path"]

    # the node's local directory gone: the replica in the persistent tier
    evs = scenario("deleted", lambda run: shutil.rmtree(run / "local"))
    resume = [e for e in evs if e["kind"] == "resume"][-1]["details"]
    assert (resume["tier"], resume["from_step"]) == ("local", 14)

    # local dir and replicas gone: the persistent tier
    def both(run: Path) -> None:
        shutil.rmtree(run / "local")
        shutil.rmtree(run / "checkpoints" / "local-replicas")

    evs = scenario("both", both)
    resume = [e for e in evs if e["kind"] == "resume"][-1]["details"]
    assert (resume["tier"], resume["from_step"]) == ("persistent", 10)


# ---------------------------------------------------------------------------------------------
# ENOSPC on a real small filesystem


@pytest.mark.timeout(180)
@pytest.mark.parametrize("max_failures", [2, 0])
def test_enospc_keeps_older_checkpoints(tmp_path, small_fs, max_failures):
    """A 6 MiB tmpfs (``small_fs``): room for two checkpoints of the hidden=256 writer (~2.4 MB
    each), not three."""
    run = tmp_path / "run"
    store = small_fs / "ckpt"
    r = writer(
        run,
        30 if max_failures else 12,
        "checkpoint.interval=3",
        "checkpoint.async_save=true",
        f"checkpoint.dir={store}",
        f"checkpoint.max_failures={max_failures}",
        "checkpoint.keep_last=2",
        "health.preflight=false",
        hidden=256,
    )  # preflight would refuse the small disk up front
    failed = events(run, "checkpoint_failed")
    committed = steps_in(store)
    assert committed == [3, 6], (committed, r.stderr[-2000:])
    assert all(mf.verify(store / f"step-{s:08d}") is None for s in committed)
    assert not [p.name for p in store.iterdir() if p.name.startswith(".tmp-")], (
        "a failed save leaves no partial directory"
    )
    # torch reports ENOSPC inside its zip writer as "unexpected pos"; the event says how full the disk is
    assert failed and all(" bytes free in " in e["details"]["error"] for e in failed), failed
    if max_failures:
        assert r.returncode == ExitCode.GIVE_UP, r.stderr[-2000:]
        assert "checkpoint saves in a row failed" in r.stderr and "bytes free in" in r.stderr
        assert [e["step"] for e in failed] == [9, 12] and events(run, "checkpoint_give_up")[0]["step"] == 15
    else:
        assert r.returncode == 0, r.stderr[-2000:]
        assert [e["step"] for e in failed] == [9, 12, 12]  # the final save retries step 12 once more
        assert "WARNING: checkpoint at step 9 failed" in r.stderr


# ---------------------------------------------------------------------------------------------
# bad input


def test_bad_input_local_tier(tmp_path):
    r = writer(tmp_path / "a", 10, "checkpoint.local.dir=/proc/trainguard-local", "checkpoint.local.interval=1")
    assert r.returncode == ExitCode.BAD_INPUT
    assert "checkpoint.local.dir /proc/trainguard-local is not writable" in r.stderr

    r = writer(
        tmp_path / "b", 10, "checkpoint.local.dir=/dev/shm/x", "checkpoint.local.interval=50", "checkpoint.interval=10"
    )
    assert r.returncode == ExitCode.BAD_INPUT
    assert "checkpoint.local.interval (50) is larger than checkpoint.interval (10)" in r.stderr

    r = writer(tmp_path / "c", 10, "checkpoint.interval=100", "checkpoint.save_final=false")
    assert r.returncode == ExitCode.BAD_INPUT
    assert "the persistent tier would never save" in r.stderr
    assert not (tmp_path / "c" / "checkpoints").exists() or not os.listdir(tmp_path / "c" / "checkpoints")


def test_runs_sharing_a_local_dir_keep_apart(tmp_path):
    """Run B uses the node-local directory run A used: it starts fresh (never A's copies) and A's
    copies stay."""
    local = tmp_path / "shm"
    tiers = [
        "checkpoint.interval=5",
        "checkpoint.local.interval=1",
        "checkpoint.save_final=false",
        f"checkpoint.local.dir={local}",
    ]
    assert writer(tmp_path / "a", 14, *tiers).returncode == 0
    r = writer(tmp_path / "b", 6, *tiers)
    assert r.returncode == 0, r.stderr[-2000:]
    assert events(tmp_path / "b", "start")[0]["details"]["first_step"] == 0
    assert steps_in(run_local(local, tmp_path / "a") / "rank-00000") == [13, 14]
    assert steps_in(run_local(local, tmp_path / "b") / "rank-00000") == [5, 6]


# ---------------------------------------------------------------------------------------------
# two "nodes": replicas on the peer node's local tier


@pytest.mark.soak  # moved out of the README suite to keep it under 15 min on 2 cores (CI took 16 min); CI runs it in the soak step
@pytest.mark.timeout(420)
def test_two_nodes_lost_local_disk_resumes_from_peer_replica(tmp_path, clean_hash):
    from test_multinode import check_finished, finish_both, two_nodes

    run = tmp_path / "run"
    tiers = [
        "train.max_steps=40",
        f"checkpoint.local.dir={tmp_path}/local-{{node}}",
        "checkpoint.local.interval=3",
        "checkpoint.interval=10",
        "checkpoint.async_save=false",
        "checkpoint.jit.enabled=false",  # (the local tier's peer replica is what this test resumes from)
    ]  # synchronous saves: step 21 is surely committed when rank 1 dies
    # rank 1 dies at step 23 and the launch gives up (no restarts): local copies at 18 and 21, persistent at 20
    with two_nodes(run, *tiers, extra=("--inject", "rank_killed:rank=1,step=23", "--max-restarts", "0")) as agents:
        codes = finish_both(run, agents)
    assert codes[0] != 0 or codes[1] != 0, codes
    for node in (0, 1):
        stores = sorted(p.name for p in run_local(tmp_path / f"local-{node}", run).iterdir())
        assert stores == sorted([f"rank-{node:05d}", f"replica-rank-{1 - node:05d}"]), stores
        for name in stores:
            assert steps_in(run_local(tmp_path / f"local-{node}", run) / name)[-1] == 21, name
    shutil.rmtree(tmp_path / "local-1")  # node 1 (rank 1) lost its local disk

    with two_nodes(run, *tiers) as agents:
        check_finished(run, finish_both(run, agents))
    resume = events(run, "resume")[-1]["details"]
    assert (resume["tier"], resume["from_step"]) == ("local", 21), resume  # rank 1's part came from node 0's replica
    assert events(run, "end")[-1]["details"]["state_sha256"] == clean_hash(40)
