"""Files and directories trainguard writes are their owner's only (0600/0700), directories others
can write are refused at start (exit code 2), and a checkpoint another user could have written is
never loaded (issue 46)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import GPT, REPO, events, finish, launch, wait_for
from trainguard.atomic import write_atomic
from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.store import CheckpointStore
from trainguard.config import ConfigError
from trainguard.rundir import prepare_run_dir


def _census(*roots: Path) -> list[str]:
    """Every path under ``roots`` (themselves included) whose mode is not 0700 (a directory) or
    0600 (anything else), as ``MODE PATH``."""
    wrong = []
    for root in roots:
        for d, _, names in os.walk(root):
            for p in [Path(d), *(Path(d) / n for n in names)]:
                mode = stat.S_IMODE(p.lstat().st_mode)
                if mode != (0o700 if p.is_dir() and not p.is_symlink() else 0o600):
                    wrong.append(f"{oct(mode)} {p}")
    return wrong


def test_a_finished_runs_files_are_private_and_the_launcher_listens_on_loopback_only(tmp_path):
    """The census of a finished one-node run (in-process recovery with a warm spare, a lost rank
    replaced, checkpoints in a directory outside the run directory, under a permissive umask):
    every file under RUN_DIR and the checkpoint directory is 0600, every directory 0700. While
    it ran, the launcher listened on loopback only (the group start's process-group store; the
    rendezvous and recovery stores are files on one node)."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    old = os.umask(0o002)  # a group-writable default, as on many shared clusters
    try:
        proc = launch(
            run,
            "train.max_steps=40",
            "checkpoint.interval=10",
            f"checkpoint.dir={ckpt}",
            "recovery.in_process=true",
            "launcher.spares=1",
            extra=("--inject", "rank_killed:rank=1,step=25"),
        )
    finally:
        os.umask(old)
    wait_for(lambda: events(run, "checkpoint_committed"), what="a first checkpoint")
    listening = [c.laddr.ip for c in psutil.Process(proc.pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert len(listening) >= 1 and set(listening) == {"127.0.0.1"}, listening
    assert len(events(run, "rank_replaced")) == 1
    assert (run / "FINISHED").exists() and (run / "config.toml").exists() and (run / ".recovery-key").exists()
    assert len(list(ckpt.glob("step-*"))) >= 3
    assert _census(run, ckpt) == []


def _run_cli(run: Path, *sets: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--run-dir", str(run), str(GPT)]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)


@pytest.mark.parametrize("where", ["run dir", "checkpoint.dir"])
def test_a_directory_others_can_write_is_refused_at_start_with_exit_2(tmp_path, where):
    run, ckpt = tmp_path / "run", tmp_path / "shared-ckpt"
    target = run if where == "run dir" else ckpt
    target.mkdir()
    target.chmod(0o777)
    done = _run_cli(run, f"checkpoint.dir={ckpt}")
    assert done.returncode == 2, done.stderr
    assert f"{where} {target}: others can write it (mode 0o777)" in done.stderr, done.stderr
    assert f"chmod 700 {target}" in done.stderr
    assert not list(target.iterdir())  # nothing written into the shared directory


def test_prepare_run_dir_makes_a_private_directory_and_refuses_a_shared_one(tmp_path):
    prepare_run_dir(tmp_path / "new")
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o775)
    shared.chmod(0o775)
    with pytest.raises(ConfigError, match=r"others can write it \(mode 0o775\)"):
        prepare_run_dir(shared)


def test_write_atomic_writes_owner_only_files_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        path = write_atomic(tmp_path / "FINISHED", "{}")
        (tmp_path / "x").write_text("old")
        (tmp_path / "x").chmod(0o666)
        write_atomic(tmp_path / "x", "new")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "x").stat().st_mode) == 0o600 and (tmp_path / "x").read_text() == "new"


def _commit(store: CheckpointStore, step: int) -> Path:
    tmp = store.begin(step)
    (tmp / ".metadata").write_bytes(b"a pickle in real life")
    (tmp / "rank-00000.pt").write_bytes(b"state")
    files = mf.describe_files(tmp, sorted(p.name for p in tmp.iterdir()))
    return store.commit(tmp, step, files, {"world_size": 1}).path


def test_a_checkpoint_another_user_could_have_written_is_never_chosen(tmp_path):
    """A checkpoint is committed private (0700/0600 under a permissive umask). One whose file,
    directory or store others can write is refused by the check every load goes through, before
    anything in it is read: its manifest could have been rewritten to match a planted ``.metadata``."""
    store = CheckpointStore(tmp_path / "ckpt")
    old = os.umask(0)
    try:
        first, second = _commit(store, 10), _commit(store, 20)
    finally:
        os.umask(old)
    assert [oct(stat.S_IMODE(p.stat().st_mode)) for p in (first, first / ".metadata", first / "manifest.json")] == [
        "0o700",
        "0o600",
        "0o600",
    ]
    assert store.latest_valid().step == 20
    (second / ".metadata").chmod(0o620)
    reason = store.check(store.committed()[-1])
    assert reason == ".metadata is not private: others can write it (mode 0o620)"
    assert store.latest_valid().step == 10  # the exposed one is skipped
    first.chmod(0o777)
    assert store.latest_valid() is None
    first.chmod(0o700)
    store.root.chmod(0o777)
    assert "is not private: others can write it (mode 0o777)" in store.check(store.committed()[0])
