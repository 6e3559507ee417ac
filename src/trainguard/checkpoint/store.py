"""The checkpoint store: one directory per step, committed atomically, kept by retention.

Layout under the store root (``RUN_DIR/checkpoints`` by default)::

    step-00001200/           a committed checkpoint: data files + manifest.json
    .tmp-step-00001300/      being written; never visible to latest_valid()
    .trash-step-00000900/    being deleted by retention
    .invalid-step-…, .rolledback-step-…   set aside (kept, never listed)

Commit protocol (DESIGN invariant 1): files are written into the ``.tmp-`` directory and
fsynced, the manifest is written last and fsynced, the directory is fsynced, then renamed to its
final name (an atomic ``rename(2)``) and the parent is fsynced. A crash at any moment leaves either
no ``step-`` directory or a complete one.

Retention (invariant 2) runs only after a commit, keeps the newest ``keep_last`` committed
checkpoints plus any protected ones, and deletes by first renaming to ``.trash-``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from ..atomic import write_atomic
from . import manifest as mf

log = logging.getLogger(__name__)
_NAME = re.compile(r"^step-(\d{8,})$")


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: its step and directory."""

    step: int
    path: Path


class CheckpointStore:
    """Directory-per-step checkpoint store with atomic commit, verification and retention.

    Args:
        root: store directory (created on first use).
        keep_last: committed checkpoints to keep (≥ 1).
        on_invalid: called as ``on_invalid(checkpoint, reason)`` for each checkpoint that
            ``latest_valid()`` skips (the Guard turns it into an event).
    """

    def __init__(
        self, root: str | Path, keep_last: int = 3, on_invalid: Optional[Callable[[Checkpoint, str], None]] = None
    ):
        if keep_last < 1:
            raise ValueError(f"keep_last must be ≥ 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.on_invalid = on_invalid

    def path_for(self, step: int) -> Path:
        """Final directory of the checkpoint at ``step``."""
        return self.root / f"step-{step:08d}"

    def tmp_path_for(self, step: int) -> Path:
        """Temporary directory a checkpoint at ``step`` is written into."""
        return self.root / f".tmp-step-{step:08d}"

    def committed(self) -> list[Checkpoint]:
        """Committed checkpoints (by name; not verified), oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir():
                found.append(Checkpoint(int(m.group(1)), p))
        return sorted(found, key=lambda c: c.step)

    def latest_valid(self, verify: str = "full", before: Optional[int] = None) -> Optional[Checkpoint]:
        """The newest committed checkpoint whose manifest verifies, or ``None``.

        Args:
            verify: ``"full"`` (sizes and checksums) or ``"size"``.
            before: only consider checkpoints with ``step < before``.
        Skipped checkpoints are logged with the reason and reported to ``on_invalid``.
        """
        for ckpt in reversed(self.committed()):
            if before is not None and ckpt.step >= before:
                continue
            reason = self.check(ckpt, verify)
            if reason is None:
                return ckpt
            log.warning("skipping checkpoint %s: %s", ckpt.path, reason)
            if self.on_invalid:
                self.on_invalid(ckpt, reason)
        return None

    def check(self, ckpt: Checkpoint, verify: str = "full") -> Optional[str]:
        """Why ``ckpt`` is not usable (``None`` if it is): the store, the checkpoint directory or
        one of its files could be another user's (:func:`~trainguard.rundir.exposed`: their
        manifest could be rewritten to match, and ``.metadata`` is unpickled on load), manifest
        verification, and the manifest's step must match the directory name (a renamed copy is
        refused)."""
        reason = _exposed(self.root, ckpt.path)  # before anything in it is read
        reason = reason or mf.verify(ckpt.path, verify)
        if reason is None:
            step = mf.read_manifest(ckpt.path)["step"]
            if step != ckpt.step:
                reason = f"manifest is for step {step}, directory says {ckpt.step}"
        return reason

    def set_aside(self, ckpt: Checkpoint, reason: str = "", kind: str = "invalid") -> Path:
        """Rename a checkpoint out of the way to ``.<kind>-step-N-<ns>`` (``invalid``: it does not
        verify; ``rolledback``: it is newer than the checkpoint a rollback returned to).

        It is kept for inspection (nothing is deleted), no longer listed or counted by retention,
        and no longer in the way of a new save of the same step.
        """
        aside = self.root / f".{kind}-{ckpt.path.name}-{time.time_ns()}"
        ckpt.path.rename(aside)
        mf.fsync_path(self.root)
        log.warning("set checkpoint %s aside as %s: %s", ckpt.path, aside.name, reason)
        return aside

    def set_aside_after(self, step: int, reason: str) -> list[Checkpoint]:
        """Set aside (``rolledback``) every committed checkpoint newer than ``step``: a rollback
        to ``step`` abandoned the trajectory they belong to. Returns them."""
        newer = [c for c in self.committed() if c.step > step]
        for c in newer:
            self.set_aside(c, reason, kind="rolledback")
        return newer

    def mark_known_good(self, ckpt: Checkpoint, healthy_steps: int) -> None:
        """Record in ``ckpt``'s manifest that ``healthy_steps`` steps after it were healthy.

        The manifest is rewritten atomically (temp file, fsync, rename, directory fsync): a crash
        leaves the old or the new manifest, both of which verify.
        """
        body = mf.read_manifest(ckpt.path)
        body["known_good"] = {"healthy_steps": healthy_steps, "time": round(time.time(), 3)}
        # the temp file lives in the store root under the .tmp- prefix (clean_stale removes it after
        # a crash), so a checkpoint directory never holds a file its manifest does not list
        write_atomic(
            ckpt.path / mf.MANIFEST,
            json.dumps(body, indent=1, sort_keys=True),
            tmp=self.root / f".tmp-manifest-{ckpt.path.name}",
        )

    def known_good(self, verify: str = "full", at_most: Optional[int] = None) -> Optional[Checkpoint]:
        """The newest verified checkpoint marked known-good with ``step <= at_most``, or ``None``."""
        for ckpt in reversed(self.committed()):
            if at_most is not None and ckpt.step > at_most:
                continue
            try:
                marked = "known_good" in mf.read_manifest(ckpt.path)
            except (OSError, ValueError):
                continue
            if marked and self.check(ckpt, verify) is None:
                return ckpt
        return None

    def clean_stale(self) -> list[Path]:
        """Delete leftovers of interrupted writes and deletions (``.tmp-*``, ``.trash-*``).

        Call only while no save is in progress (at start, under the run-dir lock).
        """
        removed = []
        if self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.startswith((".tmp-", ".trash-")):
                    if p.is_dir():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink(missing_ok=True)
                    removed.append(p)
        return removed

    def begin(self, step: int) -> Path:
        """Create an empty temporary directory for a checkpoint at ``step`` and return it."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.tmp_path_for(step)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(mode=0o700)
        return tmp

    def commit(self, tmp: Path, step: int, files: dict[str, dict], meta: dict) -> Checkpoint:
        """Write the manifest into ``tmp`` and atomically publish it as ``step-NNNNNNNN``.

        Args:
            tmp: the directory from :meth:`begin`, with every data file written and fsynced.
            files: manifest entries ``{name: {"size", "xxh3_128"}}`` for every data file.
            meta: extra manifest fields (world size, time, ...).
        Raises:
            FileExistsError: a checkpoint for ``step`` is already committed.
        """
        final = self.path_for(step)
        if final.exists():
            raise FileExistsError(f"checkpoint {final} already exists")
        private(tmp)
        mf.write_manifest(tmp, step, files, meta)
        mf.fsync_path(tmp)
        tmp.rename(final)
        mf.fsync_path(self.root)
        return Checkpoint(step, final)

    def apply_retention(
        self,
        protect: Iterable[int] = (),
        verify: str = "size",
        remove: Callable[[Path], object] = lambda p: shutil.rmtree(p, ignore_errors=True),
    ) -> list[int]:
        """Delete verified checkpoints beyond the newest ``keep_last`` verified ones, except ``protect``.

        Only checkpoints that verify (``"size"``: one ``stat`` per file) count and can be deleted;
        others are left alone, so a corrupt newer directory never pushes a good one out. The newest
        verified checkpoint is never deleted. A checkpoint is first renamed to ``.trash-…`` (atomic;
        from then on invisible), then ``remove(trash_path)`` deletes it (pass a function that hands it
        to a background thread to keep the deletion off the training loop; ``clean_stale`` removes
        a ``.trash-`` directory left by a crash). Returns the deleted steps.
        """
        ckpts = [c for c in self.committed() if _verifies(c, verify)]
        keep = {c.step for c in ckpts[-self.keep_last :]} | set(protect)
        deleted = []
        for c in ckpts[:-1]:
            if c.step in keep:
                continue
            trash = self.root / f".trash-{c.path.name}"
            c.path.rename(trash)
            remove(trash)
            deleted.append(c.step)
        if deleted:
            mf.fsync_path(self.root)
        return deleted


