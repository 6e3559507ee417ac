"""``RUN_DIR/watch_state.json``: what the watch remembers between passes.

* ``samples``: ``[time, bytes]`` pairs, the checkpoint directory's size at each pass, from which the
  growth rate is measured (:mod:`trainguard.watch.growth`). Samples older than ``WINDOW`` seconds
  are dropped; past ``MAX_SAMPLES`` every second older sample is dropped, so a long window stays
  covered at a coarser spacing.
* ``alerting``: condition name → ``{"since": time, "message": text, "unsent": [urls]}`` for every
  condition alerted and not yet recovered (``unsent``: notification URLs the alert has not reached
  yet; later passes retry them).

The file is replaced atomically (a failed write, e.g. on the full disk being reported, is a
warning); a pass holds ``RUN_DIR/.watch.lock`` (``flock``) so two watches on
one run dir (a cron pass and a loop) never alert twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..atomic import write_atomic

STATE_FILE = "watch_state.json"
LOCK_FILE = ".watch.lock"
WINDOW = 7 * 86400.0
MAX_SAMPLES = 2000


@dataclass
class WatchState:
    """The persisted state; see the module docstring."""

    samples: list[list[float]] = field(default_factory=list)
    alerting: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def load(cls, run_dir: Path) -> WatchState:
        """Read the state; a missing file is an empty state, an unreadable one too (with a warning)."""
        path = Path(run_dir) / STATE_FILE
        try:
            data = json.loads(path.read_text())
            samples = [[float(t), float(b)] for t, b in data.get("samples", [])]
            alerting = {str(k): dict(v) for k, v in data.get("alerting", {}).items()}
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError, TypeError, AttributeError) as e:
            print(f"trainguard: warning: ignoring unreadable {path} ({e}); starting a new history", file=sys.stderr)
            return cls()
        return cls(samples=samples, alerting=alerting)

    def save(self, run_dir: Path) -> None:
        """Write the state atomically (temporary file, then rename)."""
        write_atomic(
            Path(run_dir) / STATE_FILE, json.dumps({"samples": self.samples, "alerting": self.alerting}) + "\n"
        )

    def add_sample(self, when: float, nbytes: float) -> None:
        """Record the checkpoint directory's size, dropping samples outside the window."""
        self.samples.append([when, float(nbytes)])
        self.samples = [s for s in self.samples if when - s[0] <= WINDOW]
        if len(self.samples) > MAX_SAMPLES:
            half = len(self.samples) // 2
            self.samples = self.samples[:half:2] + self.samples[half:]


@contextlib.contextmanager
def locked(run_dir: Path) -> Iterator[None]:
    """Hold ``RUN_DIR/.watch.lock`` exclusively (waits for another pass to finish)."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:  # a full disk cannot create it: check anyway, unlocked
        print(f"trainguard: warning: running unlocked, cannot open {LOCK_FILE}: {e}", file=sys.stderr)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
