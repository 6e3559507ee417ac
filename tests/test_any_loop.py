"""In-process recovery for a loop written as the README shows (``loss.backward()``,
``optimizer.step()``, ``scheduler.step()``, no ``run_step`` or ``should_step``): a lost peer is
caught at the collective it surfaces in (:mod:`trainguard.rejoin.catch`), the abandoned step changes
nothing (:mod:`trainguard.rejoin.stepstart`), a warm spare takes its rank where the script first
reads it (:mod:`trainguard.rejoin.replacement`). The pieces in one process, then real launches of
``examples/plain_loop.py`` with a rank SIGKILLed from outside at seeded random moments."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import psutil
import pytest
import torch
import torch.distributed as dist

from conftest import events, final_hash, finish, launch, logged_step, shared_hash, wait_for
from trainguard import dist as tgdist
from trainguard.launch_env import RECOVERY_GROUP, RECOVERY_KEY, RECOVERY_STORE
from trainguard.rejoin import catch, replacement
from trainguard.rejoin.auth import Seal
from trainguard.rejoin.catch import Catch, DDPHook, complete_locally, is_own_hook
from trainguard.rejoin.protocol import Generation, assign_spare, spare_ready
from trainguard.rejoin.stepstart import StepStart
from trainguard.rejoin.stores import open_store

WORKER = Path(__file__).resolve().parents[1] / "examples" / "plain_loop.py"
STEPS = 300


def test_gathers_complete_locally_with_this_ranks_value_and_other_collectives_leave_tensors_alone():
    out = [None, None, None]
    complete_locally("all_gather_object", (out, {"host": "a"}), {})
    assert out == [{"host": "a"}] * 3
    tensors = [torch.zeros(2), torch.zeros(2)]
    complete_locally("all_gather", (), {"tensor_list": tensors, "tensor": torch.ones(2)})
    assert all(torch.equal(t, torch.ones(2)) for t in tensors)
    t = torch.tensor([3.0])
    complete_locally("all_reduce", (t,), {})
    assert t.item() == 3.0


def test_script_collectives_are_caught_and_completed_locally_but_not_trainguards_or_torchs():
    """A one-rank group whose all_reduce is made to fail as a lost peer's would: the script's call
    is recorded and returns; once failed, later calls complete at once; a call from trainguard's
    own modules still raises."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    c = Catch()
    seen: list[str] = []
    real = dist.all_reduce
    try:

        def broken(*args, **kwargs):
            raise dist.DistNetworkError("Connection reset by peer")

        dist.all_reduce = broken  # what the wrapper calls through to
        found = {name: getattr(dist, name) for name in catch.COLLECTIVES}  # what the Catch finds in place
        found_clip = torch.nn.utils.clip_grad_norm_
        c.arm(lambda e, where: seen.append(where) or True, lambda: bool(seen))
        t = torch.tensor([2.0])
        dist.all_reduce(t)  # this module is the script here
        assert seen == ["dist.all_reduce"] and t.item() == 2.0
        out = [None]
        dist.all_gather_object(out, "me")  # after the failure: locally, without the group
        assert out == ["me"]
        with pytest.raises(dist.DistNetworkError):
            tgdist.all_reduce_max([1])  # trainguard's own collectives handle their errors themselves
        c.disarm()
        with pytest.raises(dist.DistNetworkError):
            dist.all_reduce(t)  # disarmed: calls through
    finally:
        c.uninstall()
        left = {name: getattr(dist, name) for name in catch.COLLECTIVES}
        dist.all_reduce = real
        dist.destroy_process_group()
    assert left == found and torch.nn.utils.clip_grad_norm_ is found_clip  # uninstall put back what it found


def test_own_hook_is_told_from_a_scripts():
    assert is_own_hook(DDPHook(Catch(), []).hook) and not is_own_hook(lambda s, b: b.buffer())


