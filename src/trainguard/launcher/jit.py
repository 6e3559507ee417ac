"""The launcher's side of the just-in-time save: before a group restart, the last completed step.

When the agent restarts the group after a lost or hung rank, it first asks its node's ranks to
save the last completed step from memory (:mod:`trainguard.guard.jit_save`), then stops them and
makes the missing copies, so the restarted group resumes from that step instead of the newest
checkpoint (:mod:`trainguard.checkpoint.jit`):

1. :meth:`JitCollector.request`: ``request.json`` in the attempt's node-local ``jit`` directory
   (each rank's thread polls for it; a rank leaving on a lost peer has saved already).
2. :meth:`JitCollector.wait`: until every rank answered (``result-RANK.json``) or ended, or the
   ranks still silent can be made without them (an answer names a step that their node-local
   boundary files hold), at most ``[checkpoint.jit] timeout`` seconds.
3. The agent stops the ranks (nothing writes a copy any more), then :meth:`JitCollector.compose`:
   the step most answers name; the answers' model files must be equal (a replicated model: each
   replica holds the same; any difference is silent data corruption or a torn state, and no copy
   is made); every rank of this node without a copy of that step gets one made of a survivor's
   model file and the rank state its boundary file holds for that step. One console line and
   a ``checkpoint_committed`` event (kind ``jit``) say what was saved and how, or why not.

Several nodes: each node's agent does this for its own ranks; a lost node's ranks have no copy
(their boundary files were on it), and the restarted group resumes from the newest checkpoint
(the resume takes a just-in-time step only when every rank has a copy of it).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from .. import console
from ..atomic import write_atomic
from ..checkpoint.jit import DIRNAME, EARLY, REQUEST, JitStore, result_path
from ..checkpoint.store import Checkpoint
from ..events import EventLog
from ..rejoin.boundary import read as read_boundaries
from ..rejoin.rank import LOCAL_PARTS
from ..supervisor.monitor import attempt_dir

POLL_SECONDS = 0.01


class JitCollector:
    """One node's just-in-time saves, one per attempt of the group.

    Args:
        store_root: the run's just-in-time copies (``CHECKPOINTS/jit``).
        hb_root: the launch's node-local heartbeat directory (each attempt's ``jit`` directory is in it).
        timeout: ``[checkpoint.jit] timeout``, seconds.
        events: the launcher's event log.
    """

    def __init__(self, store_root: Path, hb_root: Path, timeout: float, events: EventLog):
        self.store, self.hb_root, self.timeout, self.events = JitStore(store_root), hb_root, timeout, events
        self._asked: dict[int, float] = {}  # attempt -> monotonic time of its request
        self.saved: dict[int, int] = {}  # attempt -> the step its ranks' copies hold (this node's)

    def directory(self, attempt: int) -> Path:
        """Attempt ``attempt``'s node-local ``jit`` directory."""
        return attempt_dir(self.hb_root, attempt) / "jit"

    def request(self, attempt: int) -> bool:
        """Ask the ranks of ``attempt`` to save; ``False``: asked already, or no rank kept a step."""
        directory = self.directory(attempt)
        if attempt in self._asked or not any(directory.glob("rank*.boundary.*")):
            return False  # asked already, or no rank completed a step in this attempt
        self._asked[attempt] = time.monotonic()
        write_atomic(directory / REQUEST, json.dumps({"at": time.time()}))
        return True

    def wait(self, attempt: int, procs: dict[int, subprocess.Popen], ranks: dict[int, int]) -> None:
        """Until each rank of ``procs`` (local rank → process; ``ranks``: local → global rank)
        answered or ended, or the silent ones can be made from their boundary files, at most the
        timeout from the request."""
        directory, deadline = self.directory(attempt), self._asked[attempt] + self.timeout
        while time.monotonic() < deadline:
            silent = [r for r, p in procs.items() if p.poll() is None and not result_path(directory, ranks[r]).exists()]
            if not silent:
                return
            steps = {a["step"] for a in self._answers(directory, ranks.values()).values() if "step" in a}
            # a silent rank whose copy can be made from its files (kept at the boundary, or as its update
            # began: compose decides): a replacement started for the failed generation holds no state to give
            if steps and all(_made_steps(directory, ranks[r]) & steps for r in silent):
                return
            time.sleep(POLL_SECONDS)

    def compose(self, attempt: int, ranks: dict[int, int], world_size: int) -> Optional[int]:
        """After the ranks were stopped: make this node's missing copies; say what was saved.
        Returns the step saved for every rank of this node, or ``None``."""
        directory = self.directory(attempt)
        asked = self._asked.get(attempt)
        if asked is None:
            return None
        answers = self._answers(directory, ranks.values())
        saved = {r: a for r, a in answers.items() if "step" in a}
        step, why = self._step(saved, answers)
        made: dict[int, int] = {}
        if step is not None:
            at_step = [a for a in saved.values() if a["step"] == step]
            source = Checkpoint(step, Path(at_step[0]["path"]))
            still = all(a.get("still_after_update") for a in at_step)
            for rank in sorted(ranks.values()):
                if rank in saved and saved[rank]["step"] == step:
                    continue
                state, why = self._state_of(directory, rank, step, source, still)
                if state is None:
                    break
                meta = {
                    "world_size": world_size,
                    "rank": rank,
                    "reason": "composed",
                    "from_rank": source.path.parent.name,
                }
                try:
                    self.store.compose(rank, source, state, meta)
                except OSError as e:
                    why = f"rank {rank}'s copy could not be written: {e}"
                    break
                made[rank] = step
        seconds = round(time.monotonic() - asked, 4)
        if why is not None:
            self.events.emit("jit_save_failed", reason=why, seconds=seconds, answers=answers)
            console.say(f"no just-in-time save ({why}): the group restarts from the newest checkpoint")
            return None
        copies = [self.store.path(r, step) for r in sorted(ranks.values())]
        self.events.emit(  # the fields of every checkpoint_committed, so the report reads it as one
            "checkpoint_committed",
            step,
            kind="jit",
            reason="jit",
            path=str(self.store.root),
            saved_by=sorted(r for r, a in saved.items() if a["step"] == step),
            composed=sorted(made),
            answers=answers,
            bytes=sum(f.stat().st_size for c in copies for f in c.iterdir()),
            seconds=seconds,
            blocked_seconds=0.0,  # training had stopped already (the failure)
            started=round(time.time() - seconds, 3),
            asynchronous=False,
            deleted_steps=[],
        )
        console.say(
            f"saved step {step} just in time in {seconds:.2f} s (rank(s) {sorted(set(ranks.values()) - set(made))} "
            f"from memory, {sorted(made) or 'none'} from their step-boundary files)"
        )
        self.saved[attempt] = step
        return step

    def _state_of(
        self, directory: Path, rank: int, step: int, source: Checkpoint, still: bool
    ) -> tuple[Optional[dict[str, Any]], Optional[str]]:
        """Rank ``rank``'s rank state at ``step``: kept at that step's boundary, else made of a
        survivor's (``source``: the parts alike on every rank) and the rank's own parts kept as its
        update of that step began, where the survivors' own parts did not move from there to the
        boundary (``still``: the same loop). ``(None, why)`` when neither holds."""
        kept = _boundaries(directory, rank)
        if step in kept:
            return kept[step], None
        early = _boundaries(directory / EARLY, rank)
        if step in early and still:
            own = {k: v for k, v in early[step].items() if k in LOCAL_PARTS}
            return {**self.store.rank_state(source), **own, "step": step}, None
        if step in early:
            return None, (
                f"rank {rank} was lost after its update of step {step} began, and the loop moves its own "
                "state after that"
            )
        return None, f"rank {rank} kept no state of step {step} (kept {sorted(set(kept) | set(early)) or 'none'})"

    @staticmethod
    def _step(
        saved: dict[int, dict[str, Any]], answers: dict[int, dict[str, Any]]
    ) -> tuple[Optional[int], Optional[str]]:
        """The step most answers saved, checked: every answer of it holds the same model file."""
        if not saved:
            said = "; ".join(f"rank {r}: {a.get('none')}" for r, a in sorted(answers.items())) or "no rank answered"
            return None, f"no rank saved its state ({said})"
        counts = Counter(a["step"] for a in saved.values())
        step = max(counts, key=lambda s: (counts[s], s))
        sums = {a["model"] for a in saved.values() if a["step"] == step}
        if len(sums) > 1:
            return None, f"the ranks' model states differ at step {step} (replicas must be equal)"
        return step, None

    @staticmethod
    def _answers(directory: Path, ranks: Any) -> dict[int, dict[str, Any]]:
        found = {}
        for rank in ranks:
            try:
                found[rank] = json.loads(result_path(directory, rank).read_text())
            except (OSError, ValueError):
                continue
        return found


def _boundaries(directory: Path, rank: int) -> dict[int, dict[str, Any]]:
    try:
        return read_boundaries(directory, rank)
    except Exception:  # noqa: BLE001 (none kept, or a file that does not decode: no copy from it)
        return {}


def _made_steps(directory: Path, rank: int) -> set[int]:
    """The steps rank ``rank``'s copy may be made of from its files: its boundaries, and the steps
    whose update it had begun (:meth:`JitCollector._state_of`)."""
    return set(_boundaries(directory, rank)) | set(_boundaries(directory / EARLY, rank))


def collector(enabled: bool, timeout: float, monitor: Any, hb_root: Path, events: EventLog) -> Optional[JitCollector]:
    """The launch's collector: ``[checkpoint.jit]`` on and the hang supervisor (``monitor``) on
    (the ranks keep their part in its node-local directory), else ``None``."""
    if not enabled or monitor is None:
        return None
    return JitCollector(monitor.store.root / DIRNAME, hb_root, timeout, events)
