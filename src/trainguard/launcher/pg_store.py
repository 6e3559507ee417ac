"""One node: the ranks' process-group store, served by the launcher on loopback.

A script's ``init_process_group`` (``env://``) makes rank 0 the server of the group's
``TCPStore`` on ``MASTER_ADDR:MASTER_PORT``; torch's ``TCPStore`` server listens on *every*
interface (``*:PORT`` in ``ss -ltn``), so on a one-node job anyone who reaches the host can write
the group's keys. torchrun avoids a second store by sharing its rendezvous store with the workers
(``TORCHELASTIC_USE_AGENT_STORE``), which trainguard turns off (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``:
a restarted gloo group met stale peer addresses in it, MEASURED.md).

:class:`LoopbackStores` wraps torch's rendezvous handler: at each rendezvous (each start of the
group) it serves a new ``TCPStore`` bound to ``127.0.0.1`` (:func:`~trainguard.rejoin.protocol.serve`),
gives its address to the workers as ``MASTER_ADDR``/``MASTER_PORT`` and tells them to use it as
clients (``use_agent_store``: every rank, rank 0 too, connects; none serves). A new store per start:
nothing of an earlier group's keys is left to meet. The previous start's store is closed then.
Only for a one-node launch (``--nnodes 1``, no ``--rdzv-endpoint``): other nodes' ranks must reach
the store over the network.

It is the one store of a one-node launch that other local users can connect to (issue 54 item 2):
the script's ``init_process_group()`` (``env://``) makes a ``TCPStore`` client and nothing else,
torch's ``TCPStore`` server refuses a Unix-domain socket (``master_listen_fd``: libuv answers
``ENOTSUP``), and its protocol has no authentication; docs/recovery.md's trust section says what
that leaves open. The generations of in-process recovery, whose ``init_process_group`` calls
trainguard makes or changes, form on files instead (:mod:`trainguard.rejoin.stores`).
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from ..rejoin.protocol import serve

LOOPBACK = "127.0.0.1"


class LoopbackStores(RendezvousHandler):
    """torch's rendezvous handler ``inner``, with the workers' process-group store served here on
    loopback (see the module's doc). Every other method is ``inner``'s.

    Args:
        inner: the handler of the launch's rendezvous (one node's, on loopback too).
    """

    def __init__(self, inner: RendezvousHandler):
        self.inner = inner
        self.store: Optional[dist.TCPStore] = None  # the current start's process-group store

    def next_rendezvous(self) -> RendezvousInfo:
        """``inner``'s rendezvous, its bootstrap store (the workers' ``MASTER_ADDR``/``MASTER_PORT``)
        replaced by a new loopback store of this process.

        Raises:
            as ``inner.next_rendezvous()``; OSError: no loopback port could be bound.
        """
        info = self.inner.next_rendezvous()
        self.store = None  # the previous start's server closes with its last reference
        self.store = serve(LOOPBACK)
        return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(LOOPBACK, self.store.port))

    @property
    def use_agent_store(self) -> bool:
        """Always: the workers are clients of the store served here (``TORCHELASTIC_USE_AGENT_STORE``)."""
        return True

    def get_backend(self) -> str:
        return self.inner.get_backend()

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        """``inner``'s shutdown; the last process-group store closes too."""
        self.store = None
        return self.inner.shutdown()
