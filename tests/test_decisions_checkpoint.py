"""Checkpoint retention, known-good bookkeeping and ``latest_valid`` in one process.

Real checkpoint directories in ``tmp_path`` (committed by :class:`CheckpointStore`, or by a real
:class:`~trainguard.checkpoint.checkpointer.Checkpointer` through DCP on a gloo group of world size 1), real
corruptions (a flipped byte, a truncated file, a missing manifest), and a real
:class:`~trainguard.instability.recovery.Recovery` whose known-good verdicts follow real detector
verdicts.

Invariants: retention never deletes the newest verified checkpoint, nor a protected step (the
newest known-good, the oldest awaiting its verdict, the one just committed), nor anything because
of a checkpoint that is not committed yet; a checkpoint becomes known-good only after
``known_good_after`` healthy steps, never when a detector fired after it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.checkpointer import CHANGED_DURING_COPY, Checkpointer, SaveResult
from trainguard.checkpoint.io import load_state
from trainguard.checkpoint.store import Checkpoint, CheckpointStore
from trainguard.events import EventLog, read_events
from trainguard.instability.recovery import Recovery, Settings, Trained
from trainguard.ranks import Ranks
from trainguard.sections import CheckpointSection, InstabilitySection, RollbackSection

NAN = float("nan")


def commit(store: CheckpointStore, step: int) -> Checkpoint:
    tmp = store.begin(step)
    (tmp / "data").write_bytes(bytes([step % 256]) * (100 + step))
    return store.commit(tmp, step, mf.describe_files(tmp, ["data"]), {"created": step})


def steps(store: CheckpointStore) -> list[int]:
    return [c.step for c in store.committed()]


def hidden(store: CheckpointStore) -> list[str]:
    """Names in the store root other than committed checkpoints (``.tmp-``, ``.trash-``...)."""
    return sorted(p.name for p in store.root.iterdir() if p.name.startswith("."))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def events(run_dir: Path, kind: str) -> list[dict]:
    return list(read_events(run_dir, kind))


# ------------------------------------------------------------------------------------------------
# retention


@pytest.mark.parametrize(
    "keep_last, protect, deleted",
    [
        (2, set(), [10, 20, 30]),
        (2, {20}, [10, 30]),
        (1, set(), [10, 20, 30, 40]),
        (1, {10, 30, 99}, [20, 40]),  # a protected step that does not exist changes nothing
        (5, set(), []),
        (9, set(), []),
    ],
)
def test_retention_keeps_the_newest_keep_last_and_the_protected(tmp_path, keep_last, protect, deleted):
    store = CheckpointStore(tmp_path, keep_last=keep_last)
    for step in (10, 20, 30, 40, 50):
        commit(store, step)
    assert store.apply_retention(protect=protect) == deleted
    assert steps(store) == [s for s in (10, 20, 30, 40, 50) if s not in deleted]
    assert hidden(store) == []  # deleted for good (the default remover runs at once)


@pytest.mark.parametrize("damage", ["truncate", "no_manifest", "missing_file"])
def test_retention_never_deletes_the_newest_verified_next_to_newer_damaged_dirs(tmp_path, damage):
    store = CheckpointStore(tmp_path, keep_last=1)
    for step in (10, 20, 30, 40, 50):
        commit(store, step)
    for step in (40, 50):  # newer step directories that do not verify
        path = store.path_for(step)
        if damage == "truncate":
            os.truncate(path / "data", 3)
        elif damage == "no_manifest":
            (path / mf.MANIFEST).unlink()
        else:
            (path / "data").unlink()
    assert store.apply_retention() == [10, 20]  # 30 is the newest that verifies: kept
    assert steps(store) == [30, 40, 50]  # the damaged ones are neither counted nor deleted
    assert store.latest_valid().step == 30


def test_retention_counts_only_committed_checkpoints(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    commit(store, 10)
    commit(store, 20)
    tmp = store.begin(30)  # a save in progress: its files are there, its commit is not
    (tmp / "data").write_bytes(b"x" * 130)
    assert store.apply_retention() == [] and steps(store) == [10, 20]
    assert hidden(store) == [".tmp-step-00000030"]
    store.commit(tmp, 30, mf.describe_files(tmp, ["data"]), {})
    assert store.apply_retention() == [10] and steps(store) == [20, 30]


def test_retention_sets_aside_first_and_hands_the_deletion_over(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=1)
    for step in (10, 20, 30):
        commit(store, step)
    handed: list[Path] = []
    assert store.apply_retention(remove=handed.append) == [10, 20]  # nothing deleted yet
    assert [p.name for p in handed] == [".trash-step-00000010", ".trash-step-00000020"]
    assert all(p.is_dir() for p in handed) and steps(store) == [30]
    assert store.latest_valid().step == 30 and store.known_good() is None  # invisible already
    assert sorted(p.name for p in store.clean_stale()) == [p.name for p in handed]  # a crash's leftovers
    assert hidden(store) == []


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_checkpointer_retains_after_a_commit_never_the_new_one_nor_the_protected(tmp_path, group):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    log = EventLog(tmp_path, 0)
    ckpt = Checkpointer(CheckpointSection(interval=1, keep_last=1), tmp_path, log, model, opt, Ranks(0, 1))
    try:
        kept = []
        for step in (1, 2, 3, 4):
            result = ckpt.save(step, "interval", ("persistent",), {"step": step})
            assert result.error is None and result.checkpoint.step == step
            kept.append(ckpt.retain(result, protect={2}))
        assert kept == [[], [1], [], [3]]
        assert steps(ckpt.store) == [2, 4]
        assert [e["details"]["deleted_steps"] for e in events(tmp_path, "checkpoint_committed")] == kept
        # a failed save commits nothing: no retention, no event
        failed = SaveResult(5, "interval", ("persistent",), False, error="No space left on device")
        assert ckpt.retain(failed, protect=set()) == [] and steps(ckpt.store) == [2, 4]
        assert len(events(tmp_path, "checkpoint_committed")) == 4
    finally:
        ckpt.close()
        log.close()
    assert hidden(ckpt.store) == []  # the deleter thread finished its work before close returned


def _async_save_with(tmp_path: Path, edit) -> tuple[Checkpointer, SaveResult, dict]:  # noqa: ANN001
    """One background save of step 1 of a trained Linear + Adam, with ``edit(model)`` run after the
    snapshot and before the background copy (the writer thread is held until then), then the
    optimizer step (its pre-hook waits for the copy). Returns the Checkpointer, the save's result
    and the model's state dict at the save."""
    import threading

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    log = EventLog(tmp_path, 0)
    ckpt = Checkpointer(CheckpointSection(interval=1), tmp_path, log, model, opt, Ranks(0, 1))
    assert ckpt.asynchronous  # async_save = "auto" by default
    hold = threading.Event()
    ckpt.pool.submit(hold.wait)  # the writer starts this save's copy only after the edit
    assert ckpt.save(1, "interval", ("persistent",), {"step": 1}, blocking=False) is None
    edit(model)
    hold.set()
    opt.step()
    return ckpt, ckpt.wait(), at_save


