"""The run configuration: one TOML file, one section per component, validated with pydantic.

``load_config(path, overrides)`` reads the file, applies ``--set section.key=value`` overrides and
validates the result. Any problem raises :class:`ConfigError` whose message names the file, the key
and what was expected (with the nearest valid key for a typo); the CLI turns it into exit code 2.

A user script adds its own sections by subclassing :class:`Config`::

    class TrainSection(trainguard.Section):
        max_steps: int = Field(1000, ge=1)

    class MyConfig(trainguard.Config):
        train: TrainSection = TrainSection()
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import tomli_w


class ConfigError(ValueError):
    """Bad configuration input: malformed TOML, unknown key, wrong type or out-of-range value."""


_DURATION = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)d)?\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*$")


def parse_duration(value: Any) -> Optional[float]:
    """Parse seconds from a number, ``"HH:MM:SS"``, or ``"1d2h30m10s"``-style text.

    Returns:
        The duration in seconds, or ``None`` for ``None``/``""``.
    Raises:
        ValueError: the text is not a duration or is negative.
    """
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise ValueError("expected a duration, got a boolean")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and ":" in value:
        parts = [float(p) for p in value.split(":")]
        seconds = 0.0
        for p in parts:
            seconds = seconds * 60 + p
    elif isinstance(value, str) and (m := _DURATION.match(value)) and any(m.groups()):
        d, h, mi, s = (float(g) if g else 0.0 for g in m.groups())
        seconds = d * 86400 + h * 3600 + mi * 60 + s
    else:
        raise ValueError(f"expected a duration such as 3600, '1h30m' or '01:30:00', got {value!r}")
    if seconds < 0:
        raise ValueError(f"expected a non-negative duration, got {value!r}")
    return seconds


class Section(BaseModel):
    """Base class of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSection(Section):
    """``[run]``: where the run lives. The launcher's ``--run-dir`` overrides ``dir``."""

    dir: Path = Field(Path("runs/default"), description="run directory (checkpoints, events, config)")
    seed: int = Field(0, ge=0, description="base random seed; trainguard.seed_everything() uses it")


class CheckpointSection(Section):
    """``[checkpoint]``: the persistent checkpoint store."""

    interval: int = Field(100, ge=1, description="save every N optimizer steps")
    keep_last: int = Field(3, ge=1, description="committed checkpoints kept (the newest is never deleted)")
    dir: str = Field("checkpoints", description="store directory, relative to the run dir unless absolute")
    verify: str = Field("full", pattern="^(full|size)$", description="'full' checks every checksum on resume, 'size' only sizes")
    save_final: bool = Field(True, description="save a checkpoint when the last step finishes")


class PreemptionSection(Section):
    """``[preemption]``: signals that ask the run to save and exit (requeue)."""

    signals: list[str] = Field(["SIGTERM", "SIGUSR1", "SIGINT"], description="signals that request a stop")
    save_deadline: float = Field(300.0, gt=0, description="seconds from the signal until the process exits even if the emergency save is unfinished")

    @field_validator("signals")
    @classmethod
    def _known_signals(cls, v: list[str]) -> list[str]:
        import signal

        for name in v:
            if not name.startswith("SIG") or not hasattr(signal, name):
                raise ValueError(f"unknown signal name {name!r} (expected e.g. 'SIGTERM')")
        return v


