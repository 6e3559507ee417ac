"""A rank's side of the recovery protocol over the launcher's store at an address (``file://PATH``
on one node), run as its own process by tests/test_private_stores.py: it opens the store as a rank
does (:func:`~trainguard.rejoin.stores.open_store`), waits for generation 1 (printing it), says
it joined, adds to the generation's step counter and prints ``done``.

Usage: ``recovery_store_client.py ADDRESS KEY_HEX NONCE_HEX``.
"""

from __future__ import annotations

import sys

from trainguard.rejoin.auth import Seal
from trainguard.rejoin.protocol import RecoveryStore
from trainguard.rejoin.stores import open_store


def main(argv: list[str]) -> int:
    address, key, nonce = argv[1], bytes.fromhex(argv[2]), bytes.fromhex(argv[3])
    store = RecoveryStore(open_store(address, 30.0), 1, Seal(key, nonce))
    gen = store.wait(1, timeout=60)
    print(f"generation {gen.to_json() if gen else None}", flush=True)
    if gen is None:
        return 1
    for rank in gen.members:
        store.joined(1, rank)
    store.stepped(1)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
