"""``trainguard run``: start one node's ranks under the elastic agent and return the launch's exit code.

What it adds to torchrun's behaviour:

* a lock on the run directory, so one run directory is used by one launch at a time, and a record
  of the launch's processes in it (``RUN_DIR/.launches``): a launch is refused while ranks of an
  earlier launch whose launcher died are still alive (see :mod:`trainguard.launcher.record`);
* ranks never outlive their launcher: each is started with a parent-death signal (SIGKILL when the
  launcher dies, however it dies; see :mod:`trainguard.launcher.deathsig`);
* the run directory, config file, overrides, injected faults, launch time, heartbeat directory and
  (under SLURM) end time are passed to the ranks in the environment, as
  :class:`~trainguard.launch_env.LaunchEnv` defines;
* ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: restarted gloo groups otherwise often fail in
  ``init_process_group`` with stale peer addresses in the shared TCPStore (pytorch issue 135712;
  measured in MEASURED.md: this fix held in every trial); on one node the ranks' process-group
  store is instead a new one per group start, served by the launcher on loopback
  (:mod:`.pg_store`: rank 0's own would listen on every interface);
* the agent of :mod:`trainguard.launcher.agent` (decision exit codes, signal forwarding, events);
* under SLURM (``SLURM_JOB_ID`` set): a ``slurm_info`` event (job, array task, nodes, restart count,
  time limit, end time); the job's EndTime minus ``[slurm] end_margin`` passed to the ranks
  (``LaunchEnv.end_time``) and kept current in an end-time file (their time limit, see
  :mod:`trainguard.slurm.endtime` and :mod:`trainguard.stop.conditions`); with ``[slurm]
  auto_requeue``, ``scontrol requeue`` of the job after a requeue-worthy exit 75 (first node only,
  see :mod:`trainguard.slurm.requeue`); a ready file in ``TRAINGUARD_READY_DIR``
  (:data:`trainguard.launch_env.READY_DIR`) once the stop
  signals are handled (the generated batch script forwards signals only after that);
* a finished run leaves ``RUN_DIR/FINISHED``: a later launch of the same command (the next task
  of a job array, say) exits 0 at once with an ``already_finished`` event, without starting ranks;
  with the kill-switch file present a launch exits 75 at once (``stop_requested`` with
  ``before_training``), so queued jobs burn through in seconds and are not requeued.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .. import console, faults
from ..config import Config, ConfigError, load_config, parse_key_values, split_cli_args
from ..events import EventLog, read_events
from ..exitcodes import ExitCode
from ..launch_env import READY_DIR, LaunchEnv
from ..rejoin.shrink import min_ranks_error
from ..rundir import check_private, prepare_run_dir
from ..slurm import finished
from ..slurm.endtime import EndTimeRefresher, end_time_file, remove_stale, write_end_time
from ..slurm.info import SLURMInfo
from ..supervisor.monitor import HangMonitor
from . import deathsig, jit, node_private
from .lock import RunDirLock, RunDirLocked
from .record import LaunchRecord, check_previous


@dataclass
class LaunchOptions:
    """The launcher's arguments (torchrun's names, plus ``run_dir``, ``config`` and ``overrides``)."""

    script: str
    script_args: list[str] = field(default_factory=list)
    run_dir: Path = Path("runs/default")
    config: Optional[str] = None
    overrides: list[str] = field(default_factory=list)
    nnodes: str = "1"
    nproc_per_node: int = 1
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = ""
    rdzv_id: str = ""
    rdzv_conf: str = ""
    max_restarts: Optional[int] = None
    monitor_interval: Optional[float] = None
    local_addr: Optional[str] = None
    inject: list = field(default_factory=list)  # FaultSpec objects from --inject


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` → (2, 2); ``"1:4"`` → (1, 4).

    Raises:
        ConfigError: not ``N`` or ``MIN:MAX`` with 1 ≤ MIN ≤ MAX.
    """
    try:
        parts = [int(p) for p in text.split(":")]
    except ValueError:
        raise ConfigError(f"--nnodes {text!r}: expected N or MIN:MAX") from None
    lo, hi = (parts[0], parts[0]) if len(parts) == 1 else (parts[0], parts[1]) if len(parts) == 2 else (0, 0)
    if not 1 <= lo <= hi:
        raise ConfigError(f"--nnodes {text!r}: expected N or MIN:MAX with 1 ≤ MIN ≤ MAX")
    return lo, hi


