#!/usr/bin/env bash
# The GPU serving tests on the device machine, once ../shared/gpu/README.md's install has put vLLM's CUDA
# build in /tmp/site (on a new checkout: build_payload.sh, then benchmarks/lab/payload_split.sh for the
# transfers). The tiny world comes carried in .world (built here: ESFTCTL_WORLD=.world python
# recipes/tiny_world.py --root .world), so the device does not rebuild it.
# Usage: bash benchmarks/lab/gpu_tests.sh NAME PYTEST_ARGS...   (log in $OUT/NAME.log, every test's vLLM logs
#   beside in NAME-vllm-logs.tgz, passed or not)
# It lists the tests it selected first: -k matches substrings, so 'cuda_graphs_served_exactly' also selects
# test_paging_with_cuda_graphs_served_exactly (2026-11-29: a call meant for one test ran out of time in the second;
# name a test by its whole name, 'test_cuda_graphs_served_exactly'). It refuses to start while another process
# holds GPU memory (a background bench's server leaves the tests' engines too little memory to start).
# DEADLINE=S: pytest is interrupted (SIGINT) after S seconds and still prints its failures and their tracebacks,
# and the vLLM logs are still packed: set it below the call's limit (2026-12-06: `timeout 570` around this script
# killed it in the sixth of thirteen tests, and of a failure only its "F" came back).
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 ESFTCTL_WORLD=$PWD/.world PYTHONUNBUFFERED=1
[ -d /tmp/cute-site ] && export PYTHONPATH=$PYTHONPATH:/tmp/cute-site  # CUTLASS's DSL (cute_payload.sh), if installed
name=$1; shift
# no test named: the whole suite, past any call's limit (2026-12-05: an empty glob ran it, and the call timed out
# with its 70th test and a log too large to come back)
[ "$#" -gt 0 ] || { echo "gpu_tests.sh: name the tests to run (files or node ids); the whole suite runs past a call's 10-minute limit"; exit 2; }
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
card=${CUDA_VISIBLE_DEVICES:-0}; card=${card%%,*}  # the card the tests get (gpu_cards.sh sets one a card)
used=$(nvidia-smi -i "$card" --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null)
if [ "${used:-0}" -gt 4096 ]; then  # idle: about 0.6 GiB; a bench's server: nearly all of it
  echo "gpu_tests.sh: $used MiB of GPU $card's memory is held by another process; wait for it or stop it first"
  exit 1
fi
python3 -m pytest -q --collect-only -p no:cacheprovider "$@" 2>&1 | grep '::' | sed 's/^/selected: /' \
  | tee "$out/$name.log"
# Passed tests keep their tmp_path here (pyproject drops them, for CI's disk), so that their vLLM logs come back too:
# 2026-12-06's tarballs of two passed tests were empty, and their start-ups, 100 s slower than before, unread.
stamp=$(mktemp)
${DEADLINE:+timeout -s INT -k 60 "$DEADLINE"} python3 -m pytest -q -rfEs --durations=12 -p no:cacheprovider \
  -o tmp_path_retention_policy=all "$@" 2>&1 | tee -a "$out/$name.log"
status=${PIPESTATUS[0]}
find /tmp/pytest-of-root -name vllm.log -newer "$stamp" 2>/dev/null \
  | tar -czf "$out/$name-vllm-logs.tgz" -T - 2>/dev/null
rm -f "$stamp"
exit "$status"
