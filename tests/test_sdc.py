"""Silent data corruption (trainguard.sdc.replicas): exact replica fingerprints in one process, then real
3-rank launches where a bit of rank 1's parameters flips and the replicas are compared."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from conftest import events, final_hash, finish, launch
from trainguard.events import EventLog, read_events
from trainguard.faults import FaultInjector, grow_bit, parse_inject
from trainguard.ranks import Ranks
from trainguard.report import build_report, load_events
from trainguard.sdc.crosscheck import StepInputs
from trainguard.sdc.replicas import ReplicaCheck, fingerprint, flip_bit, odd_ones_out
from trainguard.sdc.rerun import StepRerun, step_result, suspect_of
from trainguard.sections import SDCSection

STEPS = 100
# the 3-rank corruption tests share one clean run: on the same xdist worker, one session fixture
pytestmark = pytest.mark.xdist_group("sdc")


def test_the_module_runs_in_its_xdist_group(request):
    """Under ``--dist loadgroup`` this module's tests share one worker (its clean run is made once);
    a pytest / pytest-xdist pair that drops the group (pytest 9.2 with xdist 3.8) fails here."""
    if os.environ.get("PYTEST_XDIST_WORKER") and request.config.getoption("dist") == "loadgroup":
        assert request.node.nodeid.endswith("@sdc"), request.node.nodeid


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_single_bit_flip_changes_the_fingerprint(dtype):
    torch.manual_seed(0)
    params = [torch.randn(64, 33).to(dtype), torch.randn(7).to(dtype)]
    clean = fingerprint(params)
    assert fingerprint([p.clone() for p in params]) == clean  # equal tensors, equal value
    bits = params[0].element_size() * 8
    for bit in range(bits):
        for index in (0, 1000, params[0].numel() - 1):
            flip_bit(params[0], index, bit)
            assert fingerprint(params) != clean, (bit, index)
            flip_bit(params[0], index, bit)  # and back
    assert fingerprint(params) == clean


def test_the_odd_ranks_out_are_named_by_majority():
    assert odd_ones_out([5, 5, 5]) == []
    assert odd_ones_out([5, 7, 5]) == [1]
    assert odd_ones_out([5, 7, 5, 9]) == [1, 3]
    assert odd_ones_out([5, 7]) == [0, 1]  # two replicas that differ: no majority, both named
    assert odd_ones_out([5, 5, 7, 7]) == [0, 1, 2, 3]


def test_a_step_rerun_tells_a_changed_result_from_the_same_one():
    """One rank (the collective is an identity): the same result again is ``data``; a changed
    loss is ``transient`` naming the rank, changed gradients alone name none; a step is re-run once."""
    rerun = StepRerun(True, Ranks(0, 1))
    assert rerun.wants(7) and not rerun.pending(7)
    rerun.start(7, (11, 22))
    assert rerun.pending(7) and not rerun.wants(7)  # the re-run itself is not re-run
    v = rerun.classify((11, 22), 4.5)
    assert (v.step, v.verdict, v.ranks, v.first, v.again, v.losses) == (7, "data", [], [[11, 22]], [[11, 22]], [4.5])
    assert v.suspect is None  # one rank: no other to compare with
    assert not rerun.pending(7) and rerun.wants(7)
    rerun.start(8, (11, 22))
    assert rerun.classify((12, 22), 4.5).ranks == [0]
    rerun.start(9, (11, 22))
    v = rerun.classify((11, 23), 4.5)
    assert v.verdict == "transient" and v.ranks == []
    rerun.start(10, (1, 2))
    rerun.forget()  # a rollback or a lost peer abandons it
    assert not rerun.pending(10) and not StepRerun(False, Ranks(0, 1)).wants(10)
    with pytest.raises(RuntimeError, match="without a re-run"):
        rerun.classify((1, 2), 4.5)


def test_the_suspect_is_the_one_rank_whose_loss_alone_is_wrong():
    nan, inf = float("nan"), float("inf")
    assert suspect_of([4.2, 4.3, 4.1]) is None
    assert suspect_of([4.2, 7e19, 4.1]) == 1
    assert suspect_of([4.2, 7e19]) == 1  # two ranks: the lower median is the reference
    assert suspect_of([nan, 4.2, 4.3]) == 0 and suspect_of([4.2, inf]) == 1
    assert suspect_of([nan, nan, 4.0]) is None  # two wrong ranks: no single suspect
    assert suspect_of([7e19, 7e19]) is None  # a spike of every rank: the data
    assert suspect_of([4.2]) is None


def test_a_replayed_forward_matches_the_recorded_one_unless_the_device_flips_a_bit(tmp_path):
    """The inputs and RNG state of the step's first forward are recorded; replaying them (dropout
    included) gives the same output bit for bit; a persistent activation fault makes the replay
    differ, as a bad device would."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2)
    )
    inputs = StepInputs(model)
    inputs.step_begin(1)
    assert inputs.portable() is None  # no forward yet in this step: nothing to replay
    out = model(torch.randn(4, 8))
    model(torch.randn(4, 8))  # a second forward in the step is not the recorded one
    recorded = inputs.portable()
    stats, rng = [b.clone() for b in model.buffers()], torch.get_rng_state()
    assert inputs.replay(recorded) == fingerprint([out]) == inputs.replay(recorded)
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers()))  # running statistics untouched
    assert torch.equal(rng, torch.get_rng_state())
    log = EventLog(tmp_path, 0)
    faults = FaultInjector([parse_inject("sdc:rank=0,step=3,target=activation,persistent=true")], 0, 1, 0, log)
    faults.arm(10)
    faults.watch_activations(model, lambda: 3)
    assert inputs.replay(recorded) != fingerprint([out])
    faults.close()
    inputs.close()
    log.close()