def test_an_abandoned_step_changes_no_parameter_and_puts_the_scheduler_back():
    """optimizer.step() after a lost peer leaves parameters and AdamW's state alone; the scheduler
    and the learning rate it set come back to the step's start; a step applied before the failure
    surfaced counts as applied."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    failed = [False]
    start = StepStart(opt, sched, lambda: failed[0])
    try:
        start.step_begin(1)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
        assert start.applied
        before = [p.detach().clone() for p in model.parameters()]
        adam = {k: v["exp_avg"].clone() for k, v in enumerate(opt.state.values())}
        start.step_begin(1)
        model(torch.randn(3, 4)).sum().backward()
        failed[0] = True  # DDP's all-reduce lost a peer
        opt.step()
        sched.step()
        assert not start.applied
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert all(torch.equal(adam[k], v["exp_avg"]) for k, v in enumerate(opt.state.values()))
        assert opt.param_groups[0]["lr"] == 0.025
        start.restore()
        assert opt.param_groups[0]["lr"] == 0.05 and sched.last_epoch == 1
    finally:
        start.close()


def test_a_spare_takes_its_rank_at_the_scripts_first_read_of_RANK(monkeypatch):
    """A warm spare's ``os.environ["RANK"]`` (and ``os.getenv("LOCAL_RANK")``) wait for the
    launcher's assignment and answer with the assigned rank's values; other variables do not wait."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    monkeypatch.setenv(RECOVERY_STORE, f"127.0.0.1:{server.port}")
    seal = Seal(bytes(range(32)))
    monkeypatch.setenv(RECOVERY_KEY, seal.key.hex())
    monkeypatch.setenv("RANK", "0")  # the placeholder a spare inherits
    for name in ("LOCAL_RANK", "WORLD_SIZE"):  # set by the assignment: monkeypatch puts them back after the test
        monkeypatch.setenv(name, "0")
    assignment = replacement.Assignment(7)
    environ_class = type(os.environ)
    try:
        assignment.watch_environ()
        assert os.environ.get("PATH")  # not a rank variable: no wait

        def assign():
            wait_for(lambda: spare_ready(server, 7, seal), what="the spare")
            assign_spare(server, 7, {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}, seal)

        threading.Thread(target=assign, daemon=True).start()
        assert int(os.environ.get("RANK", 0)) == 3
        assert os.getenv("LOCAL_RANK") == "1" and assignment.taken
        assert type(os.environ) is environ_class
    finally:
        os.environ.__class__ = environ_class


def _plain(run: Path, nproc: int, *settings: str) -> subprocess.Popen:
    """``examples/plain_loop.py`` under ``trainguard run`` with the default recovery settings."""
    return launch(
        run,
        f"worker.max_steps={STEPS}",
        "checkpoint.interval=50",
        *settings,
        nproc=nproc,
        script=WORKER,
        tiny=False,
        default_recovery=True,
    )


@pytest.fixture(scope="session")
def plain_clean_hash(tmp_path_factory) -> Callable[[int], str]:
    """The final state hash of an uninterrupted run of the plain loop on ``nproc`` ranks."""
    return lambda nproc: shared_hash(tmp_path_factory, f"plain{nproc}", lambda run: _plain(run, nproc))


def forge_values(pids: dict[str, int], world_size: int) -> set[str]:
    """As another process on the node would: find the recovery store (from a rank's environment,
    here) and write a generation that sends the ranks elsewhere and an assignment that makes the
    warm spare rank 0. Returns the keys written."""
    env = psutil.Process(int(pids["0"])).environ()
    store = open_store(env[RECOVERY_STORE])  # on one node a file: this user's, as the forger is
    gen_key = f"attempt{env[RECOVERY_GROUP]}/gen/1"
    store.set(gen_key, Generation(1, "10.6.6.6", 6666, (0, 1), world_size).to_json())
    store.set("spares/1", json.dumps({"RANK": "0", "MASTER_ADDR": "10.6.6.6"}))
    return {gen_key, "spares/1"}


def kill_and_check(run: Path, clean: str, seed: int, nproc: int, forge: bool = False) -> None:
    """Launch the plain loop on ``nproc`` ranks with the default settings; SIGKILL a rank drawn
    from ``seed`` at a random moment (a random step, then a random fraction of a step: forward,
    backward's all-reduce, the optimizer, the logging all-reduce, a save); check that the other
    ranks kept their processes, the victim was replaced, no step was lost and the final state is
    ``clean``. ``forge``: forged values are written to the recovery store before the kill
    (:func:`forge_values`); each is refused with a ``security`` event and the recovery is as
    without them."""
    rng = random.Random(seed)
    proc = _plain(run, nproc)  # the default settings: in-process recovery, one warm spare
    kill_at, victim = rng.randint(40, 240), rng.randrange(nproc)
    wait_for(lambda: logged_step(run) >= kill_at, what=f"step {kill_at}")
    time.sleep(rng.random() * 0.02)
    pids = events(run, "workers_started")[0]["details"]["pids"]
    forged = forge_values(pids, nproc) if forge else set()
    if forge:  # the spare refuses its forged assignment before the real one can overwrite it
        wait_for(
            lambda: any(e["details"]["key"] == "spares/1" for e in events(run, "security")),
            what="the spare's refusal of the forged assignment",
        )
    os.kill(int(pids[str(victim)]), signal.SIGKILL)
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert not events(run, "group_restart") and not events(run, "recovery_fallback")
    survivors = sorted(int(pids[str(r)]) for r in range(nproc) if r != victim)
    assert sorted(e["pid"] for e in events(run, "recovery_finished")) == survivors
    assert {e["details"]["steps_lost"] for e in events(run, "recovery_finished")} == {0}
    assert [e["rank"] for e in events(run, "rank_replaced")] == [victim]
    assert final_hash(run) == clean
    assert {e["details"]["key"] for e in events(run, "security")} == forged


