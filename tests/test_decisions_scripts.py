"""Decisions about real training scripts, each in one process: is a silent rank busy (its main
thread's CPU time, real processes), is a failure a script error not worth a restart, can a resume be
bitwise identical, where a script with its own command line gets its config."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import trainguard
from trainguard.launcher.script_error import decide, read_tail, traceback_tail
from trainguard.ranks import Ranks
from trainguard.state.fidelity import WATCHED_STEPS, DrawWatch, ResumeFidelity, differences, environment
from trainguard.supervisor.evidence import (
    BUSY_SHARE,
    WINDOW,
    CpuMeter,
    main_thread_cpu,
    main_thread_io,
    main_thread_sched,
)

TRACEBACK = """step 0 setting up
Traceback (most recent call last):
  File "train.py", line 12, in <module>
    main()
  File "train.py", line 8, in main
    data = open(args.data).read()
FileNotFoundError: [Errno 2] No such file or directory: 'missing.bin'
"""
CONNECTION = TRACEBACK.replace(
    "FileNotFoundError: [Errno 2] No such file or directory: 'missing.bin'",
    "torch.distributed.DistNetworkError: The client socket has timed out while trying to connect to (node0, 29500).",
)

READ_ERROR = TRACEBACK.replace(
    "FileNotFoundError: [Errno 2] No such file or directory: 'missing.bin'",
    "trainguard.checkpoint.manifest.ReadError: [Errno 5] the checkpoint to resume from could not be chosen (rank 0)",
)


def _meter_verdict(code: str) -> tuple[float, float, bool]:
    """Run ``code`` in a child whose *main thread* does it, sample it over a window, return
    (share of a core, demand: share of the time running or runnable, busy)."""
    child = subprocess.Popen([sys.executable, "-c", READY + code], stdout=subprocess.PIPE)
    try:
        meter = CpuMeter()
        assert child.stdout.readline() == b"ready\n"  # past the interpreter's start, however slow
        end = time.monotonic() + WINDOW * 1.5
        while time.monotonic() < end:
            meter.sample(child.pid, time.monotonic())
            time.sleep(0.05)
        return meter.share(child.pid), meter.demand(child.pid), meter.busy(child.pid)
    finally:
        child.kill()
        child.wait()


READY = "import sys; print('ready', flush=True)\n"
SPIN = "while True: sum(range(1000))"
WAITING = (
    "import threading\n"
    "threading.Thread(target=lambda: [sum(range(1000)) for _ in iter(int, 1)], daemon=True).start()\n"
    "threading.Lock().acquire(); threading.Lock().acquire(); threading.Event().wait()\n"
)


@pytest.mark.parametrize("load", [0, 5])
def test_a_computing_main_thread_is_busy_a_waiting_one_is_not_however_loaded_the_host(load):
    """A main thread in a Python loop (an evaluation) wants a core; one that waits on a lock while
    another thread of the same process spins (a rank stuck in a collective while its background
    threads run) wants none: only the main thread counts. With ``load`` more spinning processes on
    the host (on 2 cores: 7 runnable), the busy one gets a fraction of a core and waits for the
    rest in the run queue: it is still busy (its CPU share alone fell under the threshold before)."""
    hogs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(load)]
    try:
        share, demand, busy = _meter_verdict(SPIN)
        if main_thread_sched(os.getpid()) is not None:  # schedstats: the demand, not the share
            assert busy and demand >= 0.8, (share, demand)
        else:
            assert busy or load, (share, demand)
        share, demand, busy = _meter_verdict(WAITING)
        assert not busy and demand < BUSY_SHARE, (share, demand)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


SLOW_READ = (
    "import os, time\nfd = os.open('/dev/zero', os.O_RDONLY)\nwhile True:\n    os.read(fd, 4096); time.sleep(0.1)\n"
)


def test_a_main_thread_in_slow_io_that_makes_progress_is_busy_not_hung():
    """A rank reading from a slow file system: its main thread hardly uses a core (it sleeps in the
    read) but bytes keep moving through its own system calls: slow, not hung. A main thread asleep
    on a lock moves none."""
    meter = CpuMeter()
    child = subprocess.Popen([sys.executable, "-c", SLOW_READ])
    try:
        time.sleep(0.3)
        end = time.monotonic() + WINDOW * 1.5
        while time.monotonic() < end:
            meter.sample(child.pid, time.monotonic())
            time.sleep(0.05)
        if main_thread_io(child.pid) is None:
            pytest.skip("no /proc/PID/task/PID/io on this kernel")
        assert meter.demand(child.pid) < BUSY_SHARE and meter.io(child.pid) > 0 and meter.busy(child.pid)
    finally:
        child.kill()
        child.wait()
    share, demand, busy = _meter_verdict(WAITING)
    assert not busy, (share, demand)


def test_cpu_of_a_gone_process_is_unknown_and_never_busy():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert main_thread_cpu(child.pid) is None
    meter = CpuMeter()
    meter.sample(child.pid, time.monotonic())
    assert meter.share(child.pid) is None and not meter.busy(child.pid) and not meter.busy(None)


def test_script_error_before_the_first_step_is_not_restarted():
    stderr = {0: TRACEBACK, 1: TRACEBACK}
    error = decide(True, {0: 1, 1: 1}, {0: None, 1: 0}, stderr)
    assert error is not None and error.rank == 0 and error.exit_code == 1
    assert error.lines[0].startswith("Traceback") and error.lines[-1].startswith("FileNotFoundError")
    assert "missing.bin" in error.reason and "not restarted" in error.reason
    # the peer killed by the launcher (SIGKILL) is not looked at
    assert decide(True, {0: 1, 1: -9}, {0: 0, 1: 0}, {0: TRACEBACK, 1: ""}) is not None


@pytest.mark.parametrize(
    ("first", "codes", "done", "stderr", "why"),
    [
        (False, {0: 1}, {0: 0}, {0: TRACEBACK}, "a later group: the first one trained"),
        (True, {0: 1}, {0: 0, 1: 3}, {0: TRACEBACK}, "a rank completed steps"),
        (True, {0: -9}, {0: 0}, {0: ""}, "killed by a signal only"),
        (True, {0: 1}, {0: 0}, {0: "Segmentation fault\n"}, "no traceback"),
        (True, {0: 1}, {0: 0}, {0: CONNECTION}, "a connection failure: retried"),
        (True, {0: 1, 1: 1}, {0: 0, 1: 0}, {0: TRACEBACK, 1: CONNECTION}, "one rank's failure is transient"),
        (True, {0: 1}, {0: 0}, {0: READ_ERROR}, "the resume's checkpoint read failed: a restart retries it"),
    ],
)
def test_failures_a_restart_can_cure_are_restarted(first, codes, done, stderr, why):
    assert decide(first, codes, done, stderr) is None, why


def test_torchs_rank_prefix_is_read_through():
    """After ``init_process_group`` torch's excepthook puts ``[rank<N>]: `` before every line."""
    prefixed = "\n".join(f"[rank1]: {line}" if line else "" for line in TRACEBACK.splitlines())
    error = decide(True, {1: 1}, {1: 0}, {1: prefixed})
    assert error is not None and error.lines == traceback_tail(TRACEBACK), error
    assert error.lines[1] == '  File "train.py", line 12, in <module>'


