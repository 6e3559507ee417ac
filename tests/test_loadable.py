"""A checkpoint is proven loadable when it is written (issue 53): the first committed save is
checked against what a resume would load (src/trainguard/checkpoint/loadable.py). The checks on
real DCP checkpoints in one process (gloo, one rank), then real launches of
tests/unloadable_worker.py whose model wrapper saves keys its load does not look up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import events, finish, launch
from trainguard.checkpoint import loadable
from trainguard.checkpoint.io import CheckpointMismatchError, apply_state, model_optim_state, rank_file

WORKER = Path(__file__).resolve().parent / "unloadable_worker.py"


class Unpicklable:
    """Not a type ``torch.load(weights_only=True)`` accepts."""


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def net(out: int = 1, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, out)).to(dtype)


def saved(path: Path, model: torch.nn.Module, rank_state: dict) -> Path:
    """A checkpoint directory as the Guard writes it: DCP's files of the model and an AdamW that
    took a step, and rank 0's state file."""
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    dcp.save(model_optim_state(model, opt), checkpoint_id=path)
    torch.save(rank_state, path / rank_file(0))
    return path


def test_a_checkpoint_is_checked_against_the_model_it_would_load_into(tmp_path, one_rank):
    """Keys, shapes and dtypes of the template against the saved metadata, and the rank file."""
    model = net()
    path = saved(tmp_path / "ckpt", model, {"step": 1})
    loadable.check_persistent(path, model, torch.optim.AdamW(model.parameters()), 0)  # loads: no error
    with pytest.raises(
        CheckpointMismatchError, match=r"another shape: model.1.weight saved \[1, 8\], loaded into \[2, 8\]"
    ):
        loadable.check_persistent(path, net(out=2), None, None)
    double = net(dtype=torch.float64)
    with pytest.raises(CheckpointMismatchError, match="another dtype: model.0.weight saved torch.float32"):
        loadable.check_persistent(path, double, None, None)
    loadable.check_persistent(path, double, None, None, dtypes=False)  # a resume casts: not refused there
    deeper = torch.nn.Sequential(net(), torch.nn.Linear(1, 1))
    with pytest.raises(CheckpointMismatchError, match="the load reads model.0.0.bias"):
        loadable.check_persistent(path, deeper, None, None)
    with pytest.raises(
        CheckpointMismatchError, match="the load reads optim.param_groups.0.dampening"
    ):  # another optimizer
        loadable.check_persistent(path, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), None)
    torch.save({"step": 1, "extra": {"x": Unpicklable()}}, path / rank_file(0))
    with pytest.raises(CheckpointMismatchError, match="weights_only=True.*Unsupported global.*Unpicklable"):
        loadable.check_persistent(path, model, None, 0)


def test_a_wrapper_whose_state_dict_is_not_what_its_load_looks_up_is_named(one_rank):
    """Fabric's shape: a wrapper holding DDP whose state_dict() is the inner module's: torch's
    set_state_dict looks the parameters up through the wrapper; DDP alone is fine."""
    from unloadable_worker import Wrapper

    ddp = DDP(net())
    keys = set(model_optim_state(ddp, None)["model"])
    loadable.check_names(ddp, keys)
    wrapped = Wrapper(ddp)
    with pytest.raises(CheckpointMismatchError) as e:
        loadable.check_names(wrapped, set(model_optim_state(wrapped, None)["model"]))
    assert "the load looks for forward_module.0.bias, forward_module.0.weight" in str(e.value)
    assert "(it wrote 0.bias, 0.weight, 1.bias, 1.weight)" in str(e.value)
    with pytest.raises(RuntimeError, match="Missing key: forward_module.0.weight"):  # what torch's load says
        apply_state(wrapped, None, model_optim_state(wrapped, None))


def worker(run: Path, *flags: str):
    settings = ("--set", "checkpoint.interval=4")
    return launch(run, script=WORKER, tiny=False, extra=settings, script_args=flags, default_recovery=True)


def test_an_unloadable_checkpoint_stops_the_run_at_its_first_save_with_bad_input(tmp_path):
    """The wrapper's run stops with exit 2 when its first checkpoint (step 4) is committed, naming
    the keys (without the check it trained to its end with exit 0, and every resume gave up with
    76: "Missing key")."""
    run = tmp_path / "run"
    assert finish(worker(run, "--wrapper")) == 2, Path(f"{run}.log").read_text()[-3000:]
    message = events(run, "bad_input")[0]["details"]["message"]
    assert "the checkpoint of step 4" in message and "was written, but a resume could not load it" in message
    assert "forward_module.net.0.weight" in message and "it wrote net.0.bias, net.0.weight" in message
    assert not events(run, "end") and not events(run, "group_restart")


@pytest.mark.soak  # two launches: ~30 s on 2 loaded cores (scripts/test_soak.sh)
def test_a_resume_into_a_model_that_cannot_load_the_checkpoint_is_refused_before_loading(tmp_path):
    """A run of the plain DDP model (its checkpoints load), relaunched with the wrapper: refused
    with exit 2 before the load, naming the keys (without the check at load: torch's "Missing
    key" in every restart, then 76)."""
    run = tmp_path / "run"
    assert finish(worker(run)) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert finish(worker(run, "--wrapper")) == 2, Path(f"{run}.log").read_text()[-3000:]
    message = events(run, "bad_input")[-1]["details"]["message"]
    assert "step-00000012 cannot be loaded into this model" in message and "forward_module.net.0.weight" in message
    assert not events(run, "give_up") and not events(run, "group_restart")
