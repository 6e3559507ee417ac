#!/usr/bin/env bash
# Create .venv (if missing) and install trainguard with all its optional extras (report: matplotlib,
# watch: apprise, gpu: nvidia-ml-py) and the test extras. Idempotent and quick when nothing changed
# (the stamp is a hash of pyproject.toml and the extras). TORCH_SPEC overrides the torch requirement
# (default torch==2.13.0; where a CPU wheel of it lies on local disk, pip takes it from there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -m venv .venv 2>/dev/null; then
    # Debian's python3 ships venv separately
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    rm -rf .venv && "$PY" -m venv .venv
  fi
fi
stamp=".venv/.trainguard-installed"
extras="all,test"
want="$( (cat pyproject.toml; echo "extras=$extras") | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "${TORCH_SPEC:-torch==2.13.0}"
  .venv/bin/pip install -q -e ".[$extras]"
  echo "$want" > "$stamp"
fi
