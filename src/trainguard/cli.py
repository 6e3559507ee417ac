"""The ``trainguard`` command: ``run`` (the launcher), ``demo``, ``checkpoints``, ``report``, ``watch``,
``slurm script|submit``.

Every command exits with the codes of :mod:`trainguard.exitcodes`; bad input prints one line
starting with ``trainguard: error:`` and exits with 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from .exitcodes import ExitCode

# Only typer and the exit codes load at import: ``trainguard --help``, ``report``, ``watch`` and
# ``slurm script`` never import torch (nor pydantic, for --help). Each command imports what it needs.

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Keeps long PyTorch training runs alive. Exit codes: 0 finished, 2 bad input, 75 requeue, 76 gave up.",
)

_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False}


def _fail(message: str) -> None:
    typer.echo(f"trainguard: error: {message}", err=True)
    raise typer.Exit(int(ExitCode.BAD_INPUT))


@app.command(context_settings=_PASSTHROUGH)
def run(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="training script; the arguments after it are passed to it"),
    run_dir: Path = typer.Option(..., "--run-dir", help="run directory (checkpoints, events, config)"),
    config: Optional[str] = typer.Option(None, "--config", help="TOML config file (also passed to the ranks)"),
    overrides: list[str] = typer.Option([], "--set", help="section.key=value override (repeatable)"),
    nnodes: str = typer.Option("1", "--nnodes", help="number of nodes, N or MIN:MAX"),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", "--nproc_per_node", help="ranks on this node"),
    rdzv_backend: str = typer.Option("c10d", "--rdzv-backend", help="rendezvous backend"),
    rdzv_endpoint: str = typer.Option(
        "", "--rdzv-endpoint", help="HOST:PORT of the rendezvous (required for several nodes)"
    ),
    rdzv_id: str = typer.Option("", "--rdzv-id", help="rendezvous id shared by all nodes of the job"),
    rdzv_conf: str = typer.Option("", "--rdzv-conf", help="extra rendezvous settings key=value,..."),
    max_restarts: Optional[int] = typer.Option(
        None, "--max-restarts", help="worker-group restarts before giving up (default [launcher] max_restarts = 3)"
    ),
    monitor_interval: Optional[float] = typer.Option(None, "--monitor-interval", help="seconds between worker checks"),
    local_addr: Optional[str] = typer.Option(None, "--local-addr", help="address of this node"),
    inject: list[str] = typer.Option(
        [],
        "--inject",
        help="inject a fault: KIND:key=value,..., e.g. rank_hung:rank=1,step=30 (kinds and keys: docs/launcher.md, Fault injection)",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="console: warnings and errors only"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="console: also torch elastic's own log lines"),
) -> None:
    """Launch SCRIPT on this node's ranks; restart them when one dies; forward stop signals."""
    from .config import ConfigError
    from .console import LEVEL_ENV

    if quiet and verbose:
        _fail("--quiet and --verbose exclude each other")
    if quiet or verbose:  # the ranks inherit it
        os.environ[LEVEL_ENV] = "quiet" if quiet else "verbose"
    from .faults import parse_inject
    from .launcher import LaunchOptions, RunDirLocked, launch

    try:
        specs = [parse_inject(text) for text in inject]
    except ConfigError as e:
        _fail(str(e))
    opts = LaunchOptions(
        script=script,
        script_args=list(ctx.args),
        run_dir=run_dir,
        config=config,
        overrides=list(overrides),
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        rdzv_conf=rdzv_conf,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        local_addr=local_addr,
        inject=specs,
    )
    try:
        code = launch(opts)
    except (ConfigError, RunDirLocked) as e:
        _fail(str(e))
    import gc

    gc.freeze()  # the launcher's exit skips a slow final collection over torch objects
    raise typer.Exit(code)


@app.command()
def demo(
    run_dir: Path = typer.Option(
        Path("runs/demo"), "--run-dir", help="parent directory of the demo's two runs (emptied first)"
    ),
    overrides: list[str] = typer.Option([], "--set", help="override for both runs, e.g. train.max_steps=120"),
) -> None:
    """Train the example GPT twice, once cleanly and once with faults injected, and compare."""
    from .config import ConfigError
    from .demo import run_demo

    try:
        code = run_demo(run_dir, list(overrides))
    except ConfigError as e:
        _fail(str(e))
    raise typer.Exit(code)