def _rdzv_configs(text: str) -> dict[str, str]:
    return parse_key_values(text, f"--rdzv-conf {text!r}")


def launch(opts: LaunchOptions) -> int:
    """Run the ranks of this node until the run finishes, stops or gives up.

    Returns:
        The exit code (see :mod:`trainguard.exitcodes`).
    Raises:
        ConfigError: bad arguments, config or run dir (the CLI exits with code 2).
        RunDirLocked: another launch holds the run directory, or processes of an earlier launch
            in it are still alive (:class:`~trainguard.launcher.record.PreviousLaunchAlive`).
        ElasticIncompatible: the installed torch lacks a torch elastic member the agent relies on.
    """
    # the script's own --config/--set count for the launcher's sections too
    script_cfg, script_sets, _ = split_cli_args(opts.script_args)
    config_path = opts.config or script_cfg
    overrides = opts.overrides + script_sets
    cfg = load_config(config_path, overrides, Config, ignore_unknown_sections=True)
    if not Path(opts.script).is_file():
        raise ConfigError(f"training script {opts.script} does not exist")
    if opts.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be ≥ 1, got {opts.nproc_per_node}")
    if opts.rdzv_backend != "c10d":  # the only backend whose state trainguard seals (launcher.sealed_rdzv)
        raise ConfigError(f"--rdzv-backend {opts.rdzv_backend}: trainguard seals the state of the c10d backend only")
    min_nodes, max_nodes = parse_nnodes(opts.nnodes)
    faults.validate(list(cfg.faults.inject) + list(opts.inject), max_nodes * opts.nproc_per_node)
    too_large = min_ranks_error(cfg.elastic.min_ranks, max_nodes * opts.nproc_per_node)
    if too_large:
        raise ConfigError(too_large)
    node_private.refuse_foreign_link(Path(opts.run_dir))
    run_dir = Path(opts.run_dir).resolve()
    node_private.raise_open_files_limit()  # a co-tenant's idle connections to the stores take descriptors
    os.umask(0o077)  # the launch's files and its ranks' are their owner's only (docs/recovery.md)
    prepare_run_dir(run_dir)

    job_id = None if max_nodes == 1 else (opts.rdzv_id or "trainguard")
    slurm = SLURMInfo.from_env()  # None outside SLURM
    with RunDirLock(run_dir / ".launch.lock", job_id), _checkpoint_dir_lock(cfg, run_dir, job_id):
        check_previous(run_dir)
        return _launch_locked(opts, cfg, run_dir, config_path, overrides, min_nodes, max_nodes, slurm)


def _checkpoint_dir_lock(cfg: Config, run_dir: Path, job_id: Optional[str]) -> contextlib.AbstractContextManager:
    """The lock of a ``[checkpoint] dir`` outside the run directory (the run directory's lock
    covers one inside it): two runs that share one would delete each other's checkpoints and
    temporary directories. The directory is created with mode 0700; one that exists must be
    private (:func:`~trainguard.rundir.check_private`).

    Raises:
        ConfigError: the directory cannot be created, or another user could write it.
    """
    root = Path(cfg.checkpoint.dir)
    root = root if root.is_absolute() else run_dir / root
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise ConfigError(f"checkpoint.dir {root} cannot be created: {e.strerror or e}") from None
    check_private(root, "checkpoint.dir")
    if root.resolve().is_relative_to(run_dir.resolve()):
        return contextlib.nullcontext()
    return RunDirLock(root / ".launch.lock", job_id, what="checkpoint dir")


