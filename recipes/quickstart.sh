#!/usr/bin/env bash
# The quick start, end to end on a fresh machine: set up .venv, build the tiny MoE world, inspect its base,
# prepare one ESFT adapter bundle per task and check the quick start's promise (recipes/esft_adapters.py exits 1
# if a target is missed), then serve them all in one vLLM server and query each (recipes/serve_adapters.py exits
# 1 if a served adapter answers otherwise than its fine-tuned model).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
start=$SECONDS
stage() { printf '\n\033[1m== %s  (%ds so far)\033[0m\n' "$*" $((SECONDS - start)); }

stage "1/5 setting up .venv"
bash "$root/scripts/setup_env.sh"
venv="${ESFTCTL_VENV:-$root/.venv}"
world="$("$venv/bin/python" -c 'from esftctl.world.build import default_world_dir; print(default_world_dir())')"

stage "2/5 the tiny MoE world (built once, 2-5 minutes on one core; cached in $world)"
"$venv/bin/python" "$root/recipes/tiny_world.py"
stage "3/5 the base, as esftctl inspect sees it"
"$venv/bin/esftctl" inspect "$world/base"
# One ESFT adapter per task: relevance -> select -> fine-tune the selected experts -> pack -> inspect -> verdict.
stage "4/5 one ESFT adapter per task (25-100 s each), then the promise, target by target"
"$venv/bin/python" "$root/recipes/esft_adapters.py"
# Serve the base and every adapter in one vLLM server; one request per adapter and to the base, sent together.
stage "5/5 serving the base and the four adapters from one vLLM server (about a minute)"
"$venv/bin/python" "$root/recipes/serve_adapters.py"
printf '\n\033[1mquick start done in %ds\033[0m\n' $((SECONDS - start))
