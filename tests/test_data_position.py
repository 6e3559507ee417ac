"""The data position after a resume (src/trainguard/state/datapos.py): a DataLoader whose position
the checkpoint does not hold is named at the first step of a resumed process, never silent. The
watch on real DataLoaders in one process, then real launches of tests/data_position_worker.py (a
GPT trainer's ``iter``/``next`` loop over ``RandomSampler(replacement=True)`` with 2 workers)
resumed from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, TensorDataset

from conftest import events, finish, launch
from trainguard import ResumableSampler, compat
from trainguard.state.datapos import DataWatch, known_objects
from trainguard.state.trainstate import TrainState

WORKER = Path(__file__).resolve().parent / "data_position_worker.py"
DATA = TensorDataset(torch.arange(32.0).unsqueeze(1))


def first_step(loaders, known=(), forward_first=False):
    """Arm a watch with the objects ``known``, draw one batch from each loader (the model's forward
    before them with ``forward_first``), end the step; returns what was reported."""
    said = []
    model = torch.nn.Linear(1, 1)
    watch = DataWatch()
    assert watch.arm(model, known, said.append) and watch.armed
    iterators = [iter(loader) for loader in loaders]
    if forward_first:
        model(torch.zeros(1, 1))
    for it in iterators:
        next(it)
    model(torch.zeros(1, 1))
    next(iterators[0])  # after the step's forward: not looked at
    watch.disarm()
    assert not watch.armed
    return said


def test_a_loader_whose_position_is_not_saved_is_named_and_a_saved_one_is_not():
    replacement = DataLoader(DATA, batch_size=4, sampler=RandomSampler(DATA, True, 64))
    said = first_step([replacement, DataLoader(DATA, batch_size=4)])
    assert len(said) == 2, said  # one line per loader
    assert "a DataLoader over TensorDataset drawing with BatchSampler over RandomSampler(replacement=True)" in said[0]
    assert "BatchSampler over SequentialSampler" in said[1] and "StatefulDataLoader" in said[1]
    sampler = ResumableSampler(len(DATA))
    state = TrainState({"sampler": sampler, "extra": TrainState({})})
    # (a generator of the loader's own: an iterator made after the resume draws no seed from torch's)
    own = torch.Generator()
    assert first_step([DataLoader(DATA, batch_size=4, sampler=sampler, generator=own)], known_objects(state)) == []
    sequential = SequentialSampler(DATA)  # any object the checkpoint holds (an extra_state value)
    assert first_step([DataLoader(DATA, sampler=sequential, generator=own)], [sequential]) == []
    assert first_step([replacement], forward_first=True) == []  # drawn after the forward: an evaluation


def test_worker_processes_reading_a_saved_sampler_ahead_are_said():
    """A ResumableSampler the checkpoint holds, read by a DataLoader's 2 worker processes: they take
    its indices batches ahead of the step, so the saved position is ahead (said); without workers
    the position is exact (not said)."""
    sampler = ResumableSampler(len(DATA))
    said = first_step([DataLoader(DATA, batch_size=4, sampler=sampler, num_workers=2)], [sampler])
    assert len(said) == 1 and "2 worker processes" in said[0] and "ahead" in said[0], said
    assert sampler.consumed > 4  # what the saved position would hold after one batch: read ahead
    assert first_step([DataLoader(DATA, batch_size=4, sampler=ResumableSampler(len(DATA)))], [sampler]) == []


def test_an_iterator_made_after_the_resume_that_drew_its_seed_from_torchs_generator_is_said():
    """A DataLoader over a saved ResumableSampler (no workers: its position is exact) whose iterator
    is made in the first step after the resume drew its seed from torch's global generator there, a
    draw the uninterrupted run did not make at that step: said, naming the fix. Not said with a
    generator of the loader's own, nor for an iterator made before the resume (it drew before the
    generators were restored)."""
    sampler = ResumableSampler(len(DATA))
    said = first_step([DataLoader(DATA, batch_size=4, sampler=sampler)], [sampler])
    assert len(said) == 1 and "drew its workers' seed from torch's global generator" in said[0], said
    assert "DataLoader(..., generator=torch.Generator())" in said[0]
    own = DataLoader(DATA, batch_size=4, sampler=sampler, generator=torch.Generator())
    assert first_step([own], [sampler]) == []
    early = iter(DataLoader(DATA, batch_size=4, sampler=sampler))  # above guard.steps()
    torch.rand(1)  # the resume restores other generator states: anything but the iterator's draw
    said = []
    model = torch.nn.Linear(1, 1)
    watch = DataWatch()
    watch.arm(model, [sampler], said.append)
    next(early)
    model(torch.zeros(1, 1))
    watch.disarm()
    assert said == []


def test_a_stateful_loader_keeps_its_position_and_one_loaded_after_its_iterator_was_made_is_said():
    """torchdata's StatefulDataLoader given to the Guard: its iterators (2 workers) are its own, not
    said when it has a generator of its own; without one, an iterator made after the resume drew its
    workers' seed from torch's global generator (said: found by the zoo's minGPT-DDP shape); a position
    loaded into it after the loop made its iterator never reaches that iterator (said at the step's
    first batch)."""
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
    own = stateful_dataloader.StatefulDataLoader(
        DATA, batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator()
    )
    assert first_step([own], [own]) == []
    loader = stateful_dataloader.StatefulDataLoader(DATA, batch_size=4, shuffle=True, num_workers=2)
    said = first_step([loader], [loader])
    assert len(said) == 1 and "drew its workers' seed from torch's global generator" in said[0], said
    it = iter(loader)
    position = loader.state_dict()
    said = []
    model = torch.nn.Linear(1, 1)
    watch = DataWatch()
    watch.arm(model, [loader], said.append)
    loader.load_state_dict(position)  # the resume, after the loop made its iterator
    next(it)
    model(torch.zeros(1, 1))
    watch.disarm()
    assert len(said) == 1 and "loaded into it but never used" in said[0] and "StatefulDataLoader" in said[0], said


def test_a_loop_that_skips_to_its_position_itself_is_not_said():
    """The ImageNet example's ``if i < skip: continue`` (several batches before the first forward)
    and accelerate's skipping batch sampler (``skip_batches``, the HF Trainer's resume)."""
    said = []
    model = torch.nn.Linear(1, 1)
    watch = DataWatch()
    watch.arm(model, (), said.append)
    it = iter(DataLoader(DATA, batch_size=4, sampler=RandomSampler(DATA)))
    for _ in range(3):  # skipped to the step's batch
        next(it)
    model(torch.zeros(1, 1))
    watch.disarm()
    assert said == []

    class SkipBatchSampler(BatchSampler):
        def __init__(self, sampler, skip_batches):
            super().__init__(sampler, 4, False)
            self.skip_batches = skip_batches

    assert first_step([DataLoader(DATA, batch_sampler=SkipBatchSampler(SequentialSampler(DATA), 2))]) == []


def test_the_watch_puts_the_iterators_back():
    cls = compat.dataloader_iterator_class()
    before = cls.__next__
    first_step([DataLoader(DATA)])
    assert cls.__next__ is before
    DataWatch().disarm()  # never armed: nothing to do


def run(run_dir: Path, steps: int, *flags: str):
    args = ("--steps", str(steps), *flags)
    return launch(run_dir, "checkpoint.interval=5", script=WORKER, tiny=False, script_args=args, default_recovery=True)


@pytest.mark.soak  # two launches with DataLoader workers: ~30 s on 2 loaded cores (scripts/test_soak.sh)
def test_a_resume_from_a_loader_of_torchs_samplers_says_it_cannot_be_bitwise_naming_the_loader(tmp_path):
    """The run trains 10 steps; its relaunch to 15 resumes from step 10 and its first step draws
    from a new iterator of the RandomSampler: each rank says so in a ``resume_not_bitwise`` event,
    rank 0 on the console (without the watch: nothing named the loader, the issue's silent
    resume)."""
    r = tmp_path / "run"
    assert finish(run(r, 10)) == 0, Path(f"{r}.log").read_text()[-3000:]
    assert finish(run(r, 15)) == 0, Path(f"{r}.log").read_text()[-3000:]
    assert events(r, "resume")[-1]["details"]["from_step"] == 10
    said = [e for e in events(r, "resume_not_bitwise") if "DataLoader" in e["details"]["cause"]]
    assert sorted(e["rank"] for e in said) == [0, 1] and {e["step"] for e in said} == {11}, said  # its end
    assert "BatchSampler over RandomSampler(replacement=True)" in said[0]["details"]["cause"]
    assert "whose position the checkpoint does not hold" in Path(f"{r}.log").read_text()


@pytest.mark.soak  # two launches with DataLoader workers: about 40 s on 2 loaded cores (scripts/test_soak.sh)
def test_a_stateful_loader_whose_iterator_was_made_before_the_resume_is_said(tmp_path):
    """torchdata's StatefulDataLoader (2 workers, shuffled) given as ``Guard(sampler=loader)`` in the
    GPT trainer's shape (``data_iter = iter(loader)`` above ``guard.steps()``): the position loaded
    at the resume never reaches that iterator, which starts the epoch anew; each rank says so at
    its first step, naming why (the same loop making its iterator after the resume is bitwise:
    tests/test_loops.py, ``workers``)."""
    pytest.importorskip("torchdata.stateful_dataloader")
    r = tmp_path / "run"
    for steps in (10, 15):
        assert finish(run(r, steps, "--stateful", "--early")) == 0, Path(f"{r}.log").read_text()[-3000:]
    said = [e for e in events(r, "resume_not_bitwise") if "loaded into it but never used" in e["details"]["cause"]]
    assert sorted(e["rank"] for e in said) == [0, 1], said


def test_a_stateful_loader_as_the_data_position_declines_in_process_recovery_and_other_samplers_do_not():
    """A replacement cannot take a StatefulDataLoader's position back to the interrupted step's
    start (the zoo's DDP-tutorial epoch loop recovered with other weights, silently, 2 of 3 times):
    in-process recovery declines it at start, naming it; a ResumableSampler does not decline."""
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
    from trainguard.guard import applies

    model = torch.nn.Linear(1, 1)
    loader = stateful_dataloader.StatefulDataLoader(DATA, batch_size=4)
    assert applies.declined(None, model, None, loader) == applies.STATEFUL_LOADER
    assert "StatefulDataLoader" in applies.STATEFUL_LOADER
    assert applies.declined(None, model, None, ResumableSampler(len(DATA))) is None