class StopSection(Section):
    """``[stop]``: stop and save conditions checked at every step boundary."""

    max_duration: Optional[float] = Field(None, description="wall-clock budget of one launch (seconds, '4h', or 'HH:MM:SS'); the run stops early enough for one more step and one save")
    time_margin: float = Field(5.0, ge=0, description="extra seconds kept in reserve before max_duration")
    kill_switch: str = Field("KILL", description="file (relative to the run dir) whose presence means: save and exit")
    save_switch: str = Field("SAVE", description="file whose presence means: save, delete the file, continue")
    check_interval: int = Field(0, ge=0, description="check stop conditions every N steps; 0 = auto: about every check_seconds, from the measured step time")
    check_seconds: float = Field(1.0, gt=0, description="with check_interval = 0: target seconds between two checks (the stop latency); the check is one small all-reduce")

    @field_validator("max_duration", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Optional[float]:
        return parse_duration(v)


class LauncherSection(Section):
    """``[launcher]``: the ``trainguard run`` agent."""

    max_restarts: int = Field(3, ge=0, description="worker-group restarts after a rank dies before giving up")
    monitor_interval: float = Field(0.1, gt=0, description="seconds between checks of the workers and their heartbeats")
    stop_grace: float = Field(60.0, gt=0, description="seconds the launcher waits for ranks to save and exit after forwarding a stop signal, before SIGKILL")


class SupervisorSection(Section):
    """``[supervisor]``: hang detection in ``trainguard run`` from the ranks' heartbeats and sections.

    The ``*_timeout`` values are the conservative starting timeouts (seconds; the setup/step/
    checkpointing/out-of-section defaults are Megatron's ft_launcher recipe values); once a section
    has ``min_samples`` observed durations its timeout is learned (see
    :mod:`trainguard.supervisor.timeouts`) and saved to ``RUN_DIR/timeouts.json`` for the next launch.
    """

    enabled: bool = Field(True, description="detect hung ranks and restart the group")
    initial_timeout: float = Field(600.0, gt=0, description="seconds from a rank's start to its first heartbeat (Guard created)")
    setup_timeout: float = Field(600.0, gt=0, description="from the first heartbeat until the first step completes (resume, warm-up)")
    step_timeout: float = Field(180.0, gt=0, description="one training step")
    checkpointing_timeout: float = Field(600.0, gt=0, description="one checkpoint save")
    out_of_section_timeout: float = Field(300.0, gt=0, description="time between sections (code after step_end)")
    teardown_timeout: float = Field(600.0, gt=0, description="after the last step or a stop: evaluation, process-group teardown, exit (never learned)")
    section_timeouts: dict[str, float] = Field({}, description="starting timeouts of user-named sections")
    user_section_timeout: float = Field(600.0, gt=0, description="starting timeout of user sections not in section_timeouts")
    learn: bool = Field(True, description="learn timeouts from observed durations")
    percentile: float = Field(99.0, gt=0, le=100, description="percentile of observed durations the learned timeout starts from")
    safety_factor: float = Field(3.0, ge=1, description="learned timeout = max(min_timeout, safety_factor × percentile, longest observed)")
    min_timeout: float = Field(2.0, gt=0, description="floor of every learned timeout (seconds)")
    min_samples: int = Field(20, ge=1, description="observations of a section before its timeout is learned")
    kill_grace: float = Field(3.0, gt=0, description="seconds between SIGTERM and SIGKILL when the launcher stops a group to restart it")
    stacks_wait: float = Field(1.0, ge=0, description="seconds to wait for a hung rank's stack dump")
    max_no_progress_restarts: int = Field(3, ge=1, description="give up after this many consecutive restarts with no new checkpoint")
    max_same_step_faults: int = Field(2, ge=2, description="give up when the group fails at the same step this many times in a row")

    @field_validator("section_timeouts")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        for name, seconds in v.items():
            if seconds <= 0:
                raise ValueError(f"timeout of section {name!r} must be > 0, got {seconds}")
        return v


class FaultSpec(Section):
    """One injected fault (``[[faults.inject]]`` or ``trainguard run --inject KIND:key=value,...``)."""

    kind: str = Field(..., pattern="^(rank_killed|rank_hung|random)$", description="rank_killed, rank_hung, or random (a seeded choice of both)")
    rank: Optional[int] = Field(None, ge=0, description="global rank (random: drawn)")
    step: Optional[int] = Field(None, ge=1, description="fire when this many steps are complete")
    after_seconds: Optional[float] = Field(None, gt=0, description="fire this long after the Guard starts instead of at a step")
    hang: str = Field("sigstop", pattern="^(sigstop|collective)$", description="rank_hung: stop the process (SIGSTOP), or block it before the next collective so the others wait inside it")
    section: str = Field("step", pattern="^(step|checkpointing)$", description="rank_hung at a step: hang in the step, or inside the next checkpoint save")
    every_attempt: bool = Field(False, description="fire again after each restart (a recurring fault); default only in the first attempt")
    seed: int = Field(0, description="random: the seed of the draw")


class FaultsSection(Section):
    """``[faults]``: faults to inject, to test and rehearse recovery. Each injection is an event."""

    inject: list[FaultSpec] = Field([], description="the faults")


class Config(BaseModel):
    """The whole run configuration. Subclass it to add your script's own sections."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    run: RunSection = RunSection()
    checkpoint: CheckpointSection = CheckpointSection()
    preemption: PreemptionSection = PreemptionSection()
    stop: StopSection = StopSection()
    launcher: LauncherSection = LauncherSection()
    supervisor: SupervisorSection = SupervisorSection()
    faults: FaultsSection = FaultsSection()


# ---------------------------------------------------------------------------------------------
# loading


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"section.key=value"`` into (``["section", "key"]``, value).

    The value is read as a TOML value when it is one (``20``, ``1e-3``, ``true``, ``[1, 2]``,
    ``"text"``) and kept as a plain string otherwise (``/data/corpus``).

    Raises:
        ConfigError: no ``=`` or no dotted key.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or "." not in key:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set checkpoint.interval=50")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory, expected a TOML file") from None
    except PermissionError:
        raise ConfigError(f"config file {path} is not readable (permission denied)") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"malformed TOML in {path}: {e}") from None


def _model_fields(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names valid at ``loc`` (a path of section/key names) inside ``model``."""
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _format_errors(err: ValidationError, schema: type[BaseModel], source: str, overridden: set[str]) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        dotted = ".".join(loc)
        from_set = any(o == dotted or o.startswith(dotted + ".") for o in overridden)
        where = "--set" if from_set else source
        if e["type"] == "extra_forbidden":
            parent, name = loc[:-1], loc[-1]
            valid = _model_fields(schema, parent)
            what = f"unknown key '{name}'" + (f" in [{'.'.join(parent)}]" if parent else " (unknown section)")
            near = difflib.get_close_matches(name, valid, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else (f"; valid keys: {', '.join(valid)}" if valid else "")
            lines.append(f"{where}: {what}{hint}")
        else:
            got = e.get("input")
            lines.append(f"{where}: {dotted}: {e['msg']} (got {got!r})")
    return "config error:\n  " + "\n  ".join(lines)


def load_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
    schema: type[Config] = Config,
    *,
    ignore_unknown_sections: bool = False,
) -> Config:
    """Read, override and validate a config.

    Args:
        path: TOML file, or ``None`` for defaults only.
        overrides: ``"section.key=value"`` strings, applied in order after the file.
        schema: the :class:`Config` subclass to validate against.
        ignore_unknown_sections: drop top-level sections the schema does not know (the launcher
            validates only trainguard's sections; the script validates its own).

    Returns:
        The validated config object.
    Raises:
        ConfigError: malformed TOML, unknown key (with the nearest valid one), wrong type,
            out-of-range value, or a bad ``--set``.
    """
    data: dict[str, Any] = _read_toml(Path(path)) if path else {}
    source = str(path) if path else "defaults"
    overridden: set[str] = set()
    for text in overrides or []:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {text!r}: '{k}' is a value, not a section")
            node = child
        node[keys[-1]] = value
        overridden.add(".".join(keys))
    if ignore_unknown_sections:
        for name in data:
            near = difflib.get_close_matches(name, list(schema.model_fields), n=1, cutoff=0.8)
            if name not in schema.model_fields and near:
                raise ConfigError(f"config error:\n  {source}: unknown section [{name}]; did you mean [{near[0]}]?")
        data = {k: v for k, v in data.items() if k in schema.model_fields}
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, schema, source, overridden)) from None


