"""Crash safety of the checkpoint store, with real files, real processes and real SIGKILLs.

* the torture script (scripts/ckpt_torture.py) kills writers mid-save and checks the invariants
  after every kill, and that a resumed run ends bitwise identical to an uninterrupted one; it is
  also run against writers with a planted bug, to show that it catches each kind of violation;
* corruption of the newest checkpoint (flipped byte, truncated file, deleted manifest);
* retention and stale temporary directories;
* a checkpoint of another model is refused without touching the store.

Invariant 1: a checkpoint is either complete and verified, or invisible to ``latest_valid()``.
Invariant 2: retention never removes the newest verified checkpoint, and never removes an old one
before the new one is committed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import trainguard
from conftest import wait_for
from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.store import CheckpointStore
from trainguard.events import read_events

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "ckpt_torture.py"

_spec = importlib.util.spec_from_file_location("ckpt_torture", SCRIPT)
torture = importlib.util.module_from_spec(_spec)
sys.modules["ckpt_torture"] = torture
_spec.loader.exec_module(torture)

# the in-process model: the torture writer's architecture at a tiny size
DIMS = {"in_dim": 16, "hidden": 32, "out_dim": 8}

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ---------------------------------------------------------------------------------------------
# helpers


def train(run_dir: Path, max_steps: int, keep_last: int = 3, hooks: tuple = ()) -> trainguard.Guard:
    """Train the tiny MLP in this process under a Guard (a checkpoint every step); resumes if it can."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = trainguard.load_config(
        None,
        [
            f"run.dir={run_dir}",
            "checkpoint.interval=1",
            "instability.known_good_after=1",
            f"checkpoint.keep_last={keep_last}",
        ],
    )
    trainguard.seed_everything(0)
    g = torch.Generator().manual_seed(1234)
    xs, ys = torch.randn(64, DIMS["in_dim"], generator=g), torch.randn(64, DIMS["out_dim"], generator=g)
    model = torture.build_model(**DIMS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = trainguard.ResumableSampler(64, seed=0)
    guard = trainguard.Guard(cfg, model=model, optimizer=opt, sampler=sampler, hooks=list(hooks))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in guard.steps(max_steps):
                idx = sampler.take(4)
                loss = F.mse_loss(model(xs[idx]), ys[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                guard.step_end(loss=loss.item())
    finally:
        guard.abandon()  # as the process's end would: pytest's handlers back, nothing left installed
        guard.close()  # and sys.excepthook, which abandon() keeps for an error on its way out
        torch.set_num_threads(threads)
    return guard


def events(run_dir: Path, kind: str) -> list[dict]:
    return list(read_events(run_dir, kind))


def steps_of(root: Path) -> list[int]:
    return [c.step for c in CheckpointStore(root).committed()]


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file under ``root``: (size, mtime_ns, checksum)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, mf.hash_file(p))
    return out


def flip_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def delete_manifest(ckpt: Path) -> None:
    (ckpt / mf.MANIFEST).unlink()


def run_script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def parse_summary(output: str) -> dict[str, int]:
    lines = [line for line in output.splitlines() if line.startswith("SUMMARY ")]
    assert lines, f"no SUMMARY line in the output:\n{output[-3000:]}"
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", lines[-1])}


@pytest.fixture(scope="session")
def clean_sha(tmp_path_factory) -> dict[int, str]:
    """state_sha256 of uninterrupted in-process runs, by length."""
    cache: dict[int, str] = {}

    def get(max_steps: int) -> str:
        if max_steps not in cache:
            cache[max_steps] = train(tmp_path_factory.mktemp("clean") / "run", max_steps).state_sha256
        return cache[max_steps]

    return get


@pytest.fixture
def ckpt_set(tmp_path) -> Path:
    """A run dir with Guard-written checkpoints at steps 2, 3, 4 (keep_last=3)."""
    run = tmp_path / "run"
    train(run, 4, keep_last=3)
    assert steps_of(run / "checkpoints") == [2, 3, 4]
    for s in (2, 3, 4):
        assert mf.verify(run / "checkpoints" / f"step-{s:08d}") is None
    return run


# ---------------------------------------------------------------------------------------------
# (a) the torture script: SIGKILL mid-save, check, resume, kill again


@pytest.mark.soak
@pytest.mark.timeout(240)
def test_torture_kills_during_saves(tmp_path):
    """30 SIGKILLs (5 per trial dir, 2 dirs at a time): the store stays valid, resumes end bit-identical.
    (30, not 50: the suite's time; ``scripts/ckpt_torture.py`` runs as many as you ask.)"""
    r = run_script(
        "--trials",
        "30",
        "--kills-per-dir",
        "5",
        "--max-steps",
        "20",
        "--jobs",
        "2",
        "--seed",
        "7",
        "--workdir",
        str(tmp_path / "w"),
        "--progress",
        "25",
        timeout=220,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    s = parse_summary(r.stdout)
    assert s["trials"] == 30 and s["kills"] == 30, out[-2000:]
    assert s["failures"] == 0
    assert s["trial_dirs"] >= 6 and s["dirs_ok"] == s["trial_dirs"], out[-2000:]
    # the point of the exercise: many kills land while a checkpoint is being written
    assert s["during_save"] >= 9, f"only {s['during_save']} of 30 kills landed during a save:\n{out[-2000:]}"
    assert not list((tmp_path / "w").glob("trial-*")), "passed trial directories are removed"


@pytest.mark.soak
@pytest.mark.timeout(240)
def test_torture_exec_mode_and_planted_bugs(tmp_path):
    """Writers as fresh interpreters pass; writers with a planted bug are each caught.

    Run concurrently (each is mostly waiting on fsync and interpreter start-up).
    """
    common = ["--jobs", "1", "--max-steps", "12", "--early-fraction", "0", "--progress", "100"]
    runs = {
        "exec": ["--mode", "exec", "--trials", "2", "--kills-per-dir", "2"],
        "partial-dir": ["--inject", "partial-dir", "--trials", "6", "--kills-per-dir", "3"],
        "early-retention": ["--inject", "early-retention", "--trials", "6", "--kills-per-dir", "3"],
        "lost-data-position": ["--inject", "lost-data-position", "--trials", "2", "--kills-per-dir", "2"],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(SCRIPT), *args, *common, "--workdir", str(tmp_path / name)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
        )
        for name, args in runs.items()
    }
    outs = {}
    try:
        for name, p in procs.items():
            outs[name] = (p.communicate(timeout=200)[0], p.returncode)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    out, code = outs["exec"]
    assert code == 0, out[-4000:]
    s = parse_summary(out)
    assert s["kills"] == 2 and s["failures"] == 0 and s["dirs_ok"] == 1, out[-2000:]

    expected = {
        "partial-dir": "is committed but does not verify",  # invariant 1
        "early-retention": "was committed (event), but latest_valid()",  # invariant 2
        "lost-data-position": "differs from the reference",  # bit-identical resume
    }
    for name, needle in expected.items():
        out, code = outs[name]
        assert code == 1, f"{name}: the torture did not fail:\n{out[-3000:]}"
        assert parse_summary(out)["failures"] >= 1
        assert needle in out, f"{name}: expected a failure mentioning {needle!r}:\n{out[-3000:]}"


# ---------------------------------------------------------------------------------------------
# (b) corruption of the newest checkpoint


CORRUPTIONS = {
    "flipped-byte": (lambda c: flip_byte(c / "__0_0.distcp"), "__0_0.distcp checksum mismatch"),
    "truncated": (lambda c: truncate(c / "rank-00000.pt"), "rank-00000.pt has"),
    "manifest-deleted": (delete_manifest, "manifest.json is missing"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_newest_checkpoint_falls_back(ckpt_set, kind, clean_sha):
    run, root = ckpt_set, ckpt_set / "checkpoints"
    corrupt, reason = CORRUPTIONS[kind]
    newest = root / "step-00000004"
    corrupt(newest)
    assert reason in (mf.verify(newest) or "")

    skipped = []
    best = CheckpointStore(root, on_invalid=lambda c, r: skipped.append((c.step, r))).latest_valid()
    assert best is not None and best.step == 3
    assert mf.verify(best.path) is None
    assert [s for s, _ in skipped] == [4] and reason in skipped[0][1]

    guard = train(run, 6, keep_last=3)  # a new Guard on the same run dir resumes
    invalid = events(run, "checkpoint_invalid")
    assert len(invalid) == 1, invalid
    assert invalid[0]["step"] == 4 and reason in invalid[0]["details"]["reason"]
    assert invalid[0]["details"]["path"] == str(newest)
    resumes = events(run, "resume")
    assert len(resumes) == 1 and resumes[0]["details"]["from_step"] == 3
    assert events(run, "start")[-1]["details"]["first_step"] == 3
    # the corrupt data was not loaded: the run ends exactly like an uninterrupted one
    assert guard.state_sha256 == clean_sha(6)
    best = CheckpointStore(root).latest_valid()
    assert best is not None and best.step == 6


@pytest.mark.timeout(60)
def test_corrupt_older_checkpoints_do_not_matter(ckpt_set):
    """Only the newest is read when it verifies; corrupt older ones are skipped further down."""
    root = ckpt_set / "checkpoints"
    flip_byte(root / "step-00000003" / "__0_0.distcp")
    delete_manifest(root / "step-00000002")
    assert CheckpointStore(root).latest_valid().step == 4
    flip_byte(root / "step-00000004" / "rank-00000.pt")
    assert CheckpointStore(root).latest_valid() is None, "no checkpoint verifies any more"
    assert CheckpointStore(root).latest_valid(verify="size").step == 4, "size mode does not read the data"


# ---------------------------------------------------------------------------------------------
# (c) retention and stale temporary directories


class Recorder(trainguard.Hook):
    def __init__(self):
        self.begin_listing: list[str] = []
        self.after_save: list[tuple[int, list[int], int]] = []

    def on_train_begin(self, guard):
        root = guard.store.root
        self.begin_listing = sorted(os.listdir(root)) if root.is_dir() else []

    def on_checkpoint_save(self, guard, step, path):
        best = guard.store.latest_valid()
        self.after_save.append((step, [c.step for c in guard.store.committed()], best.step if best else None))


@pytest.mark.timeout(60)
def test_retention_keeps_exactly_newest_two(tmp_path):
    run = tmp_path / "run"
    rec = Recorder()
    train(run, 6, keep_last=2, hooks=[rec])
    assert rec.after_save == [(1, [1], 1)] + [(k, [k - 1, k], k) for k in range(2, 7)]
    deleted = [e["details"]["deleted_steps"] for e in events(run, "checkpoint_committed")]
    assert deleted == [[], [], [1], [2], [3], [4]]
    root = run / "checkpoints"
    assert sorted(os.listdir(root)) == ["step-00000005", "step-00000006"]
    assert all(mf.verify(root / n) is None for n in os.listdir(root))


@pytest.mark.timeout(60)
def test_stale_tmp_is_invisible_and_cleaned_at_next_start(tmp_path, clean_sha):
    run = tmp_path / "run"
    train(run, 3, keep_last=2)
    root = run / "checkpoints"
    # leftovers of a killed writer: a *complete-looking* newer temporary checkpoint, a half-written
    # one for the very next step, and a half-deleted old one
    shutil.copytree(root / "step-00000003", root / ".tmp-step-00000009")
    (root / ".tmp-step-00000004").mkdir()
    (root / ".tmp-step-00000004" / "__0_0.distcp").write_bytes(b"\0" * 100)
    shutil.copytree(root / "step-00000002", root / ".trash-step-00000001")
    assert mf.verify(root / ".tmp-step-00000009") is None  # it would verify: only its name hides it

    skipped = []
    best = CheckpointStore(root, keep_last=2, on_invalid=lambda c, r: skipped.append(c)).latest_valid()
    assert best.step == 3 and skipped == []
    assert steps_of(root) == [2, 3]

    rec = Recorder()
    guard = train(run, 5, keep_last=2, hooks=[rec])
    assert rec.begin_listing == ["step-00000002", "step-00000003"], "stale .tmp-/.trash- dirs not removed at start"
    assert events(run, "resume")[-1]["details"]["from_step"] == 3
    assert guard.state_sha256 == clean_sha(5)
    assert sorted(os.listdir(root)) == ["step-00000004", "step-00000005"]


# ---------------------------------------------------------------------------------------------
# (d) a checkpoint of another model is refused and left alone


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "change,first_key",
    [
        ({"in_dim": 24}, "0.weight"),  # 0.bias keeps its shape, 0.weight is the first that differs
        ({"hidden": 40}, "0.bias"),  # keys are compared in sorted order: 0.bias < 0.weight
    ],
)
def test_other_model_is_refused_without_touching_the_store(tmp_path, change, first_key):
    run = tmp_path / "run"
    train(run, 3, keep_last=3)
    root = run / "checkpoints"
    before = snapshot(root)
    manifests = {p.parent.name: mf.read_manifest(p.parent) for p in root.glob("step-*/manifest.json")}
    assert len(manifests) == 3

    dims = {**DIMS, **change}
    r = run_script(
        "--child",
        str(run),
        "--max-steps",
        "6",
        "--in-dim",
        str(dims["in_dim"]),
        "--hidden",
        str(dims["hidden"]),
        "--out-dim",
        str(dims["out_dim"]),
        timeout=80,
    )
    assert r.returncode == 2, f"exit code {r.returncode}\n{r.stderr[-3000:]}"
    errors = [line for line in r.stderr.splitlines() if line.startswith("trainguard: error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    named = re.findall(r"key '([^']+)'", errors[0])
    assert named[:1] == [first_key], errors[0]
    assert "does not fit this model" in errors[0]

    assert snapshot(root) == before, "the refused run changed the checkpoint store"
    assert {p.parent.name: mf.read_manifest(p.parent) for p in root.glob("step-*/manifest.json")} == manifests
    bad = events(run, "bad_input")
    assert len(bad) == 1 and first_key in bad[0]["details"]["message"]
    assert events(run, "resume") == [] and len(events(run, "checkpoint_committed")) == 3


# ---------------------------------------------------------------------------------------------
# invalid newer step directories must neither block a save nor push good checkpoints out


@pytest.mark.timeout(60)
def test_resume_over_invalid_newest_saves_that_step_again(ckpt_set):
    run, root = ckpt_set, ckpt_set / "checkpoints"
    delete_manifest(root / "step-00000004")
    train(run, 4, keep_last=3)  # resumes from 3, trains step 4, saves it (final save)
    assert events(run, "checkpoint_failed") == []
    best = CheckpointStore(root).latest_valid()
    assert best is not None and best.step == 4


@pytest.mark.timeout(60)
def test_retention_never_deletes_newest_verified_next_to_corrupt_newer_dirs(tmp_path):
    run = tmp_path / "run"
    train(run, 4, keep_last=2)
    root = run / "checkpoints"
    for s in (10, 11):  # newer step dirs that do not verify (bit rot, a bad copy, ...)
        shutil.copytree(root / "step-00000004", root / f"step-{s:08d}")
        flip_byte(root / f"step-{s:08d}" / "__0_0.distcp")
    rec = Recorder()
    train(run, 6, keep_last=2, hooks=[rec])  # resumes from 4, commits 5 and 6
    assert [best for _, _, best in rec.after_save] == [5, 6]
    best = CheckpointStore(root).latest_valid()
    assert best is not None and best.step == 6


def test_a_rank_killed_inside_dcp_makes_every_survivor_leave_the_save_with_a_lost_peer(tmp_path):
    """Rank 2 of 4 dies inside DCP's save, while it plans its shard (seed 4 of the 4-rank kill
    campaign in tests/test_any_loop.py found it). The survivors leave ``write_checkpoint`` at once,
    from DCP, with the lost-peer error, which in-process recovery catches. None turns it into a
    failed write and goes on to the save's next collective (a barrier): in that campaign run the
    coordinator waited there on a live rank that was still inside DCP waiting for it, until the
    generation's timeout. Nothing is committed."""
    worker = Path(__file__).parent / "save_kill_worker.py"
    init, ckpt, out = tmp_path / "init", tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(r), "4", str(init), str(ckpt), str(out), "2"], env=env, cwd=REPO
        )
        for r in range(4)
    ]
    try:
        wait_for(lambda: all(p.poll() is not None for p in procs), timeout=180, what="every rank to leave the save")
    finally:
        for p in procs:
            p.kill()
    said = {r: json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1, 3)}
    assert all(s["peer_lost"] for s in said.values()), said
    # at once, from DCP: not as a failed write that went on to the save's barrier
    assert all(s["raised_at"].startswith("dcp.save(") for s in said.values()), said
    assert procs[2].returncode == -9
    assert steps_of(ckpt) == []
