"""Resume on another world size (trainguard.state.reshard): the global data position in one process, then
real launches that stop on 2 ranks and resume on 1 and on 3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, events, finish, launch
from trainguard import ResumableSampler
from trainguard.checkpoint.io import rank_file
from trainguard.outcomes import BadInput
from trainguard.rejoin.protocol import Generation, new_rank
from trainguard.rejoin.shrink import check_shrinkable, reshard
from trainguard.report import build_report, load_events, render_text
from trainguard.state.determinism import capture_rng
from trainguard.state.reshard import check_reshardable, derived_seed, rank_batch, resharded_rank_state

STEPS = 60
GLOBAL = 12  # sequences per step: 6 per rank on the 2 ranks the run starts with


def _take(samplers: list[ResumableSampler], per_rank: int, steps: int) -> list[tuple[int, int]]:
    """``steps`` lockstep batches of ``per_rank`` indices on every rank: ``[(epoch, index)]``."""
    out = []
    for _ in range(steps):
        for s in samplers:
            out += [(s.epoch, i) for i in s.take(per_rank)]
    return out


def _world(n: int, state: dict | None) -> list[ResumableSampler]:
    samplers = [ResumableSampler(120, rank, n, seed=5) for rank in range(n)]
    for s in samplers:
        if state is not None:
            s.load_state_dict(state)
    return samplers


def test_every_sample_of_an_epoch_is_seen_once_across_world_size_changes():
    """2 ranks take 36 indices, 1 rank 24, 3 ranks the rest of the 120-sample epoch and the next
    epoch's first ones: each epoch's indices are one whole permutation, none twice, none skipped;
    the state is the same on every rank and says how far the epoch is, whatever the world size."""
    two = _world(2, None)
    seen = _take(two, 6, 3)
    assert [s.state_dict() for s in two] == [{"epoch": 0, "consumed": 36}] * 2
    one = _world(1, two[0].state_dict())
    seen += _take(one, 12, 2)
    three = _world(3, one[0].state_dict())
    seen += _take(three, 4, 7)  # 60 to the end of epoch 0, then 24 of epoch 1
    assert sorted(i for e, i in seen if e == 0) == list(range(120))
    epoch1 = [i for e, i in seen if e == 1]
    assert len(epoch1) == len(set(epoch1)) == 24
    assert three[0].state_dict() == {"epoch": 1, "consumed": 24}
    # the same world size reads the permutation as torch's DistributedSampler does (drop_last)
    perm = torch.randperm(120, generator=torch.Generator().manual_seed(5)).tolist()
    assert ResumableSampler(120, 1, 3, seed=5).take(5) == perm[1::3][:5]


def test_an_older_per_rank_position_still_loads_on_the_same_world_size():
    s = ResumableSampler(100, 1, 2, seed=0)
    s.load_state_dict({"epoch": 0, "offset": 7})  # this rank had taken 7: all ranks 14
    assert s.state_dict() == {"epoch": 0, "consumed": 14}


def test_the_global_batch_is_kept_or_each_ranks_batch():
    assert rank_batch(6, "global_batch", 2, 2) == 6
    assert [rank_batch(6, "global_batch", 2, n) for n in (1, 3, 4, 6, 12)] == [12, 4, 3, 2, 1]
    assert rank_batch(6, "rank_batch", 2, 3) == 6
    with pytest.raises(BadInput, match=r"global batch 12 \(6 per rank on 2 ranks\) does not divide by 5 ranks"):
        rank_batch(6, "global_batch", 2, 5)


def test_the_random_streams_of_new_ranks_follow_a_fixed_rule():
    """Rank r of the new world is seeded from rank 0's saved generator, the step and r: the same
    inputs give the same streams (a resume is reproducible), different ranks different ones."""
    torch.manual_seed(3)
    saved = {"step": 40, "rng": capture_rng(), "sampler": {"epoch": 0, "consumed": 480}}
    seeds = [derived_seed(saved["rng"], 40, r) for r in range(3)]
    assert len(set(seeds)) == 3 and seeds == [derived_seed(saved["rng"], 40, r) for r in range(3)]
    assert derived_seed(saved["rng"], 41, 0) != seeds[0]
    draws = []
    for r in (0, 1, 0):
        state = resharded_rank_state(saved, r)
        assert state["sampler"] == saved["sampler"] and state["step"] == 40  # rank 0's shared parts
        draws.append(torch.rand(3).tolist())
    assert draws[0] == draws[2] != draws[1]


def test_a_sampler_without_a_global_position_is_refused_naming_both_world_sizes(tmp_path):
    class PerRank:
        def state_dict(self) -> dict:
            return {}

    check_reshardable(ResumableSampler(10), tmp_path, 2, 1)
    check_reshardable(None, tmp_path, 2, 1)
    with pytest.raises(BadInput, match=r"written by 2 ranks and this run has 3: the sampler PerRank"):
        check_reshardable(PerRank(), tmp_path / "step-00000010", 2, 3)


@pytest.mark.soak  # over a minute on 2 cores: scripts/test_soak.sh (CI)
def test_a_run_that_loses_ranks_resumes_on_1_then_on_3_with_the_same_global_batch(tmp_path):
    """2 ranks (6 sequences each) lose rank 1 in step 25 (no restart allowed: the job ends); the
    relaunch on the 1 rank left (12 sequences) resumes from step 20 and loses it in step 45; 3 ranks
    (4 each) resume from step 40 and finish at 60. Each resume says the world size changed and that
    it is not bitwise; the data position is 12 sequences per completed step throughout (one pass
    over one permutation, nothing twice), and the final validation loss is within 1 % of an
    uninterrupted 2-rank run's (dropout streams and summation order differ; measured: 0.003 %)."""
    settings = (  # synchronous saves: the checkpoints of steps 20 and 40 are committed before the kills
        f"train.max_steps={STEPS}",
        "train.batch_size=6",
        "checkpoint.interval=10",
        "launcher.max_restarts=0",
        "checkpoint.async_save=false",
    )
    clean = tmp_path / "clean"
    assert finish(launch(clean, *settings)) == 0, Path(f"{clean}.log").read_text()[-3000:]
    run = tmp_path / "run"
    assert finish(launch(run, *settings, extra=("--inject", "rank_killed:rank=1,step=25"))) == 76
    assert finish(launch(run, *settings, nproc=1, extra=("--inject", "rank_killed:rank=0,step=45"))) == 76
    assert finish(launch(run, *settings, nproc=3)) == 0, Path(f"{run}.log").read_text()[-3000:]
    resumes = [e["details"]["from_step"] for e in events(run, "resume")]
    changes = [
        (e["details"]["from_world_size"], e["details"]["to_world_size"]) for e in events(run, "world_size_changed")
    ]
    assert resumes == [20, 40] and changes == [(2, 1), (1, 3)], (resumes, changes)
    causes = [e["details"]["cause"] for e in events(run, "resume_not_bitwise") if e["rank"] == 0]
    assert any("world_size 2 → 1" in c for c in causes) and any("world_size 1 → 3" in c for c in causes), causes
    assert "resuming on 3 rank(s) from a checkpoint of 1" in Path(f"{run}.log").read_text()
    final = run / "checkpoints" / f"step-{STEPS:08d}"
    states = [torch.load(final / rank_file(r), weights_only=True) for r in range(3)]
    assert [s["sampler"] for s in states] == [{"epoch": 0, "consumed": GLOBAL * STEPS}] * 3
    assert [s["elastic"] for s in states] == [{"base_world_size": 2}] * 3
    val, ref = (
        events(run, "validation")[-1]["details"]["val_loss"],
        events(clean, "validation")[0]["details"]["val_loss"],
    )
    assert abs(val - ref) < 0.01 * ref, (val, ref)
    sizes = build_report(load_events(run)[0])["world_sizes"]
    assert [(w["world_size"], w["first_step"], w["last_step"]) for w in sizes] == [(2, 0, 25), (1, 20, 45), (3, 40, 60)]
    assert "world size: 2 ranks from" in render_text(build_report(load_events(run)[0]))


