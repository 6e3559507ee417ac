"""Every benchmark still runs: each script in ``benchmarks/`` at its smallest sizes (``--smoke``).

Run by ``scripts/bench_smoke.sh`` (and CI after the test suite), not by ``scripts/test.sh``.

A benchmark reports, it does not assert, so nothing else notices when a change elsewhere breaks
one (a new config check, a changed script interface): these tests run each script as its own
process, the way a person would, and check that it exits 0 and prints its tables. ``--smoke``
numbers mean nothing; only the path is checked. The recovery benchmarks' smoke modes also exit 1
when a fault was not recovered from or a hang not detected.

A new script in ``benchmarks/`` (not starting with ``_`` or ``test_``) needs a ``--smoke`` mode and an entry in
``SMOKE`` below; ``test_every_benchmark_has_a_smoke_run`` fails until it has both.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"

# script → (extra arguments after --smoke, text its output must contain: the start of each table's
# title, or of a closing line that needs every measurement)
SMOKE: dict[str, tuple[list[str], list[str]]] = {
    "step_overhead.py": ([], ["Guard step overhead", "final save per run", "block medians"]),
    "instability_overhead.py": ([], ["Instability detectors", "per guard.should_step() call"]),
    "oom_overhead.py": ([], ["OOM guard on normal steps", "a recovered out-of-memory step"]),
    "health_overhead.py": ([], ["straggler timing + liveness ping", "pings completed"]),
    "checkpoint_throughput.py": ([], ["Checkpoint write throughput", "save_state, 1 rank", "save_state, 2 ranks"]),
    "async_checkpoint.py": ([], ["| method | training blocked", "| write throughput / dd conv=fsync"]),
    "sigterm_latency.py": ([], ["SIGTERM → exit of", "exit codes [75]"]),
    "heartbeat_cost.py": ([], ["cost per call on the rank", "supervisor cost per training step"]),
    "state_hash_cost.py": ([], ["ddp world=2", "fsdp world=2", "same digest on all ranks: True"]),
    # the suite's time: one mode (a SIGSTOP hang and its restart; the collective hang is tested in
    # tests/test_supervisor.py), and trainguard's kill only (its hang path is the one above)
    "hang_detection.py": (["--modes", "sigstop"], ["hang detection of `trainguard run`", "hang steps"]),
    # ft_launcher has a test of its own below (skipped where it is not installed)
    "recovery_compare.py": (
        ["--launchers", "inprocess,trainguard", "--faults", "kill"],
        ["fault on rank 1 at step", "phases of the recovery", "in-process"],
    ),
    "goodput_faults.py": ([], ["goodput of the example GPT", "| in-process", "| restart"]),
    "plain_loop_kills.py": ([], ["README plain loop", "| in-process | 1 | 1/1 | 1/1", "| restart |"]),
    "node_loss.py": (
        [],
        ["ddp: examples/plain_loop.py", "| spare node | 1 | 1/1 | 1/1", "| group restart |", "boundary copy per step"],
    ),
    "inprocess_overhead.py": ([], ["steady-state step time with in-process recovery", "| on, warm spare", "overhead"]),
    "membership_scale.py": ([], ["membership decisions at scale", " 4096 ", "flat in the world size: met"]),
    "sdc_overhead.py": ([], ["SDC replica check vs a training step", "default interval (100)"]),
    "boundary_keep.py": ([], ["one step boundary kept", "draws no host random number", "share of 3 / 7 / 30 ms"]),
    "snapshot_stall.py": ([], ["a sharded model's snapshot vs the asynchronous save", "| snapshot |", "loopback"]),
    "per_step_cost.py": ([], ["trainguard's cost per step", "own collectives / step", "load average"]),
    "comm_hook_cost.py": ([], ["riding in a gradient bucket", "trainguard's hook", "load average"]),
    # one framework (the Hugging Face path runs in tests/test_hf.py)
    "framework_overhead.py": (["--frameworks", "lightning"], ["framework callback step overhead", "| lightning |"]),
    "zoo_kills.py": ([], ["zoo kills: 2 ranks", "| resume_barrier | in-process |", "goal: in-process"]),
    "jit_restart.py": (
        [],
        ["just-in-time save: 2 ranks", "| resume_barrier | restart+jit |", "goal: with the just-in-time"],
    ),
}
NVRX = Path("/tmp/nvrx")  # recovery_compare.py's default --nvrx


def _scripts() -> list[str]:
    return sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith(("_", "test_")))


def _run(script: str, *args: str) -> str:
    """Run ``benchmarks/SCRIPT --smoke ARGS`` from the repository root; its output (stdout + stderr)."""
    try:  # the cap only ends a stuck run (each smoke run takes seconds to a minute, on a loaded machine a few)
        proc = subprocess.run(
            [sys.executable, str(BENCH / script), "--smoke", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=840,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{script} --smoke still running after {e.timeout:.0f} s:\n" + "\n".join(out.splitlines()[-60:]))
    tail = "\n".join(proc.stdout.splitlines()[-60:])
    assert proc.returncode == 0, f"{script} --smoke exited with {proc.returncode}:\n{tail}"
    return proc.stdout


def test_every_benchmark_has_a_smoke_run():
    missing = [s for s in _scripts() if s not in SMOKE]
    assert not missing, f"benchmarks without a smoke run: {missing}: give each a --smoke mode and an entry in SMOKE"


@pytest.mark.slow
@pytest.mark.timeout(900)  # above _run's own cap
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_smoke(script: str):
    args, expected = SMOKE[script]
    out = _run(script, *args)
    missing = [text for text in expected if text not in out]
    assert not missing, f"{script} --smoke did not print {missing}:\n" + "\n".join(out.splitlines()[-60:])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_recovery_compare_ft_launcher_smoke():
    exe = NVRX / "bin" / "ft_launcher"
    if not exe.exists():
        pytest.skip(f"NVIDIA ft_launcher is not installed ({exe} not found; recovery_compare.py --help says how)")
    probe = subprocess.run(
        [str(NVRX / "bin" / "python"), "-c", "import nvidia_resiliency_ext.fault_tolerance"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(
            f"{NVRX} has no importable nvidia_resiliency_ext: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
        )
    out = _run("recovery_compare.py", "--launchers", "ft", "--faults", "kill", "--nvrx", str(NVRX))
    assert "fault on rank 1 at step" in out and "ft_launcher not run" not in out, out[-3000:]
