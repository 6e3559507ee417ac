"""A spare node's launcher: warm spares that wait for a lost node's ranks (see :mod:`.nodes`).

A launcher that arrives beyond ``--nnodes MIN`` (with ``MIN:MAX``, ``[recovery] spare_nodes``)
does not enter the group: it finds node 0's recovery store (``RUN_DIR/.recovery-store``), takes a
spare number there, starts ``--nproc-per-node`` warm spares (``python -m
trainguard.rejoin.replacement --spare ID``: each runs the script up to ``init_process_group`` or
its first read of its rank and waits) and beats. When node 0 finds a node lost, it assigns these
spares the lost node's ranks; they join the survivors' next generation and take the model and
optimizer from a survivor and their own state (data position, RNG streams) from the copy the lost
ranks kept in the recovery store. The launcher then watches them as its workers until they exit.

When the job finishes first, the spares are stopped and the launcher exits 0. When one of its
ranks fails after it took a node's place, the group restarts (the survivors' generation times
out), and this launcher takes part in the next rendezvous as an ordinary node
(:func:`serve` returns ``None``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from .. import console
from ..events import EventLog
from ..launch_env import BOUNDARY_MIRROR, RECOVERY_NONCE, RECOVERY_STORE, SPARE_NODES
from ..rejoin.auth import Seal, reporter
from ..rejoin.protocol import connect, parse_address, spare_ready
from .nodes import STORE_FILE, Beat, NodeRegistry, agent_id
from .replace import replacement_command

POLL = 0.1  # seconds between looks


def find_store(run_dir: Path, seal: Seal, timeout: float) -> tuple[str, dist.TCPStore, Seal]:
    """Node 0's recovery store, from ``RUN_DIR/.recovery-store`` (``HOST:PORT NONCE``): its
    address, a connection and the seal of its launch (``seal`` under the store's nonce), once a
    store there answers with node 0's sealed record (a file an earlier launch left names a store
    that is gone, or another one: waited past).

    Raises:
        TimeoutError: none answered within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            address, _, nonce = (run_dir / STORE_FILE).read_text().strip().partition(" ")
            store = connect(*parse_address(address), 2.0)
            theirs = seal.under(bytes.fromhex(nonce))
            if NodeRegistry(store, theirs).active(0) is not None:
                return address, store, theirs
        except (OSError, ValueError, RuntimeError, dist.DistError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no recovery store of a running group answered from {run_dir / STORE_FILE} in {timeout:.0f} s")


def serve(
    run_dir: Path,
    seal: Seal,
    events: EventLog,
    nproc: int,
    argv: list[str],
    script: str,
    stop_signal: Callable[[], Optional[str]],
    timeout: float = 600.0,
) -> Optional[int]:
    """Wait as a spare node; returns the launch's exit code (0: the job finished, or this node's
    ranks did after taking a lost node's place; 75: a stop signal), or ``None`` when this node
    should take part in the group's next rendezvous instead.

    Args:
        run_dir: the run directory (node 0's store address is there).
        seal: the launch's secret.
        events: the launcher's event log.
        nproc: warm spares to start (``--nproc-per-node``).
        argv: a rank's command line (``python -u SCRIPT ARGS``, through the parent-death wrapper).
        script: the script's path as it appears in ``argv``.
        stop_signal: the name of the stop signal the launcher received, ``None`` while none.
        timeout: seconds to wait for node 0's store.

    Raises:
        TimeoutError: node 0's store did not answer within ``timeout``.
    """
    address, store, seal = find_store(run_dir, seal, timeout)
    refused = reporter(events)
    registry = NodeRegistry(store, seal, refused)
    me = registry.add_spare(os.uname().nodename, agent_id(), nproc)
    number = me.spare_ids[0] // 1_000_000
    nonce = seal.nonce.hex()
    env = {**os.environ, RECOVERY_STORE: address, RECOVERY_NONCE: nonce, BOUNDARY_MIRROR: "1", SPARE_NODES: "1"}
    procs = {sid: _start(argv, script, sid, env) for sid in me.spare_ids}
    beat = Beat(address, me.agent)
    started, ready = time.monotonic(), False
    try:
        while (taken := registry.assignment(number)) is None:
            if not ready and all(spare_ready(store, sid, seal, refused) for sid in procs):
                ready = True  # warm: every spare waits at the script's init_process_group
                seconds = round(time.monotonic() - started, 3)
                events.emit(
                    "spare_node_waiting", spare=number, pids={str(s): p.pid for s, p in procs.items()}, seconds=seconds
                )
                console.say(
                    f"spare node {number}: {nproc} warm spare(s) ready in {seconds:.1f} s, waiting for a lost node's ranks"
                )
            if registry.finished() or stop_signal() is not None:
                _kill(procs.values())
                return 0 if stop_signal() is None else 75
            for sid, proc in procs.items():
                if proc.poll() is not None:  # its script failed early: start it again
                    procs[sid] = _start(argv, script, sid, env)
            time.sleep(POLL)
        console.say(
            f"spare node {number} takes the place of node {taken.node} ({taken.lost_host}): rank(s) {list(taken.ranks)}"
        )
        return _watch(list(procs.values()), stop_signal)
    except (RuntimeError, dist.DistError) as e:  # node 0's store is gone: the job ended or restarts
        console.say(f"spare node {number}: node 0's recovery store is gone ({type(e).__name__}); stopping the spares")
        _kill(procs.values())
        return 0
    finally:
        try:
            registry.end(me.agent)  # not a lost node: its launch ends
        except (RuntimeError, dist.DistError):
            pass
        beat.stop()


def _start(argv: list[str], script: str, sid: int, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(replacement_command(argv, script, ["--spare", str(sid)]), env=env, start_new_session=True)


def _watch(procs: list[subprocess.Popen], stop_signal: Callable[[], Optional[str]]) -> Optional[int]:
    """This node's ranks after it took a lost node's place, until they exit: 0 when all exit 0,
    a decision code one exits with (75, 2, 76), ``None`` when one fails (the others are killed:
    the group restarts, and this node takes part)."""
    forwarded = False
    while True:
        codes = [p.poll() for p in procs]
        if stop_signal() is not None and not forwarded:
            forwarded = True
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, getattr(signal, stop_signal()))
        if all(c is not None for c in codes):
            return next((c for c in codes if c != 0), 0)
        if any(c not in (None, 0, 2, 75, 76) for c in codes):
            _kill(procs)
            return None
        time.sleep(POLL)


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