def test_background_save_is_the_default_and_commits_the_state_of_its_step(tmp_path, group):
    ckpt, result, at_save = _async_save_with(tmp_path, lambda m: None)
    try:
        assert result.error is None and result.asynchronous and ckpt.asynchronous
        assert [c.step for c in ckpt.store.committed()] == [1]
        fresh = torch.nn.Linear(4, 2)
        assert load_state(result.checkpoint.path, fresh, None) == {"step": 1}
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in at_save.items())  # not the step after
    finally:
        ckpt.close()


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.weight.requires_grad_(False).mul_(2.0).requires_grad_(True),  # an in-place op on the parameter
        lambda m: m.bias.detach().zero_(),  # through a detached alias (same version counter)
    ],
    ids=["in_place", "detached_alias"],
)
def test_background_save_refused_when_its_sources_changed_during_the_copy(tmp_path, group, edit, capfd):
    ckpt, result, _ = _async_save_with(tmp_path, edit)
    try:
        assert result.error is not None and CHANGED_DURING_COPY in result.error
        assert "1 of 8 parameter and optimizer tensors" in result.error  # 2 parameters, 2 × Adam's 3 states
        assert ckpt.store.committed() == []  # nothing committed, the temporary directory freed
        assert not ckpt.asynchronous  # later saves are synchronous
        err = capfd.readouterr().err
        assert "later saves are synchronous" in err and err.count("warning") + err.count("WARNING") == 1
        (failed,) = events(tmp_path, "checkpoint_failed")
        assert CHANGED_DURING_COPY in failed["details"]["error"]
        again = ckpt.save(2, "interval", ("persistent",), {"step": 2}, blocking=False)  # asked for a background save
        assert again is not None and again.error is None and not again.asynchronous
        assert [c.step for c in ckpt.store.committed()] == [2]
    finally:
        ckpt.close()