def _already_finished(events: EventLog, run_dir: Path, signature: str, launch_time: float) -> bool:
    """If ``RUN_DIR/FINISHED`` was written by a launch of the same command, record that this launch
    has nothing to do (``launch``, ``already_finished``, ``launch_exit`` with code 0) and return True."""
    marker = finished.read(run_dir)
    if marker is None:
        return False
    if marker.get("signature") != signature:
        events.emit(
            "finished_marker_ignored",
            path=str(run_dir / finished.FILENAME),
            marker_signature=marker.get("signature"),
            signature=signature,
            why="the command differs from the one that finished (script, arguments, overrides or config)",
        )
        return False
    sha = marker.get("state_sha256")
    events.emit("launch", already_finished=True, host=socket.gethostname())
    events.emit(
        "already_finished", path=str(run_dir / finished.FILENAME), finished_at=marker.get("time"), state_sha256=sha
    )
    print(
        f"trainguard: {run_dir} already finished (see {finished.FILENAME}); nothing to do", file=sys.stderr, flush=True
    )
    events.emit(
        "launch_exit",
        code=int(ExitCode.OK),
        reason="already finished",
        signal=None,
        seconds=round(time.time() - launch_time, 3),
        state_sha256=sha,
    )
    return True


def _kill_switch_set(events: EventLog, kill_path: Path, launch_time: float) -> bool:
    """If the kill-switch file exists, record a stop before training (``launch``, ``stop_requested``
    with ``before_training``, ``launch_exit`` 75) and return True: queued launches burn through at
    once, without starting ranks (the Guard would stop them before training too, seconds later)."""
    if not kill_path.exists():
        return False
    events.emit("launch", kill_switch=True, host=socket.gethostname())
    events.emit("stop_requested", reason="kill_switch", before_training=True, path=str(kill_path), by="launcher")
    print(f"trainguard: kill switch {kill_path} exists; not starting", file=sys.stderr, flush=True)
    events.emit(
        "launch_exit",
        code=int(ExitCode.REQUEUE),
        reason="kill switch",
        signal=None,
        seconds=round(time.time() - launch_time, 3),
        state_sha256=None,
    )
    return True


def _launch_locked(
    opts: LaunchOptions,
    cfg: Config,
    run_dir: Path,
    config_path: Optional[str],
    overrides: list[str],
    min_nodes: int,
    max_nodes: int,
    slurm: Optional[SLURMInfo],
) -> int:
    events = EventLog(run_dir, rank=None)
    launch_time = time.time()
    if slurm is not None:
        events.emit("slurm_info", **slurm.to_event())
    signature = finished.signature(opts.script, opts.script_args, overrides, config_path)
    if _already_finished(events, run_dir, signature, launch_time):
        return int(ExitCode.OK)
    kill_path = run_dir / cfg.stop.kill_switch
    if _kill_switch_set(events, kill_path, launch_time):
        code, stop_signal = int(ExitCode.REQUEUE), None
    else:
        code, stop_signal, sha = _run_agent(
            opts, cfg, run_dir, config_path, overrides, min_nodes, max_nodes, slurm, events, launch_time
        )
        if sha is not None:
            try:
                finished.write(run_dir, signature, sha, slurm_job_id=slurm.requeue_id if slurm else None)
            except OSError as e:  # a full disk: the run is done all the same; a requeue resumes and ends at once
                console.warn(f"{run_dir / finished.FILENAME} could not be written: {e.strerror or e}")
    if slurm is not None and cfg.slurm.auto_requeue and slurm.node_id == 0 and code == ExitCode.REQUEUE:
        from ..slurm.requeue import after_launch

        outcome = after_launch(run_dir, slurm, events, code, launch_time, stop_signal, kill_path)
        if outcome is not None:
            state = (
                "requeued" if outcome.get("ok") else f"not requeued ({outcome.get('skipped') or outcome.get('output')})"
            )
            print(f"trainguard: SLURM job {slurm.requeue_id} {state}", file=sys.stderr, flush=True)
    return code


