#!/usr/bin/env bash
# Install everything the tests need (once), lint (ruff, configured in pyproject.toml), then run the tests.
# Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
venv="${ESFTCTL_VENV:-$root/.venv}"
"$venv/bin/ruff" check esftctl runtime kernels tests recipes benchmarks/scripts setup.py
exec "$venv/bin/python" -m pytest -q "$@"
