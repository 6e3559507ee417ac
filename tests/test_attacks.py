"""A co-tenant attacks a real one-node launch (issue 54): a second, unprivileged user of the node
(made for the test, removed after) connects to the launcher's rendezvous store on loopback, as any
local user can, and tries what issue 54 found: a pickle that runs code as the launching user,
garbage, a 2 MiB value, deleted keys, a replayed state. The launch must refuse each with a
``security`` event, run nothing, and finish with the right result.

The unit tests of the sealed rendezvous state (:mod:`trainguard.launcher.sealed_rdzv`) over a real
store are here too."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from trainguard.launcher.sealed_rdzv import KEY, MAX_STATE_BYTES, SealedBackend, decode_state, encode_state
from trainguard.rejoin.auth import Seal

HERE = Path(__file__).resolve().parent
SEAL = Seal(bytes(range(32)), b"n" * 16)


@pytest.fixture
def mallory():
    """A second, unprivileged user of this node (removed after the test); skipped unless root."""
    if os.geteuid() != 0:
        pytest.skip("making a second user needs root")
    name = f"tgm{uuid.uuid4().hex[:8]}"
    r = subprocess.run(["useradd", "-M", "-s", "/bin/sh", name], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"useradd failed: {r.stderr.strip()}")
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def as_user(user: str, *argv: str, **kwargs) -> subprocess.Popen:
    """``argv`` run as ``user`` (through ``su``), stdin and stdout piped."""
    command = " ".join(f"'{a}'" for a in argv)
    return subprocess.Popen(
        ["su", "-s", "/bin/sh", user, "-c", f"exec {command}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def attack_as(user: str, *args: str) -> subprocess.Popen:
    """``tests/store_attacker.py ARGS`` run as ``user`` (see tests/run_as.py: it starts as root and
    drops to ``user`` once its imports are loaded), stdin and stdout piped."""
    argv = [sys.executable, str(HERE / "run_as.py"), user, str(HERE / "store_attacker.py"), *args]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listeners(pid: int, least: int) -> list[tuple[str, int]]:
    """The listening TCP addresses of process ``pid`` and its children, when there are ``least``."""
    import psutil

    found = []
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            found += [(c.laddr.ip, c.laddr.port) for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            pass
    return found if len(found) >= least else []


# ---- the sealed state over a real store -----------------------------------------------------------


def a_state(nodes: int = 2):
    state = _RendezvousState()
    now = datetime.now(timezone.utc)
    for i in range(nodes):
        node = _NodeDesc(f"host{i}", 100 + i, i)
        state.participants[node] = i
        state.last_heartbeats[node] = now
    state.wait_list.add(_NodeDesc("late", 7, 0))
    state.round, state.complete, state.deadline = 3, True, now + timedelta(seconds=30)
    return state


def test_the_state_round_trips_as_json_and_every_field_is_checked():
    state = a_state()
    back, seq = decode_state(encode_state(state, 5))
    assert (vars(back), seq) == (vars(state), 5)
    assert b"\x80" not in encode_state(state, 1)  # JSON, no pickle opcodes
    bad = encode_state(state, 1).replace(b'"round":3', b'"round":"3"')
    with pytest.raises(ValueError, match="round"):
        decode_state(bad)


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield s


def backend(store, told):
    return SealedBackend(store, "job", SEAL, lambda key, why, detail: told.append(why))


def test_refused_values_read_as_the_last_verified_state_and_the_next_write_replaces_them(store, tmp_path):
    """A pickle that would run code, garbage, an oversize value, a deleted key and a replayed
    earlier write: each is told once (``why``), reads as the last verified state, never reaches
    ``pickle.loads`` (the bytes returned are the pickle of a state built here), and the next
    write of torch's handler (its token) replaces it. A deleted key is seen at once, not after
    the store's 30 s timeout."""
    told: list[str] = []
    b = backend(store, told)
    assert b.get_state() is None
    state = a_state()
    bits, token, ok = b.set_state(pickle.dumps(state), None)
    assert ok and pickle.loads(bits).__dict__ == state.__dict__
    first = token
    state.round = 4
    _, token, ok = b.set_state(pickle.dumps(state), token)
    assert ok
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    key = KEY.format("job")
    for why, write in [
        ("forged", lambda: store.set(key, pickle.dumps(Payload()))),
        ("forged", lambda: store.set(key, b"\x00garbage")),
        ("oversize", lambda: store.set(key, b"x" * (MAX_STATE_BYTES + 1))),
        ("deleted", lambda: store.delete_key(key)),
        ("replayed", lambda: store.set(key, first)),
    ]:
        write()
        t0 = time.monotonic()
        for _ in range(2):  # a value read twice is told once
            bits, token = b.get_state()
            assert pickle.loads(bits).__dict__ == state.__dict__
        assert time.monotonic() - t0 < 5
        assert told[-1] == why
        _, token, ok = b.set_state(pickle.dumps(state), token)
        assert ok, why  # the handler's next write heals the store
    assert told == ["forged", "forged", "oversize", "deleted", "replayed"]
    assert not marker.exists()