def _run_agent(
    opts: LaunchOptions,
    cfg: Config,
    run_dir: Path,
    config_path: Optional[str],
    overrides: list[str],
    min_nodes: int,
    max_nodes: int,
    slurm: Optional[SLURMInfo],
    events: EventLog,
    launch_time: float,
) -> tuple[int, Optional[str], Optional[str]]:
    """Start the ranks under the elastic agent and wait for the launch's end.

    Returns:
        (exit code, the stop signal the launcher received or ``None``, the final state hash when
        the run finished in this launch, else ``None``).
    """
    # imported here: torch.distributed.elastic is slow to import and not needed for errors above
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from ..rejoin.auth import KeyFileError, Seal, launch_key, new_nonce
    from . import nodes
    from .agent import DECISION_CODES, TrainguardAgent
    from .pg_store import LoopbackStores
    from .sealed_rdzv import sealed_handler, security_events

    console.quiet_torch_elastic(DECISION_CODES)

    end_time, end_file, refresher = _end_time_setup(cfg, run_dir, slurm, events)
    ready_dir = os.environ.pop(READY_DIR, "")
    hb_root = node_private.node_local_dir("trainguard-hb-")
    monitor = HangMonitor(cfg, run_dir, hb_root, events) if cfg.supervisor.enabled else None
    replacer = None
    try:
        key = launch_key(run_dir)  # seals the rendezvous state, and the recovery store's values
    except KeyFileError as e:
        raise ConfigError(str(e)) from None
    if cfg.recovery.in_process and max_nodes * opts.nproc_per_node > 1:  # one rank: no survivor to send the state
        from ..rejoin.protocol import listen_address
        from .replace import Replacer

        host = "127.0.0.1" if max_nodes == 1 else (opts.local_addr or socket.getfqdn())  # as torch's rendezvous
        replacer = Replacer(
            cfg.recovery,
            events,
            opts.script,
            node_private.node_local_dir("trainguard-rejoin-"),
            Seal(key, new_nonce()),  # a nonce per launch: no value of an earlier launch opens
            host=host,
            bind=host if max_nodes == 1 else listen_address(host),
            spares=cfg.launcher.spares,
            min_ranks=cfg.elastic.min_ranks,  # the agent shrinks only a group on one node (it renumbers ranks)
            regrow=cfg.elastic.regrow,
            # one node: the recovery store and the generations' stores are files no other user can open
            store_dir=node_private.node_local_dir("trainguard-stores-") if max_nodes == 1 else None,
        )
    to_ranks = LaunchEnv(
        run_dir=run_dir,
        config=Path(config_path).resolve() if config_path else None,
        overrides=tuple(overrides),
        inject=tuple(s.model_dump() for s in opts.inject),
        launch_time=launch_time,
        heartbeat_dir=hb_root if monitor else None,
        end_time=end_time,
        end_time_file=end_file,
        recovery_store=replacer.address if replacer else None,
        recovery_dir=replacer.boundary_dir if replacer else None,
        recovery_key=replacer.seal.key if replacer else None,
        recovery_nonce=replacer.seal.nonce if replacer else b"",
    )
    os.environ.update(to_ranks.to_environ())
    omp_threads = _omp_threads(opts.nproc_per_node)
    os.environ.update(
        {
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            # torch elastic keeps SIGHUP/SIGQUIT; SIGTERM/SIGUSR1/SIGINT are forwarded by our agent
            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGHUP,SIGQUIT",
        }
    )
    standalone = max_nodes == 1 and not opts.rdzv_endpoint
    # one node: torch's rendezvous store is a FileStore in the private run directory (no port
    # another user of the node could connect to); several: the c10d TCPStore at --rdzv-endpoint
    rdzv_file = node_private.private_rendezvous_file(run_dir) if standalone else None
    endpoint = str(rdzv_file) if rdzv_file is not None else opts.rdzv_endpoint
    # one node at a loopback --rdzv-endpoint: its TCPStore listens there only (held for the launch's life)
    rdzv_server = node_private.loopback_server(opts.rdzv_endpoint) if max_nodes == 1 and opts.rdzv_endpoint else None
    if not endpoint:
        raise ConfigError("--rdzv-endpoint HOST:PORT is required when --nnodes > 1")
    max_restarts = cfg.launcher.max_restarts if opts.max_restarts is None else opts.max_restarts
    # spare nodes: the group trains on MIN nodes; torch's rendezvous takes no more (a node beyond
    # waits in its redundancy list, or, arriving late, as a spare node of trainguard's: see .nodes)
    spare_nodes = (
        replacer is not None and cfg.recovery.spare_nodes and max_nodes > min_nodes and cfg.elastic.min_ranks == 0
    )
    run_id = opts.rdzv_id or (uuid.uuid4().hex if standalone else "trainguard")
    rdzv_params = RendezvousParameters(
        backend=opts.rdzv_backend,
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=min_nodes if spare_nodes else max_nodes,
        local_addr="127.0.0.1" if standalone else opts.local_addr,  # one node: the workers meet on loopback
        **{**_rdzv_configs(opts.rdzv_conf), **({"store_type": "file"} if standalone else {})},
    )
    command = _rank_command(opts)
    try:  # the state sealed JSON, never torch's pickle: one launcher alone binds it to its nonce too
        handler = sealed_handler(rdzv_params, Seal(key, new_nonce() if standalone else b""), security_events(events))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    spec = WorkerSpec(
        role="trainer",
        local_world_size=opts.nproc_per_node,
        entrypoint=command[0],
        args=tuple(command[1:]),
        rdzv_handler=LoopbackStores(handler) if max_nodes == 1 else handler,  # one node: the group's store on loopback
        max_restarts=max_restarts,
        monitor_interval=opts.monitor_interval or cfg.launcher.monitor_interval,
        local_addr=opts.local_addr,
    )
    record = LaunchRecord(run_dir, hb_root)
    agent = TrainguardAgent(
        spec=spec,
        # stderr also to a file per rank: a script error before the first step is shown, not restarted
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs"), tee=Std.ERR),
        start_method="spawn",
        events=events,
        stop_grace=cfg.launcher.stop_grace,
        kill_grace=cfg.supervisor.kill_grace,
        monitor=monitor,
        record=record,
        replacer=replacer,
        spare_nodes=spare_nodes,
        jit=jit.collector(cfg.checkpoint.jit.enabled, cfg.checkpoint.jit.timeout, monitor, hb_root, events),
    )
    agent.install_signal_handlers()
    if ready_dir:  # the batch script forwards stop signals to this node only once this file exists
        _touch(Path(ready_dir) / f"node{slurm.node_id if slurm else 0}")
    events.emit(
        "launch",
        omp_num_threads=omp_threads,
        script=opts.script,
        args=opts.script_args,
        nnodes=opts.nnodes,
        nproc_per_node=opts.nproc_per_node,
        max_restarts=max_restarts,
        host=socket.gethostname(),
        slurm_job_id=slurm.requeue_id if slurm else None,
        slurm_restart_count=slurm.restart_count if slurm else None,
        end_time=end_time,
    )
    if refresher is not None:
        refresher.start()
    if replacer is not None and not standalone:  # the rendezvous store's host leads (Replacer.share)
        replacer.serves_rendezvous = nodes.serves_endpoint(endpoint)
    spare = spare_nodes and nodes.arrival(endpoint, run_id, cfg.recovery.timeout) > min_nodes
    try:
        code = _serve_as_spare(opts, run_dir, replacer, events, agent) if spare else None
        if code is None:
            spare = False
            agent.run()
        else:
            agent.exit_code, agent.exit_reason = code, "spare node"
    finally:
        agent.stop_beating()
        if refresher is not None:
            refresher.stop()
        if not spare:  # a spare node never joined the rendezvous: its shutdown would close it for all
            spec.rdzv_handler.shutdown()
        if rdzv_file is not None:
            rdzv_file.unlink(missing_ok=True)
        if rdzv_server is not None:  # the loopback server outlives the handler's shutdown
            del rdzv_server
        if monitor is not None:
            monitor.group_stopped()
        shutil.rmtree(hb_root, ignore_errors=True)
        if replacer is not None:
            replacer.close()
        survivors = record.close()
        if survivors:
            print(
                f"trainguard: warning: ranks {survivors} did not exit; {run_dir} cannot be launched again until they do",
                file=sys.stderr,
                flush=True,
            )
    if agent.exit_code == ExitCode.GIVE_UP:
        print(f"trainguard: giving up: {agent.exit_reason}", file=sys.stderr, flush=True)
    elif agent.script_error is not None:
        shown = "\n".join("    " + line for line in agent.script_error.lines)
        print(f"trainguard: {agent.exit_reason} (exit {agent.exit_code}):\n{shown}", file=sys.stderr, flush=True)
    else:
        console.say(f"exit {agent.exit_code}: {EXIT_MEANINGS.get(agent.exit_code, agent.exit_reason)}")
    end = next((e for e in reversed(list(read_events(run_dir, "end"))) if e["time"] >= launch_time), None)
    sha = end["details"].get("state_sha256") if end and agent.exit_code == ExitCode.OK else None
    events.emit(
        "launch_exit",
        code=agent.exit_code,
        reason=agent.exit_reason,
        signal=agent.stop_signal,
        seconds=round(time.time() - launch_time, 3),
        state_sha256=sha,
    )
    return agent.exit_code, agent.stop_signal, sha


