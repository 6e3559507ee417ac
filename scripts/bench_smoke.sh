#!/usr/bin/env bash
# Every benchmark at its smallest sizes (benchmarks/test_smoke.py: each script's --smoke mode runs to
# its tables), so that a change elsewhere cannot silently break one. Not part of the test suite
# (scripts/test.sh), to keep that under 15 minutes on 2 cores; CI (.ci/run) runs both. About 3
# minutes on 2 cores. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --durations=5 benchmarks/test_smoke.py "$@"
