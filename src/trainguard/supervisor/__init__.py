"""Hang supervision: rank heartbeats and sections (shared memory), learned timeouts, the monitor."""

from .heartbeat import HeartbeatReader, HeartbeatWriter
from .monitor import HangMonitor
from .timeouts import TimeoutBook

__all__ = ["HangMonitor", "HeartbeatReader", "HeartbeatWriter", "TimeoutBook"]
