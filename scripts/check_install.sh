#!/usr/bin/env bash
# The README's install line in a fresh virtual environment, then trainguard used from outside the
# source tree: the command line, both framework integrations (the [lightning] and [hf] extras) and
# `trainguard demo`, whose example GPT ships in the wheel. Run by CI (.ci/run) after the test suite.
# TORCH_SPEC as in scripts/setup.sh (torch first, as the README says: pip takes the CPU build from
# local disk where it lies there).
set -euo pipefail
cd "$(dirname "$0")/.."
src=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"${PYTHON:-python3}" -m venv "$work/venv"
"$work/venv/bin/pip" install -q "${TORCH_SPEC:-torch==2.13.0}"
"$work/venv/bin/pip" install -q "$src[all]"  # the README: pip install "./trainguard[all]"
cd "$work"
venv/bin/trainguard --help > /dev/null
venv/bin/python - <<'PY'
import trainguard, trainguard.hf, trainguard.lightning
from pathlib import Path
assert "site-packages" in trainguard.__file__, trainguard.__file__  # the installed copy, not the checkout
assert (Path(trainguard.__file__).parent / "examples" / "gpt.py").is_file()
print("check_install: trainguard", trainguard.__version__, "with its Lightning and Hugging Face integrations")
PY
# the example's own model (steps long enough for the demo's signals to land mid-run), fewer steps
short=(--set train.max_steps=60 --set train.log_interval=10)
venv/bin/trainguard demo --run-dir "$work/demo" "${short[@]}" > "$work/demo.log" 2>&1 || {
  tail -40 "$work/demo.log"; echo "check_install: trainguard demo failed from the installed wheel" >&2; exit 1; }
tail -5 "$work/demo.log"
echo "check_install: ok"