@app.command()
def checkpoints(
    run_dir: Path = typer.Argument(..., help="run directory"),
    verify: str = typer.Option("full", "--verify", help="'full' (checksums) or 'size'"),
) -> None:
    """List a run's committed checkpoints and whether each verifies."""
    from rich.console import Console
    from rich.table import Table

    from .checkpoint import CheckpointStore
    from .checkpoint import manifest as mf
    from .config import ConfigError, load_config

    if not run_dir.is_dir():
        _fail(f"run dir {run_dir} does not exist")
    cfg_file = run_dir / "config.toml"
    try:
        cfg = load_config(cfg_file if cfg_file.exists() else None, ignore_unknown_sections=True)
    except ConfigError as e:
        _fail(str(e))
    root = Path(cfg.checkpoint.dir)
    store = CheckpointStore(root if root.is_absolute() else run_dir / root)
    table = Table("step", "path", "bytes", "status")
    for c in store.committed():
        reason = mf.verify(c.path, verify)
        size = sum(p.stat().st_size for p in c.path.iterdir() if p.is_file())
        table.add_row(str(c.step), str(c.path), f"{size:,}", "ok" if reason is None else f"[red]{reason}[/red]")
    Console(width=10_000).print(table)  # the table is as wide as its cells: never cut a path to the terminal


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="run directory"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
    png: Optional[Path] = typer.Option(
        None, "--png", help="where to write the timeline picture (default RUN_DIR/report.png)"
    ),
) -> None:
    """Goodput, incidents, checkpoint costs and the best checkpoint interval of a run, from its events."""
    from .report import main as report_main

    raise typer.Exit(report_main(run_dir, as_json=as_json, png=png))


@app.command()
def watch(
    run_dir: Path = typer.Argument(..., help="run directory"),
    overrides: list[str] = typer.Option([], "--set", help="threshold key=value, e.g. min_days=3 (repeatable)"),
    notify: list[str] = typer.Option(
        [],
        "--notify",
        help="apprise URL to notify (repeatable): mailto://..., slack://..., json://...; "
        "visible to every user in ps: prefer --notify-file or TRAINGUARD_NOTIFY for URLs with secrets",
    ),
    notify_file: Optional[Path] = typer.Option(
        None, "--notify-file", help="file (mode 0600) with apprise URLs, one per line; also: TRAINGUARD_NOTIFY"
    ),
    every: Optional[str] = typer.Option(None, "--every", help="repeat every interval (60, '5m'); default: one pass"),
) -> None:
    """Check disk space and inodes, the SLURM job, a silent (hung) run and node memory; notify once per condition."""
    from .watch import main as watch_main

    raise typer.Exit(
        watch_main(run_dir, list(overrides), list(notify), every, once=every is None, notify_file=notify_file)
    )


slurm_app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="SLURM: write or submit an sbatch script that stops, saves and requeues the run in time.",
)
app.add_typer(slurm_app, name="slurm")