def test_resuming_a_per_rank_sampler_on_another_world_size_is_refused_untouched(tmp_path):
    """A script whose sampler keeps a per-rank position: its 2-rank run loses rank 1 in step 7 (no
    restart allowed); relaunched on 1 rank, it exits 2 with the message naming both world sizes,
    and the checkpoints are as they were."""
    run = tmp_path / "run"
    script = REPO / "tests" / "per_rank_sampler_worker.py"
    # synchronous saves: the checkpoint of step 5 is committed before rank 1 dies in step 7 (a
    # background save may still be in flight then, and a save a rank dies in is not committed)
    settings = ("checkpoint.interval=5", "launcher.max_restarts=0", "checkpoint.async_save=false")
    kill = ("--inject", "rank_killed:rank=1,step=7")
    code = finish(launch(run, *settings, script=script, tiny=False, extra=kill))
    assert code == 76, Path(f"{run}.log").read_text()[-3000:]
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in (run / "checkpoints").rglob("*"))
    assert finish(launch(run, *settings, nproc=1, script=script, tiny=False)) == 2
    log = Path(f"{run}.log").read_text()
    assert "was written by 2 ranks and this run has 1: the sampler PerRankSampler" in log, log[-2000:]
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in (run / "checkpoints").rglob("*")) == before


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(run.glob("steps-pid*.jsonl")) for line in p.read_text().splitlines()]