def test_another_keys_or_launchs_seal_does_not_open(store):
    told: list[str] = []
    mine = backend(store, told)
    mine.set_state(pickle.dumps(a_state()), None)
    theirs = SealedBackend(store, "job", Seal(bytes(range(32)), b"m" * 16), lambda k, w, d: told.append(w))
    bits, _ = theirs.get_state()
    assert told == ["replayed"] and pickle.loads(bits).participants == {}


# ---- a real launch, attacked by another user ---------------------------------------------------


def test_a_co_tenant_cannot_run_code_crash_or_hang_a_launch_through_its_rendezvous_store(tmp_path, mallory):
    """A one-node launch of two gloo ranks with its rendezvous store on ``127.0.0.1:PORT``
    (``--rdzv-endpoint``, where issue 54 ran code as the launching user); every store listens on
    loopback only (before, the process group's store was on ``*:PORT``). While the ranks wait,
    another user writes a code-running pickle under torch's key and trainguard's, then garbage, a
    2 MiB value, deletes both keys and writes back an earlier sealed state. The launcher tells
    each (``security`` events with their ``why``), runs nothing, and the ranks then all-reduce and
    the launch ends 0 with the right sum. Before the sealed backend, torch's handler unpickled the
    payload within about a second (the marker file appeared, as root)."""
    from conftest import events, finish, launch, wait_for

    run, port, rid = tmp_path / "run", free_port(), uuid.uuid4().hex
    marker, go, out = tmp_path / "ran-as-launcher", tmp_path / "go", tmp_path / "out"
    proc = launch(
        run,
        script=HERE / "gate_worker.py",
        tiny=False,
        script_args=(str(go), str(out)),
        # heartbeats each second (a node is dead after 30 missed): the store heals sooner after an attack
        extra=("--nnodes", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rid)
        + ("--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=30"),
    )
    attacker = attack_as(mallory, str(port), rid, str(marker))
    try:
        assert attacker.stdout.readline().strip() == "ready"
        listening = wait_for(lambda: listeners(proc.pid, 2), what="the rendezvous and process-group stores")
        assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening  # before: the group's store on *:PORT

        def refused(why: str, times: int):
            assert not marker.exists(), f"the payload ran as uid {marker.read_text().strip()}"
            assert proc.poll() is None, f"the launcher ended {proc.returncode} during the attacks"
            return [e["details"]["why"] for e in events(run, "security")].count(why) >= times

        stages = [("pickle", "forged", 1), ("garbage", "forged", 2), ("oversize", "oversize", 1)]
        for attack, why, times in [*stages, ("delete", "deleted", 1), ("replay", "replayed", 1)]:
            attacker.stdin.write(attack + "\n")
            attacker.stdin.flush()
            assert attacker.stdout.readline().strip() == f"done {attack}"
            wait_for(lambda w=why, t=times: refused(w, t), timeout=60, what=f"the launcher's refusal of {attack}")
        go.touch()
        assert finish(proc, timeout=120) == 0, Path(f"{run}.log").read_text()[-3000:]
    finally:
        attacker.stdin.close()
        attacker.wait(timeout=30)
        if proc.poll() is None:
            proc.kill()
    assert not marker.exists()
    assert out.read_text() == "12.0"
    whys = [e["details"]["why"] for e in events(run, "security")]
    assert set(whys) >= {"forged", "oversize", "deleted", "replayed"}, whys