def test_step_result_sees_one_flipped_bit_in_the_loss_or_a_gradient():
    model = torch.nn.Linear(4, 3)
    model(torch.ones(2, 4)).sum().backward()
    loss = torch.tensor(0.75)
    clean = step_result(loss, model)
    flip_bit(loss.view(1))
    assert step_result(loss, model)[0] != clean[0]
    flip_bit(model.bias.grad, 2, 3)
    assert step_result(torch.tensor(0.75), model) == (clean[0], step_result(torch.tensor(0.75), model)[1])
    assert step_result(torch.tensor(0.75), model)[1] != clean[1]


def test_sdc_faults_flip_one_bit_of_a_gradient_or_of_the_models_output(tmp_path):
    """``target=grad``: one bit of the first gradient in ``should_step``'s numeric faults, once.
    ``target=activation``: the highest 0 exponent bit of the model output's first element in the
    first forward of the step, once; with ``persistent`` in every forward of the step."""
    log = EventLog(tmp_path, 0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    specs = [
        parse_inject(f"sdc:rank=0,step={s},target={t}{p}")
        for s, t, p in [(3, "grad", ""), (5, "activation", ""), (6, "activation", ",persistent=true")]
    ]
    faults = FaultInjector(specs, 0, 1, 0, log)
    faults.arm(10)
    step = [1]
    faults.watch_activations(model, lambda: step[0])
    x = torch.full((1, 4), 0.25)
    model(x).sum().backward()
    before = model[0].weight.grad.clone()
    faults.numeric(2, torch.tensor(1.0), None, model)
    assert torch.equal(model[0].weight.grad, before)
    faults.numeric(3, torch.tensor(1.0), None, model)
    changed = (model[0].weight.grad.view(-1).view(torch.int32) ^ before.view(-1).view(torch.int32)).tolist()
    assert changed[0] == 1 << 20 and not any(changed[1:])
    faults.numeric(3, torch.tensor(1.0), None, model)  # done again (a re-run): once only, not flipped back
    assert (model[0].weight.grad.view(-1).view(torch.int32) ^ before.view(-1).view(torch.int32)).tolist() == changed

    with torch.no_grad():
        clean = model(x)
        outputs = {}
        for step[0] in (4, 5, 6):
            for run in range(2):
                outputs[step[0], run] = [model(x), model(x)]  # two forwards in the step

    def flipped(out: torch.Tensor) -> bool:
        return not torch.equal(out, clean)

    assert not any(flipped(o) for o in outputs[4, 0] + outputs[4, 1])
    assert [flipped(o) for o in outputs[5, 0] + outputs[5, 1]] == [True, False, False, False]
    assert [flipped(o) for o in outputs[6, 0] + outputs[6, 1]] == [True, True, True, True]  # persistent: every forward
    bits = int(outputs[5, 0][0].view(-1).view(torch.int32)[0] ^ clean.view(-1).view(torch.int32)[0])
    assert bin(bits).count("1") == 1 and abs(outputs[5, 0][0].item()) >= abs(clean.item()) * 2.0**32
    faults.close()
    assert not flipped(model(x))
    log.close()
    fired = [(e["step"], e["details"]["target"]) for e in read_events(tmp_path) if e["kind"] == "fault_injected"]
    assert fired == [(3, "grad"), (5, "activation")] + [(6, "activation")] * 4


@pytest.mark.parametrize("value", [4.2, 0.3, -1e-3, 1.5e30])
def test_the_grown_bit_makes_the_value_much_larger(value):
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        t = torch.tensor([value], dtype=dtype)
        flip_bit(t, 0, grow_bit(t[0]))
        assert abs(t.item()) > abs(value) * 1e4, (dtype, t.item())


def _launch3(run: Path, *settings: str, inject: str = ""):
    extra = ("--inject", inject) if inject else ()
    return launch(run, f"train.max_steps={STEPS}", "checkpoint.interval=10", *settings, nproc=3, extra=extra)


@pytest.fixture(scope="session")  # session: xdist may interleave modules, which tears a module fixture down
def clean3(tmp_path_factory) -> str:
    """The final hash of a clean 3-rank run with the check every 20 steps (which finds nothing)."""
    clean = tmp_path_factory.mktemp("sdc") / "clean"
    assert finish(_launch3(clean, "sdc.check_interval=20")) == 0, Path(f"{clean}.log").read_text()[-3000:]
    assert not events(clean, "sdc_mismatch") and not events(clean, "sdc_check_off")
    return final_hash(clean)


def test_a_flipped_bit_in_one_replica_is_found_and_rolled_back_to_a_clean_result(tmp_path, clean3):
    """(A clean 3-rank run finds no mismatch in its 5 checks: ``clean3``.) One bit of rank 1's
    first parameter flipped after step 55: the check at step 60 names rank 1 (its replica alone
    differs; they agreed at step 40) when step 61's gradient bucket brings the fingerprints, every
    rank reloads the checkpoint of step 40 in-process, the checkpoints of steps 50 and 60 are set
    aside, the re-run agrees at step 60 (transient), and the run ends bitwise equal to the clean one."""
    run = tmp_path / "run"
    code = finish(_launch3(run, "sdc.check_interval=20", inject="sdc:rank=1,step=55"))
    assert code == 0, Path(f"{run}.log").read_text()[-3000:]
    (m,) = events(run, "sdc_mismatch")
    assert m["step"] == 60 and m["details"]["ranks"] == [1] and m["details"]["last_good"] == 40, m
    fp = m["details"]["fingerprints"]
    assert fp[0] == fp[2] != fp[1] and m["details"]["action"] == "rerun"
    (verdict,) = events(run, "sdc_rerun")  # the re-run of steps 41-60 agreed: a transient fault
    assert verdict["step"] == 60 and verdict["details"]["verdict"] == "transient" and verdict["details"]["ranks"] == [1]
    (rb,) = events(run, "sdc_rollback")
    assert rb["details"]["from_step"] == 61 and rb["details"]["to_step"] == 40  # the verdict came at step 61
    aside = sorted(p.name for p in (run / "checkpoints").glob(".rolledback-*"))
    assert [n.split("-")[2] for n in aside] == ["00000050", "00000060"], aside  # 60's save came before the verdict
    assert "silent data corruption: the replicas of ranks [1] differ at step 60" in Path(f"{run}.log").read_text()
    assert not events(run, "group_restart")
    assert final_hash(run) == clean3


def test_one_rank_has_no_replica_to_compare(tmp_path):
    """One rank: the check is off, and an ``sdc_check_off`` event says why (no step is ever due)."""
    log = EventLog(tmp_path, 0)
    check = ReplicaCheck(SDCSection(check_interval=5), torch.nn.Linear(2, 2), Ranks(0, 1), log)
    log.close()
    assert not check.active and not any(check.due(s) for s in range(1, 21))
    (off,) = [e for e in read_events(tmp_path) if e["kind"] == "sdc_check_off"]
    assert "one rank" in off["details"]["reason"]
    (tmp_path / "off").mkdir()
    log = EventLog(tmp_path / "off", 0)
    assert not ReplicaCheck(
        SDCSection(check_interval=0), torch.nn.Linear(2, 2), Ranks(0, 2), log
    ).active  # by choice: no event
    log.close()
    assert not list(read_events(tmp_path / "off"))


@pytest.mark.soak  # moved out of the README suite to keep it under 15 min on 2 cores (CI took 16 min); CI runs it in the soak step
def test_a_clean_1000_step_run_finds_no_mismatch(tmp_path):
    """100 checks of 2 replicas over 1,000 clean steps: no false alarm."""
    run = tmp_path / "run"
    code = finish(launch(run, "train.max_steps=1000", "checkpoint.interval=500", "sdc.check_interval=10"), 300)
    assert code == 0, Path(f"{run}.log").read_text()[-3000:]
    assert not events(run, "sdc_mismatch") and not events(run, "sdc_check_off")


@pytest.mark.soak  # moved out of the README suite to keep it under 15 min on 2 cores (CI took 16 min); CI runs it in the soak step
def test_a_persistent_flip_excludes_the_host_and_the_relaunch_ends_clean(tmp_path, clean3):
    """The bit of rank 1 flips again each time step 55 is re-run (a bad GPU): the re-run after the
    first rollback differs at step 60 again, on the same rank: persistent. The ranks roll back to
    step 40 once more, rank 1's host goes to RUN_DIR/exclude_nodes and the launch exits 75; the
    relaunch (on good hardware: no fault) resumes from step 40 and ends bitwise equal to the clean
    run."""
    run = tmp_path / "run"
    code = finish(_launch3(run, "sdc.check_interval=20", inject="sdc:rank=1,step=55,persistent=true"))
    assert code == 75, Path(f"{run}.log").read_text()[-3000:]
    assert [e["details"]["action"] for e in events(run, "sdc_mismatch")] == ["rerun", "exclude"]
    (verdict,) = events(run, "sdc_rerun")
    assert verdict["details"]["verdict"] == "persistent" and verdict["details"]["ranks"] == [1]
    stop = events(run, "stop_requested")[-1]["details"]
    assert stop["reason"] == "sdc" and stop["ranks"] == [1]
    assert (run / "exclude_nodes").read_text().split() == stop["hosts"]
    assert finish(_launch3(run, "sdc.check_interval=20")) == 0
    assert events(run, "resume")[-1]["details"]["from_step"] == 40
    assert final_hash(run) == clean3


def test_a_persistent_flip_with_replace_hands_the_rank_to_a_spare(tmp_path, clean3):
    """``on_persistent = "replace"`` with in-process recovery: after the persistent verdict every
    rank rolls back to step 40, rank 1 leaves with exit code 77 (its host written to
    exclude_nodes), ranks 0 and 2 keep their processes and a warm spare takes rank 1 with the
    state from them; no stop, no group restart, and the run ends bitwise equal to the clean one."""
    run = tmp_path / "run"
    settings = ("sdc.check_interval=20", "sdc.on_persistent=replace", "recovery.in_process=true", "launcher.spares=1")
    code = finish(_launch3(run, *settings, inject="sdc:rank=1,step=55,persistent=true"))
    assert code == 0, Path(f"{run}.log").read_text()[-3000:]
    assert [e["details"]["action"] for e in events(run, "sdc_mismatch")] == ["rerun", "replace"]
    (excl,) = events(run, "sdc_exclude")
    assert excl["details"]["action"] == "replace" and excl["details"]["ranks"] == [1]
    assert (run / "exclude_nodes").read_text().split() == excl["details"]["hosts"]
    (left,) = [e for e in events(run, "exit") if e["details"].get("code") == 77]
    assert left["rank"] == 1 and left["details"]["reason"] == "sdc"
    (failed,) = events(run, "workers_failed")
    assert list(failed["details"]["exit_codes"].values()) == [77]
    (replaced,) = events(run, "rank_replaced")
    assert replaced["rank"] == 1 and replaced["step"] == 40
    assert not events(run, "group_restart") and not events(run, "stop_requested")
    starts = {e["rank"]: e["pid"] for e in events(run, "start")}
    assert all(e["pid"] == starts[e["rank"]] for e in events(run, "end") if e["rank"] in (0, 2))  # survivors kept
    report = build_report(load_events(run)[0])
    kinds = [i["kind"] for i in report["incidents"]]
    assert "rank_withdrawn" in kinds and "rank_crashed" not in kinds, kinds
    assert final_hash(run) == clean3


@pytest.mark.soak  # 18 s on 2 cores: the README suite keeps its 15 minutes; CI runs it in the soak step
def test_a_bad_batch_on_every_rank_is_data_not_a_corruption(tmp_path):
    """NaN loss and gradients in step 30 on both ranks, again when the step is done again (a bad
    batch: ``persistent``): the re-run of step 30 computes the same on every rank, so it is data;
    the instability policy skips the step. The replicas never differ: no mismatch."""
    run = tmp_path / "run"
    nan = "nan_loss:step=30,persistent=true"
    inject = ("--inject", f"{nan},rank=0", "--inject", f"{nan},rank=1")
    settings = ("train.max_steps=60", "checkpoint.interval=20", "sdc.check_interval=10", "sdc.on_instability=rerun")
    code = finish(launch(run, *settings, extra=inject))
    assert code == 0, Path(f"{run}.log").read_text()[-3000:]
    (started,) = events(run, "step_rerun")
    assert started["step"] == 30 and "nonfinite_loss" in started["details"]["detectors"]
    (verdict,) = events(run, "sdc_rerun")
    d = verdict["details"]
    assert verdict["step"] == 30 and d["trigger"] == "instability" and d["verdict"] == "data", d
    assert d["first_run"] == d["re_run"] and d["ranks"] == []
    assert [e["step"] for e in events(run, "step_skipped")] == [30]
    assert not events(run, "sdc_mismatch")


@pytest.mark.soak  # 22 s on 2 cores: the README suite keeps its 15 minutes; CI runs it in the soak step
def test_a_flipped_bit_in_an_activation_is_transient_and_the_rerun_is_used(tmp_path, clean3):
    """An exponent bit of rank 1's model output (its loss) flips in the first forward of step 65:
    the loss spikes (× 2^64). Re-run from its inputs, the step computes what a clean run does:
    transient, rank 1 named, the re-run's result applied (no skip, no rollback) and the run ends
    bitwise equal to the clean one."""
    run = tmp_path / "run"
    settings = ("sdc.check_interval=20", "sdc.on_instability=rerun")
    code = finish(_launch3(run, *settings, inject="sdc:rank=1,step=65,target=activation"))
    assert code == 0, Path(f"{run}.log").read_text()[-3000:]
    assert [e["step"] for e in events(run, "step_rerun")] == [65]
    (verdict,) = events(run, "sdc_rerun")
    d = verdict["details"]
    assert d["trigger"] == "instability" and d["verdict"] == "transient" and d["ranks"] == [1], d
    assert d["first_run"][0] == d["re_run"][0] and d["first_run"][1] != d["re_run"][1]
    assert (
        "step 65 gave a different result when run again (the loss of ranks [1] changed)"
        in Path(f"{run}.log").read_text()
    )
    assert not events(run, "step_skipped") and not events(run, "rollback") and not events(run, "instability")
    assert final_hash(run) == clean3
    report = build_report(load_events(run)[0])
    (inc,) = report["incidents"]
    assert (inc["kind"], inc["step"], inc["in_process"], inc["injected"]) == ("sdc_transient", 65, True, True), inc


@pytest.mark.soak  # moved out of the README suite to keep it under 15 min on 2 cores (CI took 16 min); CI runs it in the soak step
def test_a_device_that_computes_a_step_wrong_every_time_is_persistent_and_excluded(tmp_path, clean3):
    """Rank 1's device flips an exponent bit of its output in every forward of step 65 (a bad GPU).
    The re-run gives the same result again, but rank 1's loss alone is wrong, so rank 2 computes rank
    1's forward on the same inputs: a different output, a persistent fault of rank 1. The step is
    not applied, rank 1's host goes to exclude_nodes and the launch exits 75; the relaunch (good
    hardware) does step 65 again and ends bitwise equal to the clean run."""
    run = tmp_path / "run"
    settings = ("sdc.check_interval=20", "sdc.on_instability=rerun")
    code = finish(_launch3(run, *settings, inject="sdc:rank=1,step=65,target=activation,persistent=true"))
    assert code == 75, Path(f"{run}.log").read_text()[-3000:]
    (verdict,) = events(run, "sdc_rerun")
    d = verdict["details"]
    assert (d["trigger"], d["verdict"], d["ranks"], d["suspect"]) == ("instability", "persistent", [1], 1), d
    assert d["first_run"] == d["re_run"] and d["cross_check"][0] != d["cross_check"][1]
    assert d["losses"][1] > 1e6 * max(d["losses"][0], d["losses"][2])
    (excl,) = events(run, "sdc_exclude")
    assert excl["step"] == 65 and excl["details"]["action"] == "exclude"
    stop = events(run, "stop_requested")[-1]
    assert stop["step"] == 64 and stop["details"]["reason"] == "sdc" and stop["details"]["ranks"] == [1]
    assert (run / "exclude_nodes").read_text().split() == stop["details"]["hosts"]
    assert not events(run, "step_skipped") and not events(run, "instability")
    assert finish(_launch3(run, *settings)) == 0
    assert events(run, "resume")[-1]["details"]["from_step"] == 64
    assert final_hash(run) == clean3
