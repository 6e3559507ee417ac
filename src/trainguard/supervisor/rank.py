"""The rank's side of hang supervision under ``trainguard run``: its heartbeat record and stack dumps."""

from __future__ import annotations

import faulthandler
from typing import Optional

from ..launch_env import LaunchEnv
from .heartbeat import HeartbeatWriter, heartbeat_path
from .monitor import attempt_dir
from .stacks import STACK_SIGNAL, stack_path


def attach(launch: LaunchEnv) -> Optional[HeartbeatWriter]:
    """Open this rank's heartbeat record (section ``setup`` starts now) and let SIGUSR2 dump every
    thread's stack next to it, where the supervisor copies it from on a hang.

    Args:
        launch: the launcher's contract (the heartbeat directory, the local rank, and the
            restart count: records live per attempt).
    Returns:
        The writer, or ``None`` when not run by ``trainguard run`` with the supervisor on (no
        :attr:`~trainguard.launch_env.LaunchEnv.heartbeat_dir`).
    """
    attempt = launch.restart_count
    if launch.heartbeat_dir is None:
        return None
    directory = attempt_dir(launch.heartbeat_dir, attempt)
    directory.mkdir(parents=True, exist_ok=True)
    local_rank = launch.local_rank
    stack_file = open(stack_path(directory, local_rank), "w")
    faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True)
    writer = HeartbeatWriter(heartbeat_path(directory, local_rank))
    writer.stack_file = stack_file  # open for as long as the rank runs
    writer.open("setup")
    return writer


def enter_teardown(writer: Optional[HeartbeatWriter]) -> None:
    """After the last step: what follows (evaluation, group teardown, exit) is timed as the
    ``teardown`` section (``[supervisor] teardown_timeout``), not as time between steps."""
    if writer is None:
        return
    while writer.current is not None:
        writer.close()
    writer.open("teardown")


def detach(writer: Optional[HeartbeatWriter]) -> None:
    """Undo :func:`attach`: stop the stack-dump signal, close the stack file, unmap the record.
    The launcher reads the record until the process ends, so call this only when the rank is done
    with supervision (``Guard.close()``)."""
    if writer is None:
        return
    faulthandler.unregister(STACK_SIGNAL)
    stack_file = getattr(writer, "stack_file", None)
    if stack_file is not None:
        stack_file.close()
    writer.close_file()