def test_a_one_node_launchs_rendezvous_store_is_out_of_another_users_reach(tmp_path, mallory):
    """A one-node launch (no ``--rdzv-endpoint``) keeps torch's rendezvous store in a file of its
    private run directory: another user can neither open the file nor find a rendezvous key on
    any port the launcher listens on. Before, the store was a TCPStore on loopback whose keys any
    local user could list and write. Also: a node-local directory left in /dev/shm by a launcher
    that died is removed at the next launch (before, they stayed)."""
    import psutil

    from conftest import finish, launch, wait_for

    run, go, out = tmp_path / "run", tmp_path / "go", tmp_path / "out"
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has now: a crashed launcher's
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    orphan = shm / f"trainguard-hb-{gone.pid}-dead"
    orphan.mkdir(mode=0o700)
    proc = launch(run, script=HERE / "gate_worker.py", tiny=False, script_args=(str(go), str(out)))
    try:
        launcher = psutil.Process(proc.pid)
        wait_for(lambda: len(launcher.children(recursive=True)) >= 2, what="the ranks")

        def ports():
            return sorted({c.laddr.port for c in launcher.net_connections("tcp") if c.status == psutil.CONN_LISTEN})

        wait_for(ports, what="the process-group store")
        survey = attack_as(mallory, "--survey", str(run), *map(str, ports()))
        seen, _ = survey.communicate(timeout=60)
        go.touch()
        assert finish(proc, timeout=120) == 0, Path(f"{run}.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "file: PermissionError" in seen, seen
    reached = [line for line in seen.splitlines() if line.startswith("keys ") and "'" in line]
    assert not reached, seen  # no port of the launcher serves a rendezvous key
    assert out.read_text() == "12.0"
    assert not (run / ".rendezvous-store").exists()
    assert not orphan.exists()  # a crashed launch's node-local directory is removed by the next


def launcher_ports(pid: int) -> list[int]:
    """The TCP ports the launcher process ``pid`` itself listens on (its ranks' own listeners, gloo's,
    are not counted: they are no store of the launch)."""
    import psutil

    conns = psutil.Process(pid).net_connections("tcp")
    return sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN})


def test_a_one_node_launchs_recovery_stores_are_files_no_other_user_can_open(tmp_path, mallory):
    """Issue 54 item 2: a one-node launch's in-process recovery store and each generation's
    process-group store are files in the launcher's private directory (``/dev/shm``, 0700), not
    TCPStores on loopback. A rank is killed and replaced in-process; before and after, the
    launcher listens on one TCP port only (the process-group store of the group's start, which
    the script's own ``init_process_group`` reaches over TCP: docs/recovery.md says why it stays),
    no recovery key is on it, and the other user can open neither the directory nor its files.
    Before, the launcher listened on two ports at start and three after the recovery (recovery
    store, the generation's store), each open to every local user. The directory is removed at
    the end."""
    import psutil

    from conftest import events, finish, launch, wait_for

    run = tmp_path / "run"
    proc = launch(
        run,
        "train.max_steps=100000",  # stopped by the test (SIGTERM) once it has looked
        "recovery.in_process=true",
        extra=("--inject", "rank_killed:rank=1,step=20,section=step"),
    )
    try:
        launcher = psutil.Process(proc.pid)
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        stores = wait_for(lambda: list(shm.glob(f"trainguard-stores-{proc.pid}-*")), what="the store directory")[0]
        assert stores.stat().st_mode & 0o777 == 0o700
        assert (stores / "recovery").exists()
        wait_for(lambda: events(run, "recovery_finished"), timeout=120, what="the in-process recovery")
        after = launcher_ports(proc.pid)
        assert len(after) == 1, after  # before: the recovery store and the generation's store besides
        assert (stores / "group-1-1").exists()  # the generation's group formed on its file
        targets = [str(stores), str(stores / "recovery"), str(stores / "group-1-1"), *map(str, after)]
        seen, _ = attack_as(mallory, "--reach", *targets).communicate(timeout=60)
        assert launcher.is_running() and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert finish(proc, timeout=120) == 75, Path(f"{run}.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    for path in targets[:3]:
        assert f"open {path}: PermissionError" in seen, seen
    assert f"keys {after[0]}: " in seen and "recovery []" in seen, seen  # no recovery key over TCP
    assert not events(run, "group_restart") and not events(run, "recovery_fallback")
    assert not stores.exists()


class _DeletingStore:
    """A store whose key another client deletes right after this one checks it (the worst timing
    of a co-tenant's ``delete_key``)."""

    def __init__(self, store):
        self.store, self.armed = store, False

    def check(self, keys):
        there = self.store.check(keys)
        for key in keys if self.armed else ():
            self.store.delete_key(key)
        return there

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_recovery_store_read_of_a_key_deleted_meanwhile_neither_waits_nor_raises():
    """Issue 54: a read was ``check`` then ``get``; a key deleted between the two made ``get``
    wait out the store's timeout and raise. Now one non-waiting round trip (``read_now``)."""
    from trainguard.rejoin.protocol import RecoveryStore

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=3))
    store = _DeletingStore(server)
    recovery = RecoveryStore(store, 1, SEAL)
    recovery.accept(4)
    store.armed = True
    t0 = time.monotonic()
    assert recovery.accepted(4)
    assert recovery.peek(5) is None
    assert time.monotonic() - t0 < 1.5


