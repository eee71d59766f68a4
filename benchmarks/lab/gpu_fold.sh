#!/usr/bin/env bash
# What the reroute folded into vLLM's compiled top-k (esftctl.runtime.vllm.topk, the default since 2026-12-01)
# saves, and the fold on the routers its first GPU run did not serve, in one background job of about 21 minutes
# after ../shared/gpu/README.md's install (carry .world with the last transfer):
#   1. its GPU test, and DeepSeek-V3's and GLM-4.5's serving exactness tests (biased routers, which vLLM's CUDA
#      build routes in its own CUDA op inside the compiled top-k; the lookup runs after it there), about 4 min;
#   2. the decode step on the real model (`mixed_step.py`, one round of plain vLLM, esftctl and esftctl without
#      the fold, ESFTCTL_FOLD_REROUTE=0; skipped if the tests failed), about 11 min;
#   3. the 4-layer step profile, plain vLLM, esftctl and esftctl without the fold, batches 1 and 2 and a 256-token
#      prefill: each column's kernel diff against plain vLLM, the reroute kernel in the unfolded one only, 6 min.
# It ran whole on an H200 on 2026-12-04 (21 min; benchmarks/RESULTS.md, twenty-sixth session: 8 passed, a decode
# step 4.126 ms folded, 4.227 unfolded, 4.118 plain vLLM). Each stage packs /tmp/fold into /tmp/fold.tgz when it
# ends, so a wait brings back what is done:
#   bash benchmarks/lab/background.sh start fold "bash benchmarks/lab/gpu_fold.sh"
#   bash benchmarks/lab/background.sh wait fold 540 /tmp/fold.tgz   (again, each within 30 s of the last answer)
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p /tmp/fold
pack() { tar -czf /tmp/fold.tgz -C /tmp fold 2>/dev/null; echo "[$(date +%T)] $1"; }

OUT=/tmp/fold bash benchmarks/lab/gpu_tests.sh fold-tests tests/test_runtime_vllm_topk.py \
  "tests/test_serve_adapters.py::test_other_architecture_served_exactly[deepseek_v3]" \
  "tests/test_serve_adapters.py::test_other_architecture_served_exactly[glm4_moe]"
tests=$?
pack "tests: exit $tests"

if [ "$tests" -eq 0 ]; then
  python3 benchmarks/lab/mixed_step.py --out /tmp/fold/ms --work /dev/shm/bench \
    --arms plain,esftctl,esftctl-unfolded --decoders 2 --arrivals 6 --gap 1.5 --capture-sizes 512 \
    > /tmp/fold/mixed_step.log 2>&1
  pack "mixed_step: exit $?"
fi

python3 benchmarks/lab/profile_step.py --out /tmp/fold/profile \
  --passes plain-graphs,esft-graphs,unfolded-graphs --batches 1,2 --prefill 256 --budget 420 \
  > /tmp/fold/profile.log 2>&1
profile=$?
rm -f /tmp/fold/profile/*.json.gz  # the traces: their splits are in results.json
pack "profile: exit $profile ($(tail -1 /tmp/fold/profile.log))"
echo "all done"
