"""Light imports: the operator commands (``trainguard --help``, ``report``, ``watch``, ``slurm script``)
and ``import trainguard`` load no torch; the package's public names resolve lazily; a missing
optional extra (matplotlib, apprise) is named by the feature that needs it. Every check runs a
real interpreter in a subprocess, so what the test process imported itself does not count. And
trainguard's modules import one another without a cycle (read from their syntax trees)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONSOLE_SCRIPT = Path(sys.executable).parent / "trainguard"


def run(args: list[str], env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``args`` with Python's import profiler on; stdout and stderr as text."""
    full_env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1", **(env or {})}
    return subprocess.run(args, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def imported(stderr: str) -> set[str]:
    """The modules an ``-X importtime`` run imported, from its ``import time: self | cum | name`` lines."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":  # the header line
                names.add(name)
    return names


def heavy(stderr: str) -> list[str]:
    """The torch modules (and the other heavy libraries) among those imported."""
    mods = imported(stderr)
    assert mods, "no import profile in the output: " + stderr[-2000:]
    return sorted(m for m in mods if m.split(".")[0] in ("torch", "matplotlib", "apprise", "pynvml", "numpy"))


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainguard.cli", *args]


def ev(t: float, kind: str, step=None, rank=0, attempt=0, **details) -> dict:
    return {
        "time": 1000.0 + t,
        "rank": rank,
        "kind": kind,
        "step": step,
        "attempt": attempt,
        "pid": 1,
        "details": details,
    }


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A finished run's directory with a small, hand-made event log (and a training script)."""
    run = tmp_path / "run"
    run.mkdir()
    log = [
        ev(0, "launch", rank=None),
        ev(1, "workers_started", rank=None, restart=0),
        ev(10, "start", 0, first_step=0, resumed_from=None),
        ev(20, "checkpoint_committed", 10, bytes=100, seconds=1.0, reason="interval"),
        ev(60, "end", 30, state_sha256="x"),
        ev(62, "launch_exit", rank=None, code=0, reason="finished", seconds=62),
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    (tmp_path / "train.py").write_text("print('training')\n")
    return run


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["report", "--help"],
        ["watch", "--help"],
        ["slurm", "script", "--help"],
        ["slurm", "submit", "--help"],
    ],
    ids=" ".join,
)
def test_help_imports_no_torch(args):
    proc = run(cli(*args))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Usage" in proc.stdout
    assert heavy(proc.stderr) == []