def test_an_error_after_the_training_loop_is_not_restarted_and_its_peers_are_not_looked_at():
    """A rank past its training loop (``finished``) with a script's traceback: not restarted, in
    any group, whatever its peers died of; one that failed of a lost peer, or not past its loop, is."""
    error = decide(False, {0: 1, 1: 1}, {0: 60, 1: 60}, {0: TRACEBACK, 1: CONNECTION}, frozenset({0, 1}))
    assert error is not None and error.rank == 0 and error.after_loop and "after its training loop" in error.reason
    assert decide(True, {1: 1, 0: -9}, {0: 6, 1: 6}, {1: TRACEBACK}, frozenset({1})).rank == 1
    assert decide(True, {0: 1}, {0: 6}, {0: CONNECTION}, frozenset({0})) is None
    assert decide(True, {0: 1}, {0: 6}, {0: TRACEBACK}, frozenset({1})) is None
    assert decide(True, {0: 1}, {0: 6}, {0: "Segmentation fault\n"}, frozenset({0})) is None


def test_traceback_tail_takes_the_last_traceback_and_caps_it(tmp_path):
    text = TRACEBACK + "\nDuring handling...\n" + TRACEBACK.replace("missing.bin", "other.bin")
    tail = traceback_tail(text)
    assert "other.bin" in tail[-1]
    long = (
        "Traceback (most recent call last):\n"
        + '  File "x.py", line 1, in f\n    f()\n' * 50
        + "RecursionError: deep\n"
    )
    assert len(traceback_tail(long)) == 12 and traceback_tail(long)[-1] == "RecursionError: deep"
    assert traceback_tail("no error here\n") is None
    path = tmp_path / "stderr.log"
    path.write_text("x" * 20000 + "\n" + TRACEBACK)
    assert read_tail(path).endswith(TRACEBACK) and read_tail(tmp_path / "absent") == "" and read_tail(None) == ""


