#!/usr/bin/env bash
# The GPU serving tests on the device machine, once ../shared/gpu/README.md's install has put vLLM's CUDA
# build in /tmp/site (on a new checkout: build_payload.sh, then benchmarks/scripts/payload_split.sh for the
# transfers). The tiny world comes carried in .world (built here: ESFTCTL_WORLD=.world python
# recipes/tiny_world.py --root .world), so the device does not rebuild it.
# Usage: bash benchmarks/scripts/gpu_tests.sh NAME PYTEST_ARGS...   (log in $OUT/NAME.log, vLLM logs beside)
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 ESFTCTL_WORLD=$PWD/.world PYTHONUNBUFFERED=1
name=$1; shift
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -m pytest -q -rs --durations=12 -p no:cacheprovider "$@" 2>&1 | tee "$out/$name.log"
status=${PIPESTATUS[0]}
find /tmp/pytest-of-root -name vllm.log -mmin -15 2>/dev/null \
  | tar -czf "$out/$name-vllm-logs.tgz" -T - 2>/dev/null
exit "$status"