EXIT_MEANINGS = {
    int(ExitCode.OK): "finished",
    int(ExitCode.REQUEUE): "stopped and saved; relaunch the same command to resume (requeue)",
    int(ExitCode.BAD_INPUT): "bad input (see the error above); nothing was changed",
}


def _serve_as_spare(opts: LaunchOptions, run_dir: Path, replacer, events: EventLog, agent) -> Optional[int]:
    """This launcher arrived beyond ``--nnodes MIN``: wait as a spare node (:mod:`.spare_node`);
    the launch's exit code, or ``None`` when it should join the group's next rendezvous."""
    from . import spare_node

    command = _rank_command(opts)
    return spare_node.serve(
        run_dir, replacer.seal, events, opts.nproc_per_node, command, opts.script, lambda: agent.stop_signal
    )


def _omp_threads(nproc_per_node: int) -> Optional[str]:
    """Set ``OMP_NUM_THREADS=1`` for the ranks when it is unset and several ranks share the node, as
    torchrun does (say so on the console); returns the value the ranks get (``None``: unset). One
    intra-op thread per rank keeps ranks from oversubscribing the cores (measured on 2 cores, 2 ranks:
    a 92 ms step took 230–580 ms without it), and a resume under another thread count cannot be
    bitwise identical (CPU reductions are split by thread)."""
    if "OMP_NUM_THREADS" not in os.environ and nproc_per_node > 1:
        os.environ["OMP_NUM_THREADS"] = "1"
        console.say(
            f"OMP_NUM_THREADS=1 for the {nproc_per_node} ranks of this node (unset; as torchrun): "
            "set it to give each rank more threads"
        )
    return os.environ.get("OMP_NUM_THREADS")


