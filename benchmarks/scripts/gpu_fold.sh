#!/usr/bin/env bash
# The reroute folded into vLLM's compiled top-k (esftctl.runtime.vllm.topk, ESFTCTL_FOLD_REROUTE=1) on the GPU,
# in one background job of about 21 minutes after ../shared/gpu/README.md's install (carry .world with the last
# transfer), so that it fits one session's 1,800 s of device time with the transfers and a margin:
#   1. its GPU test and deepseek_v2's serving exactness tests with the fold on (CUDA graphs, and paged with graphs);
#   2. the 4-layer step profile, plain vLLM against esftctl with the fold, batches 1 and 2 and a 256-token
#      prefill: the reroute kernel must be gone from fold-graphs' kernel diff (esftctl without the fold against
#      plain vLLM is the twenty-fourth session's diff);
#   3. the decode step on the real model (`mixed_step.py`, one round of plain, esftctl, esftctl-fold; skipped if
#      the tests failed).
# Each stage packs /tmp/fold into /tmp/fold.tgz when it ends, so a wait brings back what is done:
#   bash benchmarks/scripts/background.sh start fold "bash benchmarks/scripts/gpu_fold.sh"
#   bash benchmarks/scripts/background.sh wait fold 540 /tmp/fold.tgz   (again, each within 30 s of the last answer)
# If the tests pass and the profile shows no reroute kernel, make the fold the default (`topk.enabled`).
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p /tmp/fold
pack() { tar -czf /tmp/fold.tgz -C /tmp fold 2>/dev/null; echo "[$(date +%T)] $1"; }

OUT=/tmp/fold ESFTCTL_FOLD_REROUTE=1 bash benchmarks/scripts/gpu_tests.sh fold-tests tests/test_vllm_topk.py \
  "tests/test_serve.py::test_cuda_graphs_served_exactly[deepseek_v2]" \
  "tests/test_serve.py::test_paging_with_cuda_graphs_served_exactly[deepseek_v2]"
tests=$?
pack "tests: exit $tests"

python3 benchmarks/scripts/profile_step.py --out /tmp/fold/profile --passes plain-graphs,fold-graphs \
  --batches 1,2 --prefill 256 --budget 330 > /tmp/fold/profile.log 2>&1
profile=$?
rm -f /tmp/fold/profile/*.json.gz  # the traces: their splits are in results.json
pack "profile: exit $profile ($(tail -1 /tmp/fold/profile.log))"

if [ "$tests" -eq 0 ]; then
  python3 benchmarks/scripts/mixed_step.py --out /tmp/fold/ms --work /dev/shm/bench --arms plain,esftctl,esftctl-fold \
    --decoders 2 --arrivals 6 --gap 1.5 --capture-sizes 512 > /tmp/fold/mixed_step.log 2>&1
  pack "mixed_step: exit $?"
fi
echo "all done"