@pytest.mark.soak  # moved out of the README suite to keep it under 15 minutes on 2 cores (issue 51); CI runs it
def test_a_3_rank_run_that_loses_a_rank_goes_on_as_2_then_grows_back_to_3_in_place(tmp_path):
    """3 ranks (4 samples each), ``elastic.min_ranks = 2``, no spare: rank 1 dies after step 25.
    Ranks 0 and 2 keep their processes and go on as ranks 0 and 1 of 2 with 6 samples each; the
    launcher starts a spare (``elastic.regrow``), and once it is ready the group grows back to 3 at
    the next stop check, the newcomer (rank 2) taking the state from the others. No group restart,
    no completed step lost, 12 samples every step and every sample once (one permutation), and
    the report shows 3 ranks, then 2, then 3. (Rank 0 holds its loop while the group is smaller
    until the launcher says the spare is ready: the test waits on that, not on the machine.)"""
    run = tmp_path / "run"
    settings = (
        f"worker.max_steps={STEPS}",
        "worker.batch_size=4",
        "worker.hold_until_grow=true",
        "checkpoint.interval=10",
        "recovery.in_process=true",
        "recovery.timeout=150",  # the other survivor waits in a collective while rank 0 holds
        "supervisor.learn=false",  # a held step is not a hang
        "stop.check_interval=1",
        "launcher.spares=0",
        "elastic.min_ranks=2",
    )
    worker = REPO / "tests" / "elastic_worker.py"
    proc = launch(run, *settings, nproc=3, script=worker, tiny=False, extra=("--inject", "rank_killed:rank=1,step=25"))
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert not events(run, "group_restart") and len(events(run, "workers_started")) == 1
    assert not events(run, "recovery_fallback")
    changed = events(run, "world_size_changed")
    shrink = [e for e in changed if e["details"]["left"]]
    assert sorted((e["details"]["from_rank"], e["rank"]) for e in shrink) == [(0, 0), (2, 1)], changed
    assert {(e["step"], e["details"]["to_world_size"], tuple(e["details"]["left"])) for e in shrink} == {(25, 2, (1,))}
    started = {int(r): pid for r, pid in events(run, "workers_started")[0]["details"]["pids"].items()}
    assert {e["details"]["from_rank"]: e["pid"] for e in shrink} == {0: started[0], 2: started[2]}  # same processes
    grow = [e for e in changed if e["details"]["joined"]]
    assert sorted((e["rank"], e["pid"]) for e in grow) == [(0, started[0]), (1, started[2])], changed
    grown_at = grow[0]["step"]
    assert {(e["step"], e["details"]["to_world_size"], tuple(e["details"]["joined"])) for e in grow} == {
        (grown_at, 3, (2,))
    }
    newcomer = events(run, "rank_joined")
    assert [(e["rank"], e["step"]) for e in newcomer] == [(2, grown_at)], newcomer
    assert events(run, "grow_started")[0]["details"]["pids"] == {"2": newcomer[0]["pid"]}
    assert len(events(run, "generation_joined")) == 2 and len(events(run, "group_grown")) == 1
    # every step trained 12 samples, every sample of the epoch once; 4 per rank on 3, 6 on 2
    applied = [r for r in _records(run) if r["applied"]]
    per_step = {}
    for r in applied:
        per_step.setdefault(r["step"], []).append(r)
    assert sorted(per_step) == list(range(1, STEPS + 1))
    assert all(sum(len(r["indices"]) for r in recs) == GLOBAL for recs in per_step.values())
    sizes = {step: {r["world_size"] for r in recs} for step, recs in per_step.items()}
    assert all(sizes[s] == ({2} if 25 < s <= grown_at else {3}) for s in sizes), sizes
    trained = sorted(i for r in applied for i in r["indices"])
    assert trained == sorted(ResumableSampler(2000, 0, 1).take(GLOBAL * STEPS))
    final = run / "checkpoints" / f"step-{STEPS:08d}"
    states = [torch.load(final / rank_file(r), weights_only=True) for r in range(3)]
    assert [s["sampler"] for s in states] == [{"epoch": 0, "consumed": GLOBAL * STEPS}] * 3
    report = build_report(load_events(run)[0])["world_sizes"]
    assert [(w["world_size"], w["first_step"], w["last_step"]) for w in report] == [
        (3, 0, 25),
        (2, 25, grown_at),
        (3, grown_at, STEPS),
    ], report
    log = Path(f"{run}.log").read_text()
    assert "going on as 2 rank(s) without rank(s) [1]" in log and "going on as 3 rank(s) with rank(s) [2] back" in log


