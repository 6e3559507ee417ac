"""A warm spare's start (trainguard.rejoin.replacement): its output kept off the console until it
takes a rank, and the frameworks whose import reads the rank imported before it waits."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from trainguard.rejoin.replacement import COMPILER, FRAMEWORKS, frameworks_of


@pytest.mark.parametrize(
    "source, modules",
    [
        ("import lightning.pytorch as pl\n", ["lightning.pytorch"]),
        ("from lightning.pytorch import Trainer\n", ["lightning.pytorch"]),
        ("import pytorch_lightning as pl\n", ["pytorch_lightning"]),
        ("from trainguard.lightning import TrainguardCallback, pl\n", ["trainguard.lightning"]),
        (
            "from transformers import Trainer\nfrom trainguard.hf import TrainguardCallback\n",
            ["transformers", "trainguard.hf"],
        ),
        ("import torch\nimport lightningfast\n", []),  # a name that only starts alike
        ("def main():\n    import lightning\n", []),  # not at the top: left to the script
        ("from . import lightning\n", []),  # the script's own package
        ("this is not python(\n", []),
        ("import torch\ndef main():\n    if compile:\n        model = torch.compile(model)\n", [COMPILER]),
        ("from transformers import Trainer\nm = torch.compile(m)\n", ["transformers", COMPILER]),
        ("model.compile()\nre.compile('x')\n", []),  # other objects' compile
    ],
)
def test_the_frameworks_a_script_imports_at_its_top(tmp_path, source, modules):
    script = tmp_path / "train.py"
    script.write_text(source)
    assert frameworks_of(script) == modules
    assert all(m in FRAMEWORKS.values() or m == COMPILER for m in modules)


def test_a_spare_s_output_goes_to_its_file_until_it_takes_a_rank(tmp_path):
    """QuietOutput on the real file descriptors of a child process: what it prints (Python's
    print, a C-level write to fd 2) before release is in the file only, what it prints after is on
    its standard output."""
    log = tmp_path / "spares" / "spare-3.log"
    code = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from trainguard.rejoin.replacement import QuietOutput
        quiet = QuietOutput(Path({str(log)!r}))
        print("preamble: config dump")
        os.write(2, b"preamble: a warning\\n")
        quiet.release()
        quiet.release()
        print("after: rank 1", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "after: rank 1\n" and "preamble" not in out.stderr
    assert log.read_text().splitlines() == ["preamble: config dump", "preamble: a warning"] or set(
        log.read_text().splitlines()
    ) == {"preamble: config dump", "preamble: a warning"}
