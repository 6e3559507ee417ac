"""The hang supervisor's advice (trainguard.supervisor.advice): in the terms of the rank's framework,
read from a real stack dump, and never for a stopped rank."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import wait_for
from trainguard.supervisor.advice import HF, LIGHTNING, PLAIN, is_stopped, section_advice
from trainguard.supervisor.stacks import dump_complete

# each framework's frames as faulthandler writes them (a real dump of a process that imports it
# would need Lightning's or transformers' import in the test: seconds); the dump of a real process below
FRAMES = {
    "lightning": '  File "/venv/lib/python3.11/site-packages/lightning/pytorch/loops/fit_loop.py", line 217 in run',
    "pytorch_lightning": '  File "/venv/lib/python3.11/site-packages/pytorch_lightning/loops/fit_loop.py", line 217 in run',
    "transformers": '  File "/venv/lib/python3.11/site-packages/transformers/trainer.py", line 2330 in _inner_training_loop',
    "plain": '  File "/work/train.py", line 80 in main',
}


@pytest.mark.parametrize(
    "frame, advice",
    [("lightning", LIGHTNING), ("pytorch_lightning", LIGHTNING), ("transformers", HF), ("plain", PLAIN)],
)
def test_the_advice_names_what_the_rank_s_framework_offers(tmp_path, frame, advice):
    dump = tmp_path / "stacks.txt"
    dump.write_text(f"Current thread 0x00007f (most recent call first):\n{FRAMES[frame]}\n")
    assert section_advice(dump) == advice
    assert ("callback.guard.section" in advice) == (frame != "plain")


def test_no_stack_dump_gives_the_plain_loop_s_advice(tmp_path):
    assert section_advice(None) == PLAIN and section_advice(tmp_path / "missing.txt") == PLAIN


def test_a_real_stack_dump_of_a_plain_script_gives_the_plain_advice(tmp_path):
    dump = tmp_path / "dump.txt"
    code = textwrap.dedent(f"""
        import faulthandler
        with open({str(dump)!r}, "w") as f:
            faulthandler.dump_traceback(f)
    """)
    subprocess.run([sys.executable, "-c", code], check=True)
    assert dump_complete(dump.read_text()) is not None
    assert section_advice(dump) == PLAIN


def test_a_sigstopped_process_is_stopped_and_a_running_one_is_not():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert not is_stopped(proc.pid)
        proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: is_stopped(proc.pid), timeout=30, what="the SIGSTOP to take effect")
        proc.send_signal(signal.SIGCONT)
    finally:
        proc.kill()
        proc.wait()
    assert not is_stopped(proc.pid) and not is_stopped(None)
