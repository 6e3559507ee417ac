"""Shared helpers for end-to-end tests: real launches of examples/gpt.py with a tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import pytest
from filelock import FileLock

from trainguard.events import read_events

REPO = Path(__file__).resolve().parents[1]
GPT = REPO / "examples" / "gpt.py"
# a model small enough for ~20 ms steps on 2 CPU ranks
TINY = [
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.seq_len=32",
    "train.batch_size=4",
    "data.max_bytes=200000",
    "train.log_interval=1",
    "train.eval_batches=2",
    "train.warmup_steps=5",
]


# pinned by launch() for the tests written for the group restart (in-process recovery is the default)
RESTART = "recovery.in_process=false"


def pinned(overrides: tuple[str, ...]) -> tuple[str, ...]:
    """``overrides`` with :data:`RESTART` added unless one of them sets ``recovery.in_process``."""
    return overrides if any(o.startswith("recovery.in_process") for o in overrides) else (*overrides, RESTART)


def sets(*items: str) -> list[str]:
    """``["--set", a, "--set", b, ...]``"""
    return [x for item in items for x in ("--set", item)]


def launch(
    run_dir: Path,
    *overrides: str,
    nproc: int = 2,
    script: Path = GPT,
    extra: tuple[str, ...] = (),
    tiny: bool = True,
    script_args: tuple[str, ...] = (),
    default_recovery: bool = False,
) -> subprocess.Popen:
    """Start ``trainguard run`` on the tiny GPT (``tiny=False``: without the GPT's TINY overrides,
    for other scripts); ``extra`` goes before the script (launcher options), ``script_args`` and
    the overrides (as ``--set``) after it; stdout+stderr go to ``run_dir.log``.

    Unless an override sets ``recovery.in_process`` or ``default_recovery`` is true, the launch
    pins ``recovery.in_process=false`` (:data:`RESTART`): tests written for the group restart keep
    it now that in-process recovery is the default; the in-process tests say so."""
    if not default_recovery:
        overrides = pinned(overrides)
    log = open(f"{run_dir}.log", "ab")
    cmd = [
        sys.executable,
        "-m",
        "trainguard.cli",
        "run",
        "--nproc-per-node",
        str(nproc),
        "--run-dir",
        str(run_dir),
        *extra,
        str(script),
        *script_args,
        *sets(*(TINY if tiny else ()), *overrides),
    ]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def wait_for(predicate: Callable[[], object], timeout: float = 120, what: str = "condition") -> object:
    """Poll ``predicate`` every 50 ms until it returns a truthy value; fail the test on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def logged_step(run_dir: Path) -> int:
    """Highest ``step N/M`` printed by rank 0 so far (0 if none)."""
    try:
        text = Path(f"{run_dir}.log").read_text(errors="replace")
    except FileNotFoundError:
        return 0
    steps = [int(line.split()[1].split("/")[0]) for line in text.splitlines() if line.startswith("step ")]
    return max(steps, default=0)


def events(run_dir: Path, kind: Optional[str] = None) -> list[dict]:
    return list(read_events(run_dir, kind))


def final_hash(run_dir: Path) -> Optional[str]:
    """state_sha256 of the last successful launch in ``run_dir``."""
    done = [e for e in events(run_dir, "launch_exit") if e["details"]["code"] == 0]
    return done[-1]["details"]["state_sha256"] if done else None


def finish(proc: subprocess.Popen, timeout: float = 180) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("launch did not finish in time")


def shared_hash(tmp_path_factory, key: str, run: Callable[[Path], subprocess.Popen]) -> str:
    """The final state hash of the uninterrupted run ``run(run_dir)`` (a launch), run once per
    ``key`` for the whole session: under pytest-xdist the workers share it through a file in the
    session's common temporary directory (the first worker to ask runs it; the others wait on its lock)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the workers of this session
    cache = root / "clean_hashes.json"
    with FileLock(str(cache) + ".lock"):
        known = json.loads(cache.read_text()) if cache.exists() else {}
        if key not in known:
            run_dir = root / f"clean-{key}" / "run"
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            code = finish(run(run_dir))
            assert code == 0, Path(f"{run_dir}.log").read_text()[-3000:]
            known[key] = final_hash(run_dir)
            cache.write_text(json.dumps(known))
        return known[key]


@pytest.fixture(scope="session")
def clean_hash(tmp_path_factory) -> Callable[[int], str]:
    """Final state hash of an uninterrupted tiny GPT run of ``max_steps`` steps (see :func:`shared_hash`)."""

    def get(max_steps: int) -> str:
        return shared_hash(
            tmp_path_factory,
            f"gpt{max_steps}",
            lambda run_dir: launch(run_dir, f"train.max_steps={max_steps}", "checkpoint.interval=10"),
        )

    return get


@pytest.fixture
def small_fs(tmp_path):
    """A real small file system: a 6 MiB tmpfs mounted at ``tmp_path/small`` (root only; skipped
    where it cannot be mounted), unmounted after the test."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m,mode=0700", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(directory: Path) -> Path:
    """Fill the file system of ``directory`` to its last byte (a file ``filler`` in it); returns the file."""
    path = directory / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 16, 4096, 512, 64, 1):
            try:
                while os.write(fd, b"\0" * size) == size:
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)
    return path