def _rank_command(opts: LaunchOptions) -> list[str]:
    """The command line of each rank: ``python -u SCRIPT ARGS``, started (on Linux) through
    :mod:`.deathsig` so that the rank is SIGKILLed when this launcher dies."""
    command = [sys.executable, "-u", opts.script, *opts.script_args]
    if not deathsig.supported():
        print(
            f"trainguard: warning: on {sys.platform} the ranks are not killed if the launcher dies",
            file=sys.stderr,
            flush=True,
        )
        return command
    return deathsig.wrap(os.getpid(), command)


def _end_time_setup(
    cfg: Config, run_dir: Path, slurm: Optional[SLURMInfo], events: EventLog
) -> tuple[Optional[float], Optional[Path], Optional[EndTimeRefresher]]:
    """The ranks' end time under SLURM (EndTime - ``end_margin``, Unix s), the end-time file they
    re-read, and (first node, ``end_time_refresh`` > 0) the thread that keeps that file current;
    ``(None, None, None)`` outside SLURM or with ``use_end_time = false``."""
    if slurm is None or not cfg.slurm.use_end_time:
        return None, None, None
    end_time = slurm.end_time - cfg.slurm.end_margin if slurm.end_time else None
    path = end_time_file(run_dir, slurm)
    refresher = None
    if slurm.node_id == 0:
        remove_stale(run_dir, keep=path)
        write_end_time(path, end_time)
        if cfg.slurm.end_time_refresh > 0:
            refresher = EndTimeRefresher(slurm, path, cfg.slurm.end_margin, cfg.slurm.end_time_refresh, events)
    return end_time, path, refresher


def _touch(path: Path) -> None:
    """Create ``path`` (and its directory); a failure is printed, not raised (it only delays signals)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError as e:
        print(f"trainguard: warning: cannot write the ready file {path}: {e}", file=sys.stderr, flush=True)


__all__ = ["LaunchOptions", "RunDirLocked", "launch", "parse_nnodes"]