# ------------------------------------------------------------------------------------------------
# latest_valid and the known-good mark


@pytest.mark.parametrize(
    "damage, verify, found, reason",
    [
        (None, "full", 30, None),
        ("flip", "full", 20, "data checksum mismatch"),
        ("flip", "size", 30, None),  # same size: only a full check reads the bytes
        ("truncate", "size", 20, "data has 3 bytes, manifest says 130"),
        ("no_manifest", "full", 20, "manifest.json is missing"),
        ("renamed", "full", 20, "manifest is for step 10, directory says 30"),
        # valid JSON of the wrong shape: invalid (it raised on rank 0 before its broadcast before)
        ("files_null", "full", 20, "manifest.json is unreadable: manifest.json: 'files' is NoneType"),
        ("step_text", "full", 20, "manifest.json is unreadable: manifest.json: 'step' is 'thirty'"),
        ("entry_shape", "size", 20, "manifest.json is unreadable: manifest.json: the entry of 'data' is not"),
    ],
)
def test_latest_valid_skips_what_does_not_verify_and_says_why(tmp_path, damage, verify, found, reason):
    skipped: list[tuple[int, str]] = []
    store = CheckpointStore(tmp_path, on_invalid=lambda c, why: skipped.append((c.step, why)))
    for step in (10, 20, 30):
        commit(store, step)
    newest = store.path_for(30)
    if damage == "flip":
        flip_byte(newest / "data")
    elif damage == "truncate":
        os.truncate(newest / "data", 3)
    elif damage == "no_manifest":
        (newest / mf.MANIFEST).unlink()
    elif damage in ("files_null", "step_text", "entry_shape"):
        body = json.loads((newest / mf.MANIFEST).read_text())
        body.update(
            {"files": None}
            if damage == "files_null"
            else {"step": "thirty"}
            if damage == "step_text"
            else {"files": {"data": {"size": "130"}}}
        )
        (newest / mf.MANIFEST).write_text(json.dumps(body))
    elif damage == "renamed":  # a copy of another step under this name
        for p in newest.iterdir():
            p.unlink()
        for p in store.path_for(10).iterdir():
            (newest / p.name).write_bytes(p.read_bytes())
    assert store.latest_valid(verify).step == found
    assert [(step, why[: len(reason)]) for step, why in skipped] == ([] if reason is None else [(30, reason)])
    assert store.latest_valid(verify, before=found).step == {30: 20, 20: 10}[found]


