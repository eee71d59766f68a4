#!/usr/bin/env bash
# The quick start, end to end on a fresh machine: set up .venv, build the tiny MoE world, inspect its base,
# prepare one ESFT adapter bundle per task, then serve them all in one vLLM server and query each.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
venv="${ESFTCTL_VENV:-$root/.venv}"
world="$("$venv/bin/python" -c 'from esftctl.world.build import default_world_dir; print(default_world_dir())')"

"$venv/bin/python" "$root/recipes/tiny_world.py"
"$venv/bin/esftctl" inspect "$world/base"
# One ESFT adapter per task: relevance -> select -> fine-tune the selected experts -> pack -> inspect.
"$venv/bin/python" "$root/recipes/esft_adapters.py"
# Serve the base and every adapter in one vLLM server; one request per adapter and to the base, sent together.
"$venv/bin/python" "$root/recipes/serve_adapters.py"
