"""Cut this rank's connections of the groups it is about to leave, so that no survivor waits on it.

A collective that lost a peer fails on some survivors and leaves others waiting: in gloo's ring
all-reduce with rank 0 dead among 4, rank 1 (which reads from rank 0) fails at once, rank 2 waits
for rank 1's data. Rank 1 leaves the collective to recover, but gloo closes a group's connections
only when the group object is freed, and DDP's reducer, the failed work and the Python frames
keep it alive, so rank 2 would wait until the group's timeout (30 s and more) and the group
restarts. A survivor that caught the loss therefore shuts down, at once, every TCP connection of
the old groups (``socket.shutdown``; the file descriptors stay gloo's): the ranks waiting on it see
"Connection closed by peer" within milliseconds, catch it in turn and cut theirs, until every
survivor has left the collective.

Which connections are the groups': those to or from a port that some rank of the group listens on
(gloo's listeners; each rank reports its own with :func:`listening_ports`, gathered at the start
and after each recovery). The stores' connections (the launcher's rendezvous and recovery stores,
hosted by the launcher) and the script's own connections to other services are not cut.

NCCL needs none of this: its communicator's abort ends the collectives of every rank in it.
"""

from __future__ import annotations

import contextlib
import os
import socket

import psutil


def listening_ports() -> list[int]:
    """The TCP ports this process listens on (its process groups' gloo listeners among them)."""
    return sorted(
        {c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    )


def cut(ports: set[int]) -> int:
    """Shut down (both directions) every established TCP connection of this process whose local or
    remote port is in ``ports``; the number cut. Errors on a single socket are ignored (it may be
    closing already)."""
    n = 0
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN or not c.raddr or c.fd < 0:
            continue
        if c.laddr.port in ports or c.raddr.port in ports:
            with contextlib.suppress(OSError):
                s = socket.socket(fileno=os.dup(c.fd))
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
                finally:
                    s.close()  # the duplicate only: gloo's descriptor stays open (and now at end of file)
    return n