def _verifies(ckpt: Checkpoint, verify: str) -> bool:
    """Whether ``ckpt`` verifies now; one that cannot be read (a transient error) does not count
    (retention neither keeps nor deletes for it)."""
    try:
        return mf.verify(ckpt.path, verify) is None
    except mf.ReadError:
        return False


def private(directory: Path) -> None:
    """Make ``directory`` and the files in it (one level: a checkpoint is flat) its owner's only:
    mode 0700 and 0600. What ``torch.distributed.checkpoint`` and ``torch.save`` wrote follows
    the process's umask; a checkpoint is loaded only from a private directory (:meth:`CheckpointStore.check`).

    Raises:
        OSError: a mode cannot be changed.
    """
    directory.chmod(0o700)
    for p in directory.iterdir():
        if p.is_file() and not p.is_symlink():
            p.chmod(0o600)


def _exposed(root: Path, path: Path) -> Optional[str]:
    """Why the checkpoint directory ``path`` in the store ``root`` could hold another user's
    files, or ``None`` (:func:`~trainguard.rundir.exposed` of the store, the directory and each file)."""
    from ..rundir import exposed

    for p in (root, path, *sorted(path.iterdir())):
        why = exposed(p) if not p.is_symlink() else "it is a symbolic link"
        if why:
            return f"{p.name if p != root else p} is not private: {why}"
    return None
