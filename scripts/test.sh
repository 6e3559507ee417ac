#!/usr/bin/env bash
# Run the test suite (sets up .venv first). Extra arguments go to pytest. The tests against a real
# SLURM cluster (marked slurm) and the long torture and fault-campaign runs (marked soak) are left
# out: scripts/test_slurm.sh and scripts/test_soak.sh run them (CI runs all three); a later -m in the
# arguments replaces this one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --durations=10 -m "not slurm and not soak" "$@"