def test_a_shrink_renumbers_the_survivors_in_order_and_keeps_the_data_position():
    """Ranks 0, 2, 3 of 4 after rank 1 left become 0, 1, 2; the samplers of the survivors go on
    from the global position on 3 ranks: the epoch is still one permutation, nothing twice."""
    assert [new_rank(r, (1,)) for r in (0, 2, 3)] == [0, 1, 2]
    assert [new_rank(r, (0, 2)) for r in (1, 3)] == [0, 1]
    samplers = _world(4, None)
    seen = _take(samplers, 3, 4)  # 4 steps of 12
    survivors = [s for r, s in enumerate(samplers) if r != 1]
    for s in survivors:
        reshard(s, new_rank(s.rank, (1,)), 3)
    seen += _take(survivors, 4, 7)  # 7 steps of 12: 132 > 120, the epoch ends inside the last step
    first = [i for e, i in seen if e == 0]
    assert sorted(first) == list(range(120)) and len(seen) - len(first) == 12


def test_a_generation_without_left_ranks_reads_as_before_and_a_shrink_waits_for_every_member():
    old = '{"number": 2, "host": "h", "port": 5, "replaced": [1], "world_size": 3}'
    assert Generation.from_json(old) == Generation(2, "h", 5, (1,), 3, ())
    shrunk = Generation(3, "h", 5, (), 2, (1,))
    assert Generation.from_json(shrunk.to_json()) == shrunk
    assert shrunk.members == (0, 1) and Generation(2, "h", 5, (1,), 3).members == (1,)
    grown = Generation(4, "h", 5, (2,), 3, (), (2,))  # the newcomer says it joined, the others need not
    assert Generation.from_json(grown.to_json()) == grown and grown.members == (2,)


def test_a_run_that_cannot_shrink_in_place_is_refused_at_start():
    check_shrinkable(0, 2, object(), True)  # off: nothing to check
    with pytest.raises(BadInput, match="elastic.min_ranks = 3 is larger than the world size 2"):
        check_shrinkable(3, 2, None, False)
    with pytest.raises(BadInput, match="sampler object has no reshard"):
        check_shrinkable(1, 2, object(), False)
    with pytest.raises(BadInput, match="checkpoint.local.dir"):
        check_shrinkable(1, 2, ResumableSampler(10, 0, 2), True)


def test_min_ranks_above_the_world_size_exits_2_before_anything_is_written(tmp_path):
    run = tmp_path / "run"
    proc = launch(run, "elastic.min_ranks=3", "recovery.in_process=true")
    assert finish(proc) == 2
    assert "elastic.min_ranks = 3 is larger than the world size 2" in Path(f"{run}.log").read_text()
    assert not run.exists()