def test_a_read_error_is_retried_and_never_sets_a_good_checkpoint_aside(tmp_path, monkeypatch):
    """An EIO or ESTALE while reading a checkpoint (a shared file system's hiccup) is tried again
    (3 tries); one that outlasts the tries makes the checkpoint neither valid nor invalid: it is
    not reported, not set aside, and no older checkpoint is chosen in its place."""
    import errno

    skipped: list[tuple[int, str]] = []
    store = CheckpointStore(tmp_path, on_invalid=lambda c, why: skipped.append((c.step, why)))
    for step in (10, 20, 30):
        commit(store, step)
    real, failures = mf.hash_file, {"left": 2}

    def flaky(path):  # the file system fails the first reads of step 30's file, as NFS might
        if "step-00000030" in str(path) and failures["left"] > 0:
            failures["left"] -= 1
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(path)

    monkeypatch.setattr(mf, "hash_file", flaky)
    monkeypatch.setattr(mf, "_WAITS", (0.0, 0.0))
    assert store.latest_valid("full").step == 30 and failures["left"] == 0 and skipped == []
    failures["left"] = 99  # it does not pass
    with pytest.raises(mf.ReadError, match=r"Stale file handle \(3 tries\)"):
        store.latest_valid("full")
    assert skipped == [] and steps(store) == [10, 20, 30] and not hidden(store)


def test_mark_known_good_rewrites_the_manifest_atomically_and_it_still_verifies(tmp_path):
    store = CheckpointStore(tmp_path)
    ckpt = commit(store, 10)
    before = mf.read_manifest(ckpt.path)
    store.mark_known_good(ckpt, healthy_steps=7)
    after = mf.read_manifest(ckpt.path)
    assert after["known_good"]["healthy_steps"] == 7
    assert {k: v for k, v in after.items() if k != "known_good"} == before
    assert mf.verify(ckpt.path, "full") is None and store.check(ckpt) is None
    assert sorted(p.name for p in ckpt.path.iterdir()) == ["data", "manifest.json"] and hidden(store) == []
    assert store.known_good(at_most=10) == ckpt and store.known_good(at_most=9) is None


# ------------------------------------------------------------------------------------------------
# known-good verdicts (Recovery, rank 0) and what they protect


class Verdicts:
    """A rank-0 Recovery over a real store; ``step(s, bad)`` runs the detectors on step number s."""

    def __init__(self, run_dir: Path, known_good_after: int = 5, keep_last: int = 3):
        self.run_dir = run_dir
        self.store = CheckpointStore(run_dir / "checkpoints", keep_last=keep_last)
        self.events = EventLog(run_dir, 0)
        self.model = torch.nn.Linear(2, 1)
        self.rec = Recovery(
            Settings(InstabilitySection(known_good_after=known_good_after), RollbackSection(), run_dir),
            Trained(self.model),
            self.store,
            self.events,
            Ranks(0, 1),
            lambda: 0,
        )

    def step(self, s: int, bad: bool = False) -> None:
        """Step number ``s`` runs (a NaN loss when ``bad``), then the boundary after it (``s`` done)."""
        assert self.rec.check(s, torch.tensor(NAN if bad else 1.0), torch.tensor(1.0)) is (not bad)
        self.rec.after_step(s)

    def commit(self, s: int) -> Checkpoint:
        """What the Guard does with a committed checkpoint: verdict pending, retention with protection."""
        ckpt = commit(self.store, s)
        self.rec.on_commit(ckpt)
        self.rec.after_step(s)
        self.store.apply_retention(protect={s} | self.rec.protected())
        return ckpt

    def marked(self) -> list[tuple[int, int]]:
        return [(e["step"], e["details"]["checkpoint_step"]) for e in events(self.run_dir, "checkpoint_known_good")]

    def close(self) -> None:
        self.rec.close()
        self.events.close()


@pytest.fixture
def verdicts(tmp_path):
    made: list[Verdicts] = []

    def make(**kwargs) -> Verdicts:
        made.append(Verdicts(tmp_path, **kwargs))
        return made[-1]

    yield make
    for v in made:
        v.close()


def test_known_good_after_known_good_after_healthy_steps(verdicts):
    v = verdicts(known_good_after=5)
    for s in range(1, 11):
        v.step(s)
    c10 = v.commit(10)
    assert v.rec.protected() == {10}  # awaiting its verdict
    for s in range(11, 15):
        v.step(s)
        assert "known_good" not in mf.read_manifest(c10.path)
    v.step(15)
    assert mf.read_manifest(c10.path)["known_good"]["healthy_steps"] == 5
    assert v.marked() == [(15, 10)] and v.rec.newest_known_good == 10 and v.rec.protected() == {10}