def test_console_script_help_imports_no_torch():
    assert CONSOLE_SCRIPT.exists(), CONSOLE_SCRIPT
    proc = run([str(CONSOLE_SCRIPT), "--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "report" in proc.stdout and "watch" in proc.stdout
    assert heavy(proc.stderr) == []


def test_report_imports_no_torch(run_dir, tmp_path):
    proc = run(cli("report", str(run_dir), "--json", "--png", str(tmp_path / "t.png")))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["status"] and (tmp_path / "t.png").stat().st_size > 0
    mods = heavy(proc.stderr)
    assert "matplotlib" in mods and not [m for m in mods if m.split(".")[0] == "torch"], mods


def test_watch_pass_imports_no_torch(run_dir):
    proc = run(cli("watch", str(run_dir)))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "hang: ok: the run has ended" in proc.stdout
    assert heavy(proc.stderr) == []


def test_slurm_script_imports_no_torch(run_dir, tmp_path):
    proc = run(cli("slurm", "script", "--run-dir", str(run_dir), "--time", "60", str(tmp_path / "train.py")))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("#!/bin/bash") and "#SBATCH --time=" in proc.stdout
    assert heavy(proc.stderr) == []


@pytest.mark.parametrize(
    "module",
    [
        "trainguard",
        "trainguard.report",
        "trainguard.watch",
        "trainguard.outcomes",
        "trainguard.config",
        "trainguard.slurm.script",
    ],
)
def test_import_leaves_torch_out(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


LAZY_CHECK = """
import importlib, sys, trainguard
assert "torch" not in sys.modules
assert set(trainguard.__all__) <= set(dir(trainguard))
assert len(trainguard.__all__) == len(set(trainguard.__all__))
for name in trainguard.__all__:
    value = getattr(trainguard, name)
    if name == "dist":
        assert value is importlib.import_module("trainguard.dist")
    else:
        assert value is getattr(importlib.import_module(value.__module__), name), name
from trainguard import Guard, Config, ResumableSampler, Requeue, GiveUp, BadInput, Outcome, ExitCode
assert Guard is importlib.import_module("trainguard.guard").Guard
assert issubclass(Requeue, Outcome) and issubclass(GiveUp, Outcome) and issubclass(BadInput, Outcome)
assert (Requeue.exit_code, GiveUp.exit_code, BadInput.exit_code) == (ExitCode.REQUEUE, ExitCode.GIVE_UP, ExitCode.BAD_INPUT)
assert "torch" in sys.modules  # the rank-side names brought it in
try:
    trainguard.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
else:
    raise AssertionError("no AttributeError")
print("ok")
"""


def test_public_names_resolve_lazily():
    proc = subprocess.run([sys.executable, "-c", LAZY_CHECK], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_public_names_cover_the_documented_api():
    code = "import trainguard; print(' '.join(trainguard.__all__))"
    names = set(
        subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
        ).stdout.split()
    )
    assert {
        "Guard",
        "Config",
        "ConfigError",
        "Section",
        "ResumableSampler",
        "Checkpoint",
        "CheckpointStore",
        "CheckpointMismatchError",
        "EventLog",
        "Hook",
        "read_events",
        "ExitCode",
        "exit_bad_input",
        "config_from_argv",
        "load_config",
        "seed_everything",
        "state_hash",
        "dist",
        "Outcome",
        "Requeue",
        "GiveUp",
        "BadInput",
    } <= names


def without(module: str, *args: str) -> subprocess.CompletedProcess:
    """Run the CLI with ``args`` in an interpreter where ``module`` cannot be imported (as if the
    extra that brings it were not installed)."""
    code = (
        f"import sys; sys.modules[{module!r}] = None; sys.argv = ['trainguard', *sys.argv[1:]]; "
        "from trainguard.cli import main; main()"
    )
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_report_without_matplotlib(run_dir, tmp_path):
    png = tmp_path / "asked.png"
    proc = without("matplotlib", "report", str(run_dir), "--png", str(png))
    assert proc.returncode == 2, proc.stderr
    assert "trainguard: error:" in proc.stderr and "pip install 'trainguard[report]'" in proc.stderr
    assert "Traceback" not in proc.stderr and not png.exists()

    proc = without("matplotlib", "report", str(run_dir))  # the default picture is a bonus: the report goes on
    assert proc.returncode == 0, proc.stderr
    assert "trainguard: warning:" in proc.stderr and "trainguard[report]" in proc.stderr
    assert "Picture: not written" in proc.stdout and not (run_dir / "report.png").exists()


def test_watch_without_apprise(run_dir):
    proc = without("apprise", "watch", str(run_dir), "--notify", "json://127.0.0.1:9/hook")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "trainguard: error:" in proc.stderr and "pip install 'trainguard[watch]'" in proc.stderr
    assert "Traceback" not in proc.stderr

    proc = without("apprise", "watch", str(run_dir))  # nothing to notify: apprise is not needed
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hang: ok" in proc.stdout


def test_optional_dependencies_are_extras():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]
    for extra, package in (
        ("report", "matplotlib"),
        ("watch", "apprise"),
        ("gpu", "nvidia-ml-py"),
        ("lightning", "lightning"),
        ("hf", "transformers"),
        ("hf", "accelerate"),
    ):
        assert package not in core
        assert any(req.startswith(package) for req in extras[extra]), extra
    assert extras["all"] == ["trainguard[report,watch,gpu,lightning,hf]"]


def test_run_help_names_where_faults_are_described_and_the_console_flags():
    proc = run(cli("run", "--help"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(see )" not in proc.stdout and "docs/launcher.md" in proc.stdout
    assert "--quiet" in proc.stdout and "--verbose" in proc.stdout


def test_checkpoints_lists_whole_paths(run_dir):
    """``trainguard checkpoints`` prints each checkpoint's whole path, however long (it was cut at
    80 columns when not on a terminal)."""
    deep = run_dir / "checkpoints" / ("a-long-directory-name-" * 3)
    (run_dir / "config.toml").write_text(f'[checkpoint]\ndir = "{deep}"\n')
    (deep / "step-00000010").mkdir(parents=True)
    proc = run(cli("checkpoints", str(run_dir), "--verify", "size"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert str(deep / "step-00000010") in proc.stdout, proc.stdout


# ------------------------------------------------------------------------------------------------
# no import cycles among trainguard's modules

PACKAGE = REPO / "src" / "trainguard"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: the trainguard modules it imports}`` (``from . import x`` names the submodule ``x``
    where there is one, else the package). Every import counts: at the top, under ``if
    TYPE_CHECKING:`` (a type checker follows it) and inside functions (a lazy import is still a
    dependency: one of the two modules should not need the other)."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    edges.add(sub if sub in files else base)
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_cycles_through_lazy_and_type_checking_imports_and_none_in_a_chain(tmp_path):
    pkg = tmp_path / "trainguard"
    (pkg / "guard").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "guard" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from . import a  # lazy\n")
    (pkg / "c.py").write_text("from . import b\n")  # a chain into the cycle, not part of it
    (pkg / "guard" / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .e import P\n")
    (pkg / "guard" / "e.py").write_text("from .. import c\nfrom . import d\n")
    graph = import_graph(pkg)
    assert graph["trainguard.a"] == {"trainguard.b"} and graph["trainguard.guard.e"] == {
        "trainguard.c",
        "trainguard.guard.d",
    }
    assert sorted(cycles(graph)) == [["trainguard.a", "trainguard.b"], ["trainguard.guard.d", "trainguard.guard.e"]]


def test_trainguards_modules_import_one_another_without_a_cycle():
    graph = import_graph()
    assert "trainguard.guard.place" in graph["trainguard.guard.sharded_recovery"]
    assert cycles(graph) == []
