"""The launcher → rank contract: what ``trainguard run`` tells its ranks through the environment.

Every environment variable that passes between the launcher and its ranks is named here, once:
:class:`LaunchEnv` holds them as typed fields, the launcher writes them with
:meth:`LaunchEnv.to_environ` and every rank-side reader builds one with
:meth:`LaunchEnv.from_environ`. Two kinds of variables:

* trainguard's own (``TRAINGUARD_*``), written by ``trainguard run`` for all its ranks;
* torch elastic's per-worker ones (``TORCHELASTIC_RESTART_COUNT``, ``LOCAL_RANK``, ``GROUP_RANK``,
  ``LOCAL_WORLD_SIZE``), which torch's agent sets for each worker; they are read here, never written.

An unset or empty variable means "not given" (a script run without ``trainguard run`` sees the
defaults). This module imports only the standard library: the launcher's command line imports it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

# ---- trainguard's variables (written by the launcher) -------------------------------------------
RUN_DIR = "TRAINGUARD_RUN_DIR"
CONFIG = "TRAINGUARD_CONFIG"
SET = "TRAINGUARD_SET"
INJECT = "TRAINGUARD_INJECT"
LAUNCH_TIME = "TRAINGUARD_LAUNCH_TIME"
HEARTBEAT_DIR = "TRAINGUARD_HEARTBEAT_DIR"
END_TIME = "TRAINGUARD_END_TIME"
END_TIME_FILE = "TRAINGUARD_END_TIME_FILE"
RECOVERY_STORE = "TRAINGUARD_RECOVERY_STORE"
RECOVERY_DIR = "TRAINGUARD_RECOVERY_DIR"
RECOVERY_GROUP = "TRAINGUARD_RECOVERY_GROUP"
RECOVERY_KEY = "TRAINGUARD_RECOVERY_KEY"  # never copied through a store (assignment() leaves it out)
RECOVERY_NONCE = "TRAINGUARD_RECOVERY_NONCE"  # the launch's nonce (hex) bound into every sealed value
BOUNDARY_MIRROR = "TRAINGUARD_BOUNDARY_MIRROR"  # "1": copy the step-boundary files into the recovery store
SPARE_NODES = "TRAINGUARD_SPARE_NODES"  # "1": spare nodes may replace a lost node (the ranks watch for the word)
# set by the launcher for one process only: a replacement of a lost rank (not in to_environ)
JOIN = "TRAINGUARD_JOIN"
# ---- torch elastic's per-worker variables (read only) --------------------------------------------
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
LOCAL_RANK = "LOCAL_RANK"
GROUP_RANK = "GROUP_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
# ---- the batch script → launcher variable (``trainguard slurm script``; the launcher removes it) --
READY_DIR = "TRAINGUARD_READY_DIR"
# torch elastic's variables that name a worker's place in the group (and its group's store): a warm
# spare takes its assignment at the script's first read of one (trainguard.rejoin.replacement)
RANK_VARIABLES = frozenset(
    (
        "RANK",
        LOCAL_RANK,
        "WORLD_SIZE",
        LOCAL_WORLD_SIZE,
        GROUP_RANK,
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        RESTART_COUNT,
    )
)

WRITTEN = (
    RUN_DIR,
    CONFIG,
    SET,
    INJECT,
    LAUNCH_TIME,
    HEARTBEAT_DIR,
    END_TIME,
    END_TIME_FILE,
    RECOVERY_STORE,
    RECOVERY_DIR,
    RECOVERY_GROUP,
    RECOVERY_KEY,
    RECOVERY_NONCE,
    BOUNDARY_MIRROR,
    SPARE_NODES,
)


class LaunchEnvError(ValueError):
    """A launcher → rank variable holds a value of the wrong form (the message names it)."""


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher tells a rank. Every field is ``None`` / empty / 0 when not launched by
    ``trainguard run`` (or torch elastic, for the torch fields).

    Attributes:
        run_dir: the run directory (``TRAINGUARD_RUN_DIR``); sets the rank's ``run.dir``.
        config: the config file given to the launcher, absolute (``TRAINGUARD_CONFIG``).
        overrides: the launcher's ``--set KEY=VALUE`` overrides, applied before the script's own
            (``TRAINGUARD_SET``: joined by newlines).
        inject: ``--inject`` fault specs as plain dicts (``TRAINGUARD_INJECT``: a JSON list),
            validated into ``FaultSpec`` by the config loader.
        launch_time: Unix seconds when the launch began (``TRAINGUARD_LAUNCH_TIME``); restarted
            groups share it, so the time limit counts the whole launch.
        heartbeat_dir: node-local directory of the heartbeat records (``TRAINGUARD_HEARTBEAT_DIR``);
            ``None`` when the hang supervisor is off.
        end_time: Unix seconds by which the ranks must have saved and exited, under SLURM
            (``TRAINGUARD_END_TIME``); ``None``: no end time.
        end_time_file: the file the launcher keeps that end time current in
            (``TRAINGUARD_END_TIME_FILE``).
        recovery_store: ``host:port`` of the launcher's in-process recovery store
            (``TRAINGUARD_RECOVERY_STORE``; :mod:`trainguard.rejoin.protocol`); ``None``: in-process
            recovery is off.
        recovery_dir: node-local directory of the ranks' step-boundary files (``TRAINGUARD_RECOVERY_DIR``).
        recovery_group: the number of the group start whose keys the recovery store holds
            (``TRAINGUARD_RECOVERY_GROUP``, from node 0's launcher; every start of a group counts,
            a restart for a node that joined too, which torch's restart count does not).
        recovery_key: the launch's secret that seals the recovery store's values
            (``TRAINGUARD_RECOVERY_KEY``, hex; :mod:`trainguard.rejoin.auth`); not in ``repr``.
        recovery_nonce: the launch's nonce bound into every sealed value (``TRAINGUARD_RECOVERY_NONCE``,
            hex; the recovery store's launcher drew it; :class:`~trainguard.rejoin.auth.Seal`).
        boundary_mirror: copy each step-boundary file into the recovery store as well
            (``TRAINGUARD_BOUNDARY_MIRROR`` = ``1``): the launcher sets it on a node that a spare
            node may replace (every node but the recovery store's), whose files die with it.
        spare_nodes: spare nodes may replace a lost node (``TRAINGUARD_SPARE_NODES`` = ``1``): the
            rank watches for the leading launcher's word of a lost node (:mod:`trainguard.rejoin.notice`).
        join: the generation this process joins as the replacement of a lost rank (``TRAINGUARD_JOIN``,
            set for that process only); ``None`` for a rank of a starting group.
        restart_count: worker-group restart count (torch's ``TORCHELASTIC_RESTART_COUNT``, default 0).
        local_rank: rank on this node (``LOCAL_RANK``, default 0).
        group_rank: this node's rank among the nodes (``GROUP_RANK``, default 0).
        local_world_size: ranks on this node (``LOCAL_WORLD_SIZE``); ``None`` when unset.
    """

    run_dir: Optional[Path] = None
    config: Optional[Path] = None
    overrides: tuple[str, ...] = ()
    inject: tuple[dict[str, Any], ...] = ()
    launch_time: Optional[float] = None
    heartbeat_dir: Optional[Path] = None
    end_time: Optional[float] = None
    end_time_file: Optional[Path] = None
    recovery_store: Optional[str] = None
    recovery_dir: Optional[Path] = None
    recovery_group: int = 0
    recovery_key: Optional[bytes] = field(default=None, repr=False)
    recovery_nonce: bytes = b""
    boundary_mirror: bool = False
    spare_nodes: bool = False
    join: Optional[int] = None
    restart_count: int = 0
    local_rank: int = 0
    group_rank: int = 0
    local_world_size: Optional[int] = None

    @classmethod
    def from_environ(cls, env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
        """Read the contract from ``env`` (default ``os.environ``, read now).

        Raises:
            LaunchEnvError: a variable is set to a value of the wrong form (not a number, a
                negative rank, an inject list that is not a JSON list of objects); the message
                names the variable and its value. (Overrides are checked where they are applied,
                by the config loader.)
        """
        env = os.environ if env is None else env
        return cls(
            run_dir=_path(env, RUN_DIR),
            config=_path(env, CONFIG),
            overrides=tuple(s for s in env.get(SET, "").split("\n") if s),
            inject=_inject(env),
            launch_time=_float(env, LAUNCH_TIME),
            heartbeat_dir=_path(env, HEARTBEAT_DIR),
            end_time=_float(env, END_TIME),
            end_time_file=_path(env, END_TIME_FILE),
            recovery_store=env.get(RECOVERY_STORE) or None,
            recovery_dir=_path(env, RECOVERY_DIR),
            recovery_group=_count(env, RECOVERY_GROUP, 0),
            recovery_key=_hex(env, RECOVERY_KEY),
            recovery_nonce=_hex(env, RECOVERY_NONCE) or b"",
            boundary_mirror=env.get(BOUNDARY_MIRROR, "") == "1",
            spare_nodes=env.get(SPARE_NODES, "") == "1",
            join=_count(env, JOIN, None),
            restart_count=_count(env, RESTART_COUNT, 0),
            local_rank=_count(env, LOCAL_RANK, 0),
            group_rank=_count(env, GROUP_RANK, 0),
            local_world_size=_count(env, LOCAL_WORLD_SIZE, None),
        )

    def to_environ(self) -> dict[str, str]:
        """The ``TRAINGUARD_*`` variables for the ranks' environment: every one of them, ``""`` for
        a field that is not given (so a stale value inherited by the launcher never reaches the
        ranks). Torch's per-worker fields are not included: torch's agent sets those.
        ``LaunchEnv.from_environ(e.to_environ())`` equals ``e`` when the torch fields and ``join`` are defaults.

        Raises:
            LaunchEnvError: an override holds a newline (it could not be read back as one).
        """
        for item in self.overrides:
            if "\n" in item:
                raise LaunchEnvError(
                    f"override {item!r} for {SET}: holds a newline (overrides are passed one per line)"
                )
        return {
            RUN_DIR: _text(self.run_dir),
            CONFIG: _text(self.config),
            SET: "\n".join(self.overrides),
            INJECT: json.dumps(list(self.inject)) if self.inject else "",
            LAUNCH_TIME: repr(float(self.launch_time)) if self.launch_time is not None else "",
            HEARTBEAT_DIR: _text(self.heartbeat_dir),
            END_TIME: repr(float(self.end_time)) if self.end_time is not None else "",
            END_TIME_FILE: _text(self.end_time_file),
            RECOVERY_STORE: self.recovery_store or "",
            RECOVERY_DIR: _text(self.recovery_dir),
            RECOVERY_GROUP: str(self.recovery_group) if self.recovery_group else "",
            RECOVERY_KEY: self.recovery_key.hex() if self.recovery_key else "",
            RECOVERY_NONCE: self.recovery_nonce.hex(),
            BOUNDARY_MIRROR: "1" if self.boundary_mirror else "",
            SPARE_NODES: "1" if self.spare_nodes else "",
        }


def assignment(env: Mapping[str, str]) -> dict[str, str]:
    """What a warm spare is sent of the worker environment ``env`` it takes over: the variables
    that name its place (:data:`RANK_VARIABLES`, torch elastic's ``TORCHELASTIC_*``, trainguard's
    own, ``TRAINGUARD_JOIN``), never :data:`RECOVERY_KEY`; everything else it already has, from
    the environment the launcher started it with."""
    return {
        k: v
        for k, v in env.items()
        if (k in RANK_VARIABLES or k in WRITTEN or k == JOIN or k.startswith("TORCHELASTIC_")) and k != RECOVERY_KEY
    }


def _text(path: Optional[Path]) -> str:
    return "" if path is None else str(path)


def _path(env: Mapping[str, str], name: str) -> Optional[Path]:
    value = env.get(name, "")
    return Path(value) if value else None


def _hex(env: Mapping[str, str], name: str) -> Optional[bytes]:
    value = env.get(name, "")
    if not value:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise LaunchEnvError(f"{name}: expected a hex key (not shown)") from None


def _float(env: Mapping[str, str], name: str) -> Optional[float]:
    value = env.get(name, "")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise LaunchEnvError(f"{name}={value!r}: expected Unix seconds (a number)") from None


def _count(env: Mapping[str, str], name: str, default: Optional[int]) -> Optional[int]:
    value = env.get(name, "")
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise LaunchEnvError(f"{name}={value!r}: expected a whole number ≥ 0")
    return number


def _inject(env: Mapping[str, str]) -> tuple[dict[str, Any], ...]:
    value = env.get(INJECT, "")
    if not value:
        return ()
    try:
        items = json.loads(value)
    except json.JSONDecodeError as e:
        raise LaunchEnvError(f"{INJECT}={value!r}: not JSON ({e.msg})") from None
    if not isinstance(items, list) or not all(isinstance(d, dict) for d in items):
        raise LaunchEnvError(f"{INJECT}={value!r}: expected a JSON list of objects")
    return tuple(items)


__all__ = ["LaunchEnv", "LaunchEnvError"]
