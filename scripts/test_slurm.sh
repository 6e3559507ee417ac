#!/usr/bin/env bash
# The tests against a real SLURM cluster (tests/test_slurm.py, marked slurm): start one first with
# `sudo bash scripts/slurm-up.sh`. Without a cluster they skip; with TRAINGUARD_REQUIRE_SLURM=1 (CI)
# they fail. About 3 minutes (they run one after another: one cluster of one node). Not part of
# scripts/test.sh, to keep that under 15 minutes on 2 cores; CI (.ci/run) runs both. Extra arguments
# go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/test.sh -m slurm "$@"