def _slurm(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="training script; the arguments after it are passed to it"),
    run_dir: Path = typer.Option(..., "--run-dir", help="run directory (checkpoints, events, the job's output)"),
    config: Optional[str] = typer.Option(
        None, "--config", help="TOML config file (its slurm section gives the defaults below)"
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="section.key=value override for the config and the run (repeatable)"
    ),
    nodes: int = typer.Option(1, "--nodes", help="nodes; one 'trainguard run' per node"),
    min_nodes: Optional[int] = typer.Option(
        None,
        "--min-nodes",
        help="sbatch --nodes=MIN-MAX: the job may start on as few as MIN nodes (after a node was excluded, say); "
        "the run resumes on the world size it gets (docs/elastic.md)",
    ),
    spare_nodes: int = typer.Option(
        0,
        "--spare-nodes",
        help="allocate this many nodes beyond --nodes; their launchers wait as spare nodes and one takes a "
        "lost node's place in-process (docs/recovery.md)",
    ),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", "--nproc_per_node", help="ranks per node"),
    time_limit: Optional[str] = typer.Option(
        None, "--time", help="sbatch --time: minutes, HH:MM:SS, D-HH:MM:SS (default slurm.time)"
    ),
    partition: Optional[str] = typer.Option(
        None, "--partition", help="sbatch --partition (default slurm.partition, else the cluster's default)"
    ),
    signal_lead: Optional[int] = typer.Option(
        None,
        "--signal-lead",
        help="seconds before the time limit for SIGUSR1, 0 for none (default slurm.signal_lead, else from the run's measured step and save times)",
    ),
    array: Optional[int] = typer.Option(
        None,
        "--array",
        help="K: a job array --array=1-K%1 (K launches, one at a time; the ones after the run finished exit at once)",
    ),
    after: Optional[str] = typer.Option(None, "--after", help="start after job ID ends (--dependency=afterany:ID)"),
    gres: Optional[str] = typer.Option(None, "--gres", help="sbatch --gres, e.g. gpu:8 (default slurm.gres)"),
    cpus_per_task: Optional[int] = typer.Option(
        None, "--cpus-per-task", help="CPUs for each node's launcher and its ranks (default slurm.cpus_per_task)"
    ),
    job_name: Optional[str] = typer.Option(
        None, "--job-name", help="sbatch --job-name (default: the run directory's name)"
    ),
    auto_requeue: bool = typer.Option(
        True,
        "--auto-requeue/--no-auto-requeue",
        help="the launcher requeues the job after a signal or time-limit stop (sets slurm.auto_requeue for the run)",
    ),
    output: Optional[Path] = typer.Option(
        None,
        "--output",
        "-o",
        help="script: write the script here instead of stdout; submit: where to write it (default RUN_DIR/slurm-job.sh)",
    ),
    chain: int = typer.Option(
        1, "--chain", help="submit only: submit N jobs, each starting after the previous one ends (afterany)"
    ),
    test_only: bool = typer.Option(
        False, "--test-only", help="submit only: run 'sbatch --test-only' (nothing is queued)"
    ),
) -> None:
    """Write the sbatch script for SCRIPT (script) or write it into the run dir and sbatch it (submit)."""
    from .atomic import write_atomic
    from .config import Config, ConfigError, load_config, split_cli_args
    from .slurm import script as sbatch

    submitting = ctx.info_name == "submit"
    if not submitting and (chain != 1 or test_only):
        _fail("--chain and --test-only are options of 'trainguard slurm submit'")
    if chain < 1:
        _fail(f"--chain must be ≥ 1, got {chain}")
    script_args = list(ctx.args)
    try:
        script_cfg, script_sets, _ = split_cli_args(script_args)
        cfg = load_config(
            config or script_cfg, list(overrides) + script_sets, Config, ignore_unknown_sections=True
        ).slurm
    except ConfigError as e:
        _fail(str(e))
    if signal_lead is not None:
        lead, basis = (
            signal_lead,
            (f"{signal_lead} s, given" if signal_lead else "none (--signal-lead 0: EndTime and SIGTERM only)"),
        )
    elif cfg.signal_lead is not None:
        lead, basis = int(cfg.signal_lead), f"{int(cfg.signal_lead)} s from [slurm] signal_lead"
    else:
        lead, basis = sbatch.signal_lead(run_dir)
    sets = list(overrides) + [f"slurm.auto_requeue={str(auto_requeue).lower()}"]
    opts = sbatch.ScriptOptions(
        script=script,
        run_dir=run_dir,
        script_args=script_args,
        config=config,
        launcher_sets=sets,
        nodes=nodes,
        min_nodes=min_nodes,
        spare_nodes=spare_nodes,
        nproc_per_node=nproc_per_node,
        time=time_limit or cfg.time,
        partition=partition or cfg.partition,
        signal_lead=lead,
        lead_basis=basis,
        job_name=job_name or cfg.job_name,
        array=array,
        after=after,
        gres=gres or cfg.gres,
        cpus_per_task=cpus_per_task or cfg.cpus_per_task,
        rdzv_port=cfg.rdzv_port,
        sbatch_args=list(cfg.sbatch_args),
    )
    try:
        notes = sbatch.validate(opts)
        text = sbatch.render(opts) + "\n"
        for note in notes:
            typer.echo(f"trainguard: note: {note}", err=True)
        if not submitting and output is None:
            typer.echo(text, nl=False)
            return
        path = output or Path(run_dir) / "slurm-job.sh"
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(path, text)  # mode 0600, as every file trainguard writes (it may be in the run dir)
        if not submitting:
            typer.echo(f"trainguard: wrote {path}", err=True)
            return
        if test_only:
            typer.echo(sbatch.submit(path, test_only=True))
            return
        job = ""
        for i in range(chain):
            job = sbatch.submit(path, (f"--dependency=afterany:{job}",) if i else ())
            typer.echo(job)
    except ConfigError as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"cannot write the batch script: {e}")


slurm_app.command(
    "script",
    context_settings=_PASSTHROUGH,
    help="Print the sbatch script for SCRIPT (or write it with --output); nothing is submitted.",
)(_slurm)
slurm_app.command(
    "submit",
    context_settings=_PASSTHROUGH,
    help="Write the sbatch script into the run dir and submit it with sbatch; prints the job id(s).",
)(_slurm)


def main() -> None:
    """Entry point of the ``trainguard`` console script."""
    app()


if __name__ == "__main__":
    sys.exit(main())
