#!/usr/bin/env bash
# Run the demo: the example GPT trained twice on 2 CPU ranks, once cleanly and once with faults
# injected (SIGTERM + requeue, SIGKILL of a rank), then a table and the hash comparison.
# Extra arguments go to `trainguard demo` (e.g. --set train.max_steps=60).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/trainguard demo "$@"