def test_resume_fidelity_names_what_changed():
    saved = environment(2)
    fid = ResumeFidelity(Ranks(0, 2))
    fid.load_state_dict(saved)
    assert fid.changed == []
    fid.load_state_dict({**saved, "threads": saved["threads"] + 3, "world_size": 4, "unknown_key": 1})
    assert fid.changed == [f"threads {saved['threads'] + 3} → {saved['threads']}", "world_size 4 → 2"]
    fid.load_state_dict(None)  # a checkpoint written before this part existed
    assert fid.changed == []
    assert differences({"torch": "2.0"}, {"torch": torch.__version__}) == [f"torch 2.0 → {torch.__version__}"]


def test_draw_watch_finds_draws_between_step_end_and_the_next_step():
    watch = DrawWatch()
    assert not watch.before_loop()  # nothing drawn since the Guard was created
    for _ in range(2):  # draws inside the step only
        torch.rand(1)
        watch.boundary()
        assert not watch.next_step()
    watch.boundary()
    torch.randint(10, (4,))  # the next batch, fetched after step_end()
    assert watch.next_step()
    watch.boundary()  # reported once, then no more looking
    torch.rand(1)
    assert not watch.next_step()


@pytest.mark.parametrize(
    "draw",
    [lambda: np.random.randint(10, size=4), lambda: random.random(), lambda: torch.randint(10, (4,))],
    ids=["numpy", "python", "torch"],
)
def test_draw_watch_finds_the_next_batch_drawn_with_any_generator_a_checkpoint_restores(draw):
    """A loop that samples its batch indices with ``np.random`` (or ``random``, or torch) after
    ``step_end()``: reported once; the same draws inside the step are not."""
    watch = DrawWatch()
    watch.before_loop()
    draw()  # inside the first step
    watch.boundary()
    assert not watch.next_step()
    watch.boundary()
    draw()  # after step_end()
    assert watch.next_step()
    watch.boundary()
    draw()
    assert not watch.next_step()  # once


def test_draw_watch_finds_a_first_batch_drawn_before_the_loop():
    watch = DrawWatch()
    torch.randint(10, (4,))
    assert watch.before_loop()


