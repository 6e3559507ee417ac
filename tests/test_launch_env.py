"""The launcher → rank contract (trainguard.launch_env): round trip, defaults, bad values, one owner
of every variable name, and a module light enough for the command line. Fast: no launch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from trainguard import launch_env
from trainguard.config import ConfigError, config_from_argv
from trainguard.launch_env import LaunchEnv, LaunchEnvError
from trainguard.slurm.endtime import JobEndTime

SRC = REPO / "src" / "trainguard"
NAMES = launch_env.WRITTEN + (
    launch_env.RESTART_COUNT,
    launch_env.LOCAL_RANK,
    launch_env.GROUP_RANK,
    launch_env.LOCAL_WORLD_SIZE,
    launch_env.READY_DIR,
)

FULL = LaunchEnv(
    run_dir=Path("/runs/gpt"),
    config=Path("/cfg/train.toml"),
    overrides=("train.max_steps=5", "a.b=x y"),
    inject=({"kind": "rank_hung", "rank": 1, "step": 30},),
    launch_time=1763900000.123456,
    heartbeat_dir=Path("/dev/shm/trainguard-hb-x"),
    end_time=1763903600.5,
    end_time_file=Path("/runs/gpt/.slurm_end_time.7.0"),
    recovery_store="10.0.0.1:29600",
    recovery_dir=Path("/dev/shm/trainguard-rejoin-x"),
    recovery_group=3,
    boundary_mirror=True,
    spare_nodes=True,
)


def test_round_trip_keeps_every_field_exactly():
    env = FULL.to_environ()
    assert set(env) == set(launch_env.WRITTEN) and all(isinstance(v, str) for v in env.values())
    assert LaunchEnv.from_environ(env) == FULL


def test_unset_or_empty_means_not_given():
    assert LaunchEnv.from_environ({}) == LaunchEnv()
    empty = LaunchEnv().to_environ()
    assert set(empty.values()) == {""}  # every variable is written, so no stale inherited value survives
    assert LaunchEnv.from_environ(empty) == LaunchEnv()


def test_torch_fields_are_read_not_written():
    env = {
        launch_env.RESTART_COUNT: "2",
        launch_env.LOCAL_RANK: "3",
        launch_env.GROUP_RANK: "1",
        launch_env.LOCAL_WORLD_SIZE: "4",
    }
    got = LaunchEnv.from_environ(env)
    assert (got.restart_count, got.local_rank, got.group_rank, got.local_world_size) == (2, 3, 1, 4)
    assert not set(got.to_environ()) & set(env)


@pytest.mark.parametrize(
    "name, value, words",
    [
        (launch_env.LAUNCH_TIME, "yesterday", "Unix seconds"),
        (launch_env.END_TIME, "1e", "Unix seconds"),
        (launch_env.LOCAL_RANK, "-1", "≥ 0"),
        (launch_env.RESTART_COUNT, "two", "≥ 0"),
        (launch_env.INJECT, "[1, 2]", "list of objects"),
        (launch_env.INJECT, "{oops", "not JSON"),
    ],
)
def test_bad_values_name_the_variable(name, value, words):
    with pytest.raises(LaunchEnvError) as e:
        LaunchEnv.from_environ({name: value})
    assert name in str(e.value) and repr(value) in str(e.value) and words in str(e.value)


def test_an_override_with_a_newline_cannot_be_passed():
    with pytest.raises(LaunchEnvError, match="newline"):
        LaunchEnv(overrides=("a.b=1\nc.d=2",)).to_environ()


def test_rank_side_readers_use_it(monkeypatch, tmp_path):
    """config_from_argv and JobEndTime read what the launcher wrote; a bad value is a ConfigError."""
    for name, value in (
        LaunchEnv(
            run_dir=tmp_path / "run",
            overrides=("stop.time_margin=7",),
            inject=({"kind": "rank_killed", "rank": 0, "step": 3},),
            end_time=1234.5,
        )
        .to_environ()
        .items()
    ):
        monkeypatch.setenv(name, value)
    cfg = config_from_argv(argv=["--set", "checkpoint.interval=3"])
    assert cfg.run.dir == tmp_path / "run" and cfg.stop.time_margin == 7 and cfg.checkpoint.interval == 3
    assert [(s.kind, s.step) for s in cfg.faults.inject] == [("rank_killed", 3)]
    assert JobEndTime().get() == 1234.5
    monkeypatch.setenv(launch_env.INJECT, "not json")
    with pytest.raises(ConfigError, match=launch_env.INJECT):
        config_from_argv(argv=[])


def _string_constants(path: Path) -> list[str]:
    """String literals of a module, docstrings excluded."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]


def test_every_variable_is_named_in_launch_env_only():
    """No other module spells a name, not even inside a longer string (a script template, say)."""
    owners = {
        name: sorted(
            str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if any(name in text for text in _string_constants(p))
        )
        for name in NAMES
    }
    assert owners == {name: ["launch_env.py"] for name in NAMES}


def test_the_module_imports_only_the_standard_library():
    code = (
        "import sys, trainguard.launch_env; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pydantic', 'numpy', 'psutil')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
