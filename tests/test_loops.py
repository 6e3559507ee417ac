"""The loops people write (docs/loops.md, examples/loops.py), each resumed bitwise: an epoch loop
over a ``DistributedSampler`` read through torchdata's ``StatefulDataLoader``, a ``next()`` loop
over a ``StatefulDataLoader`` with 2 worker processes, a hand-written update without a torch
optimizer, and a GRU whose hidden state is carried across batches. Each shape runs on 2 gloo ranks
under ``trainguard run``: once uninterrupted to 40 steps, once stopped at a checkpoint of a step
drawn at random (the epoch loop: at its first epoch's last batch, the hard case, then at a random
one) and relaunched with the same command to 40. The final weights must be the same bits, and
no resume may say it is not bitwise."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from conftest import events, finish, launch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "loops.py"
STEPS = 40
EPOCH = 16  # steps in the epoch loop's epoch: 512 samples, 2 ranks, 16 per batch


def run(run_dir: Path, shape: str, steps: int, digest: Path):
    sets = (f"loops.shape={shape}", f"loops.max_steps={steps}", f"loops.hash_file={digest}")
    return launch(run_dir, *sets, script=EXAMPLE, tiny=False, default_recovery=True)


@pytest.mark.soak  # 3 to 5 launches per shape, some with DataLoader workers (scripts/test_soak.sh)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("shape", ["epoch", "workers", "no_optimizer", "hidden"])
def test_each_loop_stopped_at_a_checkpoint_and_relaunched_ends_with_the_uninterrupted_weights(tmp_path, shape):
    pytest.importorskip("torchdata.stateful_dataloader")
    clean = tmp_path / "clean.sha256"
    assert finish(run(tmp_path / "clean", shape, STEPS, clean)) == 0, Path(f"{tmp_path / 'clean'}.log").read_text()
    stops = [random.Random(shape).randrange(5, STEPS - 5)]
    if shape == "epoch":
        stops.insert(0, EPOCH)
    for stop in stops:
        r, digest = tmp_path / f"stop{stop}", tmp_path / f"stop{stop}.sha256"
        for steps in (stop, STEPS):
            assert finish(run(r, shape, steps, digest)) == 0, Path(f"{r}.log").read_text()[-3000:]
        assert events(r, "resume")[0]["details"]["from_step"] == stop  # the relaunch's (the first launch is fresh)
        assert events(r, "resume_not_bitwise") == []
        assert digest.read_text() == clean.read_text(), f"{shape}: stopped at step {stop}, relaunched: other weights"