@pytest.mark.parametrize(("seed", "nproc"), [(1, 2)])
def test_plain_loop_rank_killed_from_outside_is_replaced_in_process_bitwise_forged_values_refused(
    tmp_path, plain_clean_hash, seed, nproc
):
    """The README-shaped loop (its script reads RANK before ``init_process_group``, runs a
    broadcast and a barrier before its loop and a logging all-reduce in it) recovers in-process from
    a rank SIGKILLed from outside, bitwise, though another process wrote a forged generation and a
    forged spare assignment into the recovery store first: both refused, with ``security`` events.
    (4 ranks: the soak campaign below.)"""
    kill_and_check(tmp_path / "run", plain_clean_hash(nproc), seed, nproc, forge=True)


@pytest.mark.soak
@pytest.mark.parametrize(
    ("seed", "nproc"),
    [(s, 2) for s in range(100, 120)] + [(3, 4), (4, 4), (5, 4), (6, 4)],
)
def test_campaign_of_kills_at_random_moments_recovers_every_one_in_process_bitwise(
    tmp_path, plain_clean_hash, seed, nproc
):
    """The campaign: 20 kills of 2 ranks and 4 of 4 ranks at seeded random wall-clock moments;
    every one in-process and bitwise (scripts/test_soak.sh). With 4 ranks a survivor that caught
    the loss cuts its connections, so none waits for the collective's timeout, and DDP's buckets
    keep their layout, so the sums round as in the uninterrupted run."""
    kill_and_check(tmp_path / "run", plain_clean_hash(nproc), seed, nproc)


def test_catch_module_wraps_only_collectives_torch_has():
    assert all(hasattr(dist, name) for name in catch.COLLECTIVES)


@pytest.mark.soak
def test_plain_loop_hung_rank_is_killed_and_replaced_in_process(tmp_path, plain_clean_hash):
    """Rank 1 of the plain loop SIGSTOPs itself at step 60: the supervisor finds it silent past its
    learned timeout and kills it; rank 0, blocked until then in a collective of the script's own
    (its logging all-reduce, or DDP's inside ``loss.backward()``), catches the lost peer there and the
    run goes on in-process, bitwise."""
    run = tmp_path / "run"
    proc = launch(
        run,
        f"worker.max_steps={STEPS}",
        "checkpoint.interval=50",
        "supervisor.step_timeout=3",
        nproc=2,
        script=WORKER,
        tiny=False,
        default_recovery=True,
        extra=("--inject", "rank_hung:rank=1,step=60"),
    )
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert [e["details"]["rank"] for e in events(run, "hang_detected")] == [1]
    assert not events(run, "group_restart") and len(events(run, "workers_started")) == 1
    during = [e["details"]["during"] for e in events(run, "recovery_started") if e["rank"] == 0]
    assert during in (["backward"], ["dist.all_reduce"]), during  # the script's own collectives both
    assert [e["details"]["steps_lost"] for e in events(run, "recovery_finished")] == [0]
    assert final_hash(run) == plain_clean_hash(2)


@pytest.mark.soak  # 4 ranks on 2 cores: scripts/test_soak.sh (CI)
def test_a_ddp_survivor_one_step_behind_takes_the_completed_step_and_trains_on(tmp_path, tmp_path_factory, monkeypatch):
    """The plain loop on 4 ranks; rank 3 dies in step 20 after the gradient all-reduce while rank 0
    still waits on it (tests/behind_worker.py): ranks 1 and 2 complete step 20, rank 0
    abandons it and takes it from rank 1. Its next step is a new one, not step 20 done again, so
    the redo check compares nothing (before: it compared step 21's batch with step 20's and failed
    the recovery into a group restart; seen once in the soak campaign of kills). In-process, one
    replacement, the uninterrupted run's state."""
    short = ("worker.max_steps=60",)
    clean = shared_hash(tmp_path_factory, "plain4-60", lambda run: _plain(run, 4, *short))
    monkeypatch.setenv("TG_BEHIND_STEP", "20")
    monkeypatch.setenv("TG_BEHIND_DIR", str(tmp_path))
    monkeypatch.setenv("TG_BEHIND_EXAMPLE", "plain_loop.py")
    run = tmp_path / "run"
    proc = launch(
        run,
        f"worker.max_steps={STEPS}",
        "checkpoint.interval=50",
        *short,
        nproc=4,
        script=Path(__file__).resolve().parent / "behind_worker.py",
        tiny=False,
        default_recovery=True,
    )
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    log = Path(f"{run}.log").read_text()[-3000:]
    assert not events(run, "group_restart") and not events(run, "recovery_failed"), log
    behind = [e["details"]["during"] for e in events(run, "recovery_started") if e["rank"] == 0]
    assert behind == ["dist.broadcast"], behind  # in step 20, before its update
    finished = {e["rank"]: e for e in events(run, "recovery_finished")}
    assert finished[0]["details"]["redo_step"] is None  # it took step 20: nothing done again
    assert len(events(run, "rank_replaced")) == 1
    assert final_hash(run) == clean
