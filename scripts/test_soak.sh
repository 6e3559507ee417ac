#!/usr/bin/env bash
# The long torture and fault-campaign runs (marked soak): the checkpoint torture tests (tens of kills
# during saves) and the in-process recovery campaign (20 kills of the README's plain loop at seeded
# random moments, 4-rank kills). About 6 minutes on 2 cores. Not part of scripts/test.sh, to keep
# that under 15 minutes on 2 cores; CI (.ci/run) runs both. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/test.sh -m soak "$@"