@pytest.mark.parametrize("bad_step, known_good", [(10, True), (11, False), (15, False), (16, True)])
def test_a_detection_after_the_checkpoint_denies_its_verdict(verdicts, bad_step, known_good):
    """Step number 10 is inside checkpoint 10 (a skipped step 10 leaves it untouched); 11..15 follow it.
    A detection at 16 comes after the verdict (given at 15)."""
    v = verdicts(known_good_after=5)
    for s in range(1, 10):
        v.step(s)
    v.step(10, bad=bad_step == 10)
    c10 = v.commit(10)
    for s in range(11, 21):
        v.step(s, bad=s == bad_step)
    assert ("known_good" in mf.read_manifest(c10.path)) is known_good
    assert v.marked() == ([(15, 10)] if known_good else [])
    assert v.rec.pending == [] and v.rec.newest_known_good == (10 if known_good else None)
    assert v.store.known_good() == (c10 if known_good else None)


def test_a_late_background_commit_is_judged_at_once_and_vanished_ones_are_forgotten(verdicts):
    v = verdicts(known_good_after=5)
    for s in range(1, 18):
        v.step(s)
    c10 = commit(v.store, 10)  # an asynchronous save of step 10 that committed during step 17
    v.rec.on_commit(c10)
    v.rec.after_step(17)
    assert v.marked() == [(17, 10)] and mf.read_manifest(c10.path)["known_good"]["healthy_steps"] == 7
    c20 = commit(v.store, 20)
    v.rec.on_commit(c20)
    assert v.rec.protected() == {10, 20}
    v.store.set_aside(c20, "test")  # gone before its verdict (set aside after a rollback, say)
    assert v.rec.protected() == {10} and v.rec.pending == []


def test_start_and_resume_find_what_to_protect_and_what_awaits_a_verdict(verdicts):
    v = verdicts(known_good_after=5)
    c10, c20 = commit(v.store, 10), commit(v.store, 20)
    v.store.mark_known_good(c10, 5)
    v.rec.on_start()  # a new launch: the newest known-good is protected from the start
    assert v.rec.newest_known_good == 10 and v.rec.protected() == {10}
    v.rec.on_resume(c20)  # resumed from a checkpoint without a verdict: it awaits one
    assert v.rec.protected() == {10, 20}
    for s in range(21, 26):
        v.step(s)
    assert v.marked() == [(25, 20)] and v.rec.protected() == {20}
    v.rec.on_resume(c10)  # a checkpoint with its verdict is not judged again
    assert v.rec.pending == []


def test_retention_with_verdicts_always_keeps_a_rollback_target(verdicts):
    """The Guard's sequence over 60 steps (a save every 10, verdict after 15, keep_last=1), with a
    detection at step 33: at every boundary the newest known-good and the oldest pending exist."""
    v = verdicts(known_good_after=15, keep_last=1)
    history = {}
    for s in range(1, 61):
        v.step(s, bad=s == 33)
        if s % 10 == 0:
            v.commit(s)
        on_disk = steps(v.store)
        nkg = v.rec.newest_known_good
        assert nkg is None or nkg in on_disk, (s, on_disk, nkg)
        assert all(c.step in on_disk for c in v.rec.pending[:1]), (s, on_disk)
        history[s] = (on_disk, nkg)
    # 10 is judged at 25; 20 and 30 never (the detection at 33 is within their next 15 steps); 40 at 55
    assert v.marked() == [(25, 10), (55, 40)]
    assert history[40] == ([10, 30, 40], 10)  # 20 went once its verdict was denied; 30 awaits its own
    assert history[50] == ([10, 40, 50], 10)  # 10, older than keep_last allows, is the rollback target
    assert history[60] == ([40, 50, 60], 40)
    assert v.store.known_good(at_most=54) == Checkpoint(40, v.store.path_for(40))
    assert json.loads((v.store.path_for(40) / mf.MANIFEST).read_text())["known_good"]["healthy_steps"] == 15
