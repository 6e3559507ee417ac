"""A rank's own state at the last step boundary, kept where it outlives the rank.

What only one rank holds (its data position, its RNG streams, its micro-batch size, its instability
statistics; ``Guard.rank_state()``) is serialized at every step boundary, kept in memory (the
survivors restore it to redo an interrupted step) and written to a node-local file (a replacement
of the rank reads it there). The file is replaced atomically (write, then rename) but not
fsynced: it must outlive the process, not the machine; the launcher puts it on a memory-backed
file system where there is one (``/dev/shm``). A lost node loses it, and the launcher then falls
back to a group restart.

Cost: one ``torch.save`` of a few kilobytes and one rename per step (see
``benchmarks/rejoin_overhead.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from ..checkpoint.local import deserialize, serialize


def path_of(directory: Path, rank: int) -> Path:
    """The boundary file of global rank ``rank`` in the node-local ``directory``."""
    return directory / f"rank{rank}.boundary"


class BoundaryState:
    """This rank's state at its last step boundary.

    Args:
        directory: the node-local directory of the boundary files (``None``: memory only).
        rank: global rank.
    """

    def __init__(self, directory: Optional[Path], rank: int):
        self.path = path_of(directory, rank) if directory is not None else None
        self.blob: Optional[bytes] = None
        self.step: Optional[int] = None

    def keep(self, state: dict[str, Any]) -> None:
        """Keep ``state`` (``{"step": N, ...}``, tensors and plain values loadable with
        ``weights_only=True``) as the boundary of step ``N``.

        Raises:
            OSError: the file could not be written.
        """
        self.blob = serialize(state)
        self.step = int(state["step"])
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(self.blob)
            os.replace(tmp, self.path)

    def restore(self) -> dict[str, Any]:
        """The state last kept (a fresh copy).

        Raises:
            RuntimeError: nothing was kept yet.
        """
        if self.blob is None:
            raise RuntimeError("no step boundary state was kept yet")
        return deserialize(self.blob)

    def close(self) -> None:
        """Remove this rank's file (a finished or stopped rank leaves none behind)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def read(directory: Path, rank: int) -> dict[str, Any]:
    """A lost rank's last boundary state, for its replacement.

    Raises:
        FileNotFoundError: the rank kept none (it died before its first step boundary).
    """
    return deserialize(path_of(directory, rank).read_bytes())
