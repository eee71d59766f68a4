#!/usr/bin/env bash
# Install everything the tests need (once) and run them. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
exec "${ESFTCTL_VENV:-$root/.venv}/bin/python" -m pytest -q "$@"