def test_a_run_dir_through_another_users_symbolic_link_is_refused(tmp_path, mallory):
    """Issue 54: a run directory given through a link another user made (in ``/tmp``) was
    followed; they could point it elsewhere between two looks. Now exit 2, naming the link."""
    target = tmp_path / "mine"
    link = Path("/tmp") / f"tg-link-{uuid.uuid4().hex[:8]}"
    made = as_user(mallory, "/bin/ln", "-s", str(target), str(link))
    made.communicate(timeout=30)
    assert link.is_symlink() and link.lstat().st_uid != 0
    try:
        r = subprocess.run(
            [sys.executable, "-m", "trainguard.cli", "run", "--run-dir", str(link), str(HERE / "gate_worker.py")],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        link.unlink()
    assert r.returncode == 2, r.stderr
    assert "symbolic link" in r.stderr and str(link) in r.stderr
    assert not target.exists()


def test_a_node_local_checkpoint_dir_under_another_users_directory_is_refused(tmp_path, mallory):
    """Issue 54: ``checkpoint.local.dir`` under a 0777 ``/dev/shm/...`` that another user made was
    accepted (they could swap the copies a resume loads). Now the ranks refuse it: exit 2."""
    from conftest import finish, launch

    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    theirs = shm / f"tg-{uuid.uuid4().hex[:8]}"
    as_user(mallory, "/bin/mkdir", "-m", "777", str(theirs)).communicate(timeout=30)
    assert theirs.is_dir() and theirs.stat().st_uid != 0
    try:
        run = tmp_path / "run"
        proc = launch(run, "train.max_steps=2", f"checkpoint.local.dir={theirs}/{{rank}}")
        assert finish(proc, timeout=120) == 2
    finally:
        subprocess.run(["rm", "-rf", str(theirs)])
    log = Path(f"{run}.log").read_text()
    assert "checkpoint.local.dir" in log and "not to this user" in log, log[-2000:]


def test_idle_connections_of_another_user_do_not_exhaust_the_launchers_descriptors(tmp_path, mallory):
    """Issue 54: 1,500 idle connections of another user to a launcher's store port made it die
    (``Too many open files``, at a soft limit of 1,024). The launcher now raises its soft limit to
    the hard one: started at 1,024 here, it takes the connections and the launch ends 0."""
    import resource

    from conftest import finish, launch, wait_for

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard open-files limit ({hard}) leaves no room above 1,500 connections")
    run, go, out = tmp_path / "run", tmp_path / "go", tmp_path / "out"
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # the launcher starts at 1,024, as in issue 54
    try:
        proc = launch(run, script=HERE / "gate_worker.py", tiny=False, script_args=(str(go), str(out)))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    flood = None
    try:
        port = wait_for(lambda: [p for ip, p in listeners(proc.pid, 1)], what="the process-group store")[0]
        flood = attack_as(mallory, "--flood", str(port), "1500")
        held = flood.stdout.readline().strip()
        assert held == "held 1500", held
        go.touch()
        assert finish(proc, timeout=120) == 0, Path(f"{run}.log").read_text()[-3000:]
    finally:
        if flood is not None:
            flood.stdin.close()
            flood.wait(timeout=30)
        if proc.poll() is None:
            proc.kill()
    assert out.read_text() == "12.0"


def test_a_rendezvous_backend_whose_state_is_not_sealed_is_refused_before_anything_is_made(tmp_path):
    """Only the c10d backend's state is sealed (:mod:`trainguard.launcher.sealed_rdzv`): another
    ``--rdzv-backend`` is bad input (exit 2), refused before the run directory is made."""
    run = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainguard.cli",
            "run",
            "--rdzv-backend",
            "etcd",
            "--run-dir",
            str(run),
            str(HERE / "gate_worker.py"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--rdzv-backend etcd" in r.stderr, r.stderr
    assert not run.exists()