def split_cli_args(argv: list[str]) -> tuple[Optional[str], list[str], list[str]]:
    """Pull ``--config PATH`` and ``--set K=V`` (also ``--set=K=V``) out of a script's argv.

    Returns:
        (config path or None, override strings, the remaining arguments).
    Raises:
        ConfigError: ``--config`` or ``--set`` without a value.
    """
    path, sets, rest = None, [], []
    it = iter(argv)
    for arg in it:
        if arg in ("--config", "--set"):
            value = next(it, None)
            if value is None:
                raise ConfigError(f"{arg} needs a value")
            if arg == "--config":
                path = value
            else:
                sets.append(value)
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg.startswith("--set="):
            sets.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    return path, sets, rest


def config_from_argv(schema: type[Config] = Config, argv: list[str] | None = None) -> Config:
    """Load the config a script was started with.

    Reads ``--config``/``--set`` from ``argv`` (default ``sys.argv[1:]``), plus what the launcher
    passed in the environment (``TRAINGUARD_CONFIG``, ``TRAINGUARD_SET``: overrides joined by
    newlines, applied before the script's own). ``TRAINGUARD_RUN_DIR`` sets ``run.dir``.

    Raises:
        ConfigError: as :func:`load_config`.
    """
    path, sets, _ = split_cli_args(list(sys.argv[1:] if argv is None else argv))
    path = path or os.environ.get("TRAINGUARD_CONFIG") or None
    env_sets = [s for s in os.environ.get("TRAINGUARD_SET", "").split("\n") if s]
    cfg = load_config(path, env_sets + sets, schema)
    if os.environ.get("TRAINGUARD_RUN_DIR"):
        cfg.run.dir = Path(os.environ["TRAINGUARD_RUN_DIR"])
    if os.environ.get("TRAINGUARD_INJECT"):  # trainguard run --inject ...
        import json

        extra = [FaultSpec.model_validate(d) for d in json.loads(os.environ["TRAINGUARD_INJECT"])]
        cfg.faults.inject = list(cfg.faults.inject) + extra
    return cfg


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def dump_config(cfg: BaseModel, path: str | os.PathLike) -> None:
    """Write the resolved config as TOML, atomically (temp file + fsync + rename). ``None`` keys are omitted."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        tomli_w.dump(_plain(cfg.model_dump()), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
