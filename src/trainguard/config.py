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
import sys
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import tomli_w

from .atomic import write_atomic
from .launch_env import LaunchEnv, LaunchEnvError
from .sections import (  # noqa: F401  (re-exported: trainguard.config.Section etc.)
    Bytes,
    CheckpointSection,
    ElasticSection,
    FaultSpec,
    FaultsSection,
    HealthSection,
    InstabilitySection,
    LauncherSection,
    MemorySection,
    OOMSection,
    PositiveBytes,
    PreemptionSection,
    RecoverySection,
    RollbackSection,
    RunSection,
    SDCSection,
    Section,
    StopSection,
    StragglerSection,
    SupervisorSection,
    parse_bytes,
    parse_duration,
)
from .slurm.section import SlurmSection  # noqa: E402  (its own module: the slurm package owns it)


class ConfigError(ValueError):
    """Bad configuration input: malformed TOML, unknown key, wrong type or out-of-range value."""


class Config(BaseModel):
    """The whole run configuration. Subclass it to add your script's own sections."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    run: RunSection = RunSection()
    checkpoint: CheckpointSection = CheckpointSection()
    preemption: PreemptionSection = PreemptionSection()
    stop: StopSection = StopSection()
    launcher: LauncherSection = LauncherSection()
    supervisor: SupervisorSection = SupervisorSection()
    faults: FaultsSection = FaultsSection()
    instability: InstabilitySection = InstabilitySection()
    rollback: RollbackSection = RollbackSection()
    oom: OOMSection = OOMSection()
    memory: MemorySection = MemorySection()
    straggler: StragglerSection = StragglerSection()
    health: HealthSection = HealthSection()
    recovery: RecoverySection = RecoverySection()
    sdc: SDCSection = SDCSection()
    elastic: ElasticSection = ElasticSection()
    slurm: SlurmSection = SlurmSection()


# ---------------------------------------------------------------------------------------------
# loading


def parse_value(raw: str) -> Any:
    """Read ``raw`` as a TOML value when it is one (``20``, ``1e-3``, ``true``, ``[1, 2]``, ``"text"``)
    and keep it as plain text otherwise (``/data/corpus``, ``20GiB``)."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def split_key_value(
    item: str, where: str, expected: str = "key=value", error: type[Exception] = ConfigError
) -> tuple[str, str]:
    """Split one ``key=value`` at its first ``=``: (key, value), both stripped of surrounding blanks.

    The value is text; :func:`parse_value` or a pydantic model gives it its type.

    Args:
        item: the text, e.g. ``"checkpoint.interval=50"``.
        where: how the error names the input, e.g. ``"--set 'interval'"``.
        expected: the form the error says was expected.
        error: the exception class raised (:class:`ConfigError`, or a caller's own such as ``WatchError``).
    Raises:
        error: no ``=``, or an empty key; the message is ``"{where}: expected {expected}"``.
    """
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise error(f"{where}: expected {expected}")
    return key, value.strip()


def parse_key_values(
    text: str, where: str, expected: str = "key=value,...", error: type[Exception] = ConfigError
) -> dict[str, str]:
    """Parse ``"key=value,key=value,..."`` (``--inject KIND:...``'s part after the colon, ``--rdzv-conf``)
    into ``{key: value}`` (text values, in order; a repeated key keeps its last value).

    Items are split at every comma (values cannot hold one), blank items are skipped, and each item
    is split by :func:`split_key_value`.

    Raises:
        error: an item without ``=`` or with an empty key (``"{where}: expected {expected}"``).
    """
    return dict(split_key_value(item, where, expected, error) for item in text.split(",") if item.strip())


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"section.key=value"`` into (``["section", "key"]``, value).

    The value is read by :func:`parse_value`: a TOML value when it is one (``20``, ``1e-3``,
    ``true``, ``[1, 2]``, ``"text"``), plain text otherwise (``/data/corpus``).

    Raises:
        ConfigError: no ``=`` or no dotted key.
    """
    expected = "section.key=value, e.g. --set checkpoint.interval=50"
    key, raw = split_key_value(text, f"--set {text!r}", expected)
    if "." not in key:
        raise ConfigError(f"--set {text!r}: expected {expected}")
    return key.split("."), parse_value(raw)


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
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {e.start}: {e.reason}); TOML files are UTF-8"
        ) from None


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
    passed in the environment (:class:`~trainguard.launch_env.LaunchEnv`: its config file, its
    overrides, applied before the script's own, and its ``--inject`` faults). Its run dir sets ``run.dir``.

    Raises:
        ConfigError: as :func:`load_config`, an argument other than ``--config``/``--set``, or a
            malformed launcher variable (:class:`~trainguard.launch_env.LaunchEnvError`).
    """
    path, sets, rest = split_cli_args(list(sys.argv[1:] if argv is None else argv))
    if rest:
        raise ConfigError(
            f"unexpected arguments {rest}: config_from_argv() reads only --config PATH and --set KEY=VALUE "
            "(launcher options such as --inject go before the script name); a script with a command line of "
            "its own uses trainguard.config_from_env() and takes trainguard's settings from the launcher "
            "(trainguard run --config F --set K=V SCRIPT ARGS...)"
        )
    try:
        launch = LaunchEnv.from_environ()
    except LaunchEnvError as e:
        raise ConfigError(str(e)) from None
    path = path or (str(launch.config) if launch.config else None)
    cfg = load_config(path, list(launch.overrides) + sets, schema)
    if launch.run_dir is not None:
        cfg.run.dir = launch.run_dir
    if launch.inject:  # trainguard run --inject ...
        extra = [FaultSpec.model_validate(d) for d in launch.inject]
        cfg.faults.inject = list(cfg.faults.inject) + extra
    return cfg


def config_from_env(schema: type[Config] = Config) -> Config:
    """The config ``trainguard run`` passed to this rank, for a script whose command line is its
    own (argparse, a configurator): ``sys.argv`` is not read. Settings come from the launcher's
    options before the script name, ``trainguard run --config train.toml --set checkpoint.interval=50
    train.py --lr 3e-4``, which reach the ranks in the environment (``TRAINGUARD_CONFIG``,
    ``TRAINGUARD_SET``, see :class:`~trainguard.launch_env.LaunchEnv`); outside the launcher, the
    schema's defaults (plus those variables if set by hand).

    Raises:
        ConfigError: as :func:`config_from_argv`.
    """
    return config_from_argv(schema, argv=[])


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
    write_atomic(path, tomli_w.dumps(_plain(cfg.model_dump())))
