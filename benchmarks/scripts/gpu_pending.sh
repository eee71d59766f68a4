#!/usr/bin/env bash
# The GPU work that awaits (rewritten 2026-11-26, fourth session). One machine's worth (about 22 minutes held),
# carried with .world (the serving test needs it):
#   1. the tier-memory fix (0aca4cd: the compressed tier built as the layers page out) on CUDA: the paging, fixed
#      tier, store and engine tests (-k cuda), and test_fixed_rate_tier_served_exactly[qwen3_moe] with CUDA graphs,
#      which failed twice in plain vLLM's memory profiler before the reference freed its engines; about 3 minutes;
#   2. the Qwen3-30B-A3B shape's memory-bound regime with both compressed tiers, refused at start-up on an H100
#      before that fix (H200: the Huffman tier only, vLLM and fixed-rate have 2 rounds in slices/; H100: fixed-rate
#      and Huffman against the H100 vLLM round in slices-h100/); about 15 minutes;
#   3. the fused fixed-rate expert GEMM's second version (its patch applied in a copy of the tree, installed from
#      there: a device call copies the working tree again and took a patch's new files away mid-run, 2026-11-26
#      fourth session): its tests and bench, about 3 minutes.
# Run it in the background and follow it at once: the machine goes back 30 s after a call returns, background job
# or not, and it may be taken back mid-run, so each wait copies what is written so far:
#   bash benchmarks/scripts/background.sh start pending bash benchmarks/scripts/gpu_pending.sh
#   bash benchmarks/scripts/background.sh wait pending 540; cp /tmp/bgout.tgz $OUT/      (again until finished)
# Never set OUT in the calling command: the wait copies into the call's own $OUT.
# background.sh joins its arguments into one shell line: pass a compound command as one quoted argument, not
# through `bash -c '...'` (which then runs an empty bash).
# Still waiting after this, for later machines (each about 12 minutes, steps in the 2026-11-26 second session's
# version of this file: `git show 7de328d:benchmarks/scripts/gpu_pending.sh`): the fused mark-and-fetch launch
# (benchmarks/2026-11-26-h200-b/fused-fetch.patch), DeepSeek-V2-Lite's spare regime with the adaptive server, and
# issue 29's protocol grid (benchmarks/serve-bench/README.md).
# Needs ../shared/gpu/README.md's install. Then untar bgout.tgz's pe2e/out/slices into benchmarks/paging-e2e/ (or
# slices-h100/: its README) and commit.
set -u
export OUT=/tmp/bgout PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
mkdir -p $OUT
pack() { (cd /tmp && tar -czf /tmp/bgout.tgz bgout $(ls -d pe2e/out/slices 2>/dev/null)) 2>/dev/null; }
bash benchmarks/scripts/gpu_tests.sh tiers tests/test_paging.py tests/test_paging_fixed.py tests/test_store_cuda.py \
  tests/test_vllm_model.py -k cuda; pack
bash benchmarks/scripts/gpu_tests.sh q3graphs tests/test_serve.py -k "fixed_rate_tier_served_exactly and qwen3"; pack
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  servers=compressed slices=benchmarks/paging-e2e/slices
else
  servers=fixed,compressed slices=benchmarks/paging-e2e/slices-h100
fi
PE2E_SLICES=$slices bash benchmarks/scripts/paging_e2e_gpu.sh qwen3-30b-a3b --regimes memory-bound \
  --servers $servers --budget 840 > $OUT/pe2e-qwen3.log 2>&1; pack
rm -rf /tmp/fused && cp -r . /tmp/fused
(cd /tmp/fused && git apply benchmarks/2026-11-26-h200-c/fused-moe.patch &&  # esftctl from the copy now (last)
 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/fused_install.log 2>&1 &&
 timeout 180 python3 -m pytest -q tests/test_fixed_rate_moe.py > $OUT/fixed_rate_moe_tests.log 2>&1;
 timeout 300 python3 benchmarks/scripts/fixed_rate_moe_bench.py > $OUT/fixed_rate_moe_bench.log 2>&1); pack
echo all done
