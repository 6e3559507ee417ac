"""What the hang supervisors of several nodes tell each other: "a rank of mine is slow, not hung".

Each node's supervisor sees its own ranks only. When a rank of node A is silent past its timeout
but busy (its main thread computes, or does I/O that makes progress: :mod:`.evidence`), the ranks of
node B wait for it inside a collective: silent, idle, and over their own timeouts soon after. Without
word from A, B's supervisor would kill them as hung. So A says it in the recovery store the nodes
share (sealed with the launch's secret: :class:`~trainguard.rejoin.protocol.RecoveryStore`) every
poll while it lasts, and B reads it before it calls its silent ranks hung.
"""

from __future__ import annotations

import time
from typing import Any, Optional

# Seconds that a node's word holds for the others: it is repeated every poll (0.1 s) while it
# lasts; 2 s cover a late poll and the difference of NTP-synchronized clocks.
BUSY_FRESH = 2.0

# Seconds past its timeout that an idle silent rank of a node among several is given before it is
# called hung: the slow rank's node says so only once its own rank crosses its timeout and its CPU
# sample shows work (0.1-0.3 s later), and the ranks waiting for it cross theirs about then. Without
# the grace, a poll of the waiting node that came first took them for hung (the 2x2 campaign trial,
# seed 1099, once in several CI runs). A real hang on several nodes is called 1 s later; a stopped
# rank (state T) gets no grace.
WORD_GRACE = 1.0


class BusyPeers:
    """This node's side of the word (``node`` of ``nodes``), through ``store`` (a RecoveryStore).
    A store that fails (node 0's launcher left) ends the exchange: each node judges alone again."""

    def __init__(self, store: Any, node: int, nodes: int):
        self.store, self.node, self.nodes = store, node, nodes

    def tell(self) -> None:
        """A rank of this node is slow, not hung, now."""
        if self.store is None:
            return
        try:
            self.store.busy(self.node, time.time())
        except (RuntimeError, OSError):
            self.store = None

    def busy_node(self) -> Optional[int]:
        """Another node that said so within :data:`BUSY_FRESH` seconds, ``None`` if none."""
        if self.store is None:
            return None
        try:
            return self.store.busy_elsewhere(self.node, self.nodes, time.time() - BUSY_FRESH)
        except (RuntimeError, OSError):
            self.store = None
            return None