def test_draw_watch_finds_a_new_epochs_dataloader_draw_far_into_a_steps_loop():
    """An epoch loop (``for batch in loader`` inside the epoch loop, the ImageNet example's shape):
    the ``DataLoader`` iterator of each new epoch draws its base seed from torch's generator
    between one epoch's last ``step_end()`` and the next epoch's first step; found at the first
    epoch's end, however many clean steps came before, and said once."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2)
    watch = DrawWatch()
    watch.before_loop()
    found = []
    for _epoch in range(3):
        for _batch in loader:  # the draw, as each epoch's iterator is created
            found.append(watch.next_step())  # steps() resumes: the loop asks for the next step
            watch.boundary()  # the step's end
    assert found.count(True) == 1 and found.index(True) == 4  # epoch 1's first step, after 4 clean ones
    assert WATCHED_STEPS < 4


def test_draw_watch_keeps_no_state_after_a_few_boundaries_when_no_one_asks():
    """The framework callbacks call ``boundary()`` (in ``step_end()``) but never ``next_step()``:
    the watch stops copying the generators after :data:`WATCHED_STEPS` boundaries all the same."""
    watch = DrawWatch()
    watch.before_loop()
    for _ in range(WATCHED_STEPS):
        watch.boundary()
    torch.rand(1)
    watch.boundary()  # past the watched steps: nothing kept, so nothing to compare
    assert not watch.next_step()


def test_config_from_env_ignores_the_scripts_arguments(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "config/tiny.py", "--eval_interval=50", "--set", "x"])
    monkeypatch.setenv("TRAINGUARD_SET", "checkpoint.interval=7\nstop.check_interval=3")
    cfg = trainguard.config_from_env()
    assert cfg.checkpoint.interval == 7 and cfg.stop.check_interval == 3
    with pytest.raises(trainguard.ConfigError, match="config_from_env"):
        trainguard.config_from_argv()


def test_torch_elastic_lines_are_dropped_unless_verbose_and_decision_codes_always(monkeypatch, capsys):
    """Torch elastic's "failed (exitcode: 75)" for a requeue is not an error: dropped at every level;
    a real failure's line and "Sending process ... closing signal" only at ``verbose`` (trainguard's
    own line names the ranks and codes). ``quiet`` silences trainguard's story lines but not its
    warnings."""
    import logging

    from trainguard import console

    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    console.quiet_torch_elastic((2, 75, 76))
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    msg = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
    try:
        for lvl in ("normal", "verbose"):
            monkeypatch.setenv(console.LEVEL_ENV, lvl)
            logger.error(msg, 75, 0, 123, "python")
            logger.error(msg, 1, 0, 124, "python")
            logger.warning("Sending process %s closing signal %s", 125, "SIGTERM")
            logger.warning("something else %s", lvl)
    finally:
        logger.removeHandler(handler)
    assert seen == [
        "something else normal",
        "failed (exitcode: 1) local_rank: 0 (pid: 124) of binary: python",
        "Sending process 125 closing signal SIGTERM",
        "something else verbose",
    ]
    monkeypatch.setenv(console.LEVEL_ENV, "normal")
    console.say("story")
    monkeypatch.setenv(console.LEVEL_ENV, "quiet")
    console.say("hidden")
    console.warn("careful")
    err = capsys.readouterr().err
    assert "trainguard: story" in err and "hidden" not in err and "trainguard: warning: careful" in err


PEER_LOSS_SCRIPT = """
import sys
from trainguard import console
from trainguard.rejoin.protocol import is_peer_failure
console.quiet_peer_loss(is_peer_failure, lambda error, text: print("RECORDED", error, "|", "loss_backward" in text))
def loss_backward():
    raise RuntimeError(sys.argv[1])
loss_backward()
"""


@pytest.mark.parametrize(
    "message,level,quiet",
    [
        ("[gloo/pair.cc:537] Read error [127.0.0.1]:3739: Connection reset by peer", "normal", True),
        ("[gloo/pair.cc:537] Read error [127.0.0.1]:3739: Connection reset by peer", "verbose", False),
        ("shape mismatch: a bug of the script", "normal", False),
    ],
)
def test_a_rank_that_lost_a_peer_says_so_in_one_line_unless_verbose(tmp_path, message, level, quiet):
    """A real process dies of an uncaught error: a lost peer's traceback is recorded (at every
    level) and told in one line (below ``verbose``); any other error keeps its traceback. The exit
    code stays 1."""
    script = tmp_path / "rank.py"
    script.write_text(PEER_LOSS_SCRIPT)
    env = {**os.environ, "TRAINGUARD_CONSOLE": level}
    r = subprocess.run([sys.executable, str(script), message], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    if quiet:
        assert "Traceback" not in r.stderr, r.stderr
        assert "RECORDED RuntimeError: [gloo/pair.cc:537] Read error" in r.stdout and "| True" in r.stdout
        assert "this rank lost a peer in loss_backward() (rank.py:7)" in r.stderr and "restarts the group" in r.stderr
    else:  # the traceback as Python prints it; a lost peer is still recorded (the Guard's event, its save)
        assert "Traceback" in r.stderr and message in r.stderr, r.stderr
        assert ("RECORDED" in r.stdout) == ("Read error" in message), r.stdout


def test_trainguard_lines_survive_a_script_that_silences_print_on_other_ranks():
    """torchvision's reference scripts (DETR, DeiT, MAE alike) replace ``builtins.print`` with one
    that drops every line on ranks other than 0 (``setup_for_distributed``): a replacement or a
    survivor of rank 1 would say nothing (found on torchvision's classification recipe, 2026-12-07).
    The console writes to stderr itself."""
    code = (
        "import builtins\n"
        "builtins.print = lambda *a, **k: None  # setup_for_distributed(False)\n"
        "from trainguard import console\n"
        "console.warn('a resume cannot be bitwise identical: test')\n"
        "console.say('recovered in-process: test')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        "trainguard: warning: a resume cannot be bitwise identical: test",
        "trainguard: recovered in-process: test",
    ]
