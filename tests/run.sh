#!/usr/bin/env bash
# Install everything the tests need (once), lint (ruff, configured in pyproject.toml), then run the tests.
# Extra arguments go to pytest: `bash tests/run.sh -m quick` runs the quick subset (tests/conftest.py marks it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
venv="${ESFTCTL_VENV:-$root/.venv}"
"$venv/bin/ruff" check esftctl runtime kernels tests recipes benchmarks/lab setup.py
# --durations: the slowest tests, so that a run that takes longer than the last says where (2026-12-04: 69 min on a
# dev machine where CI had taken 34 and earlier fresh clones 24-28).
exec "$venv/bin/python" -m pytest -q --durations=25 "$@"
