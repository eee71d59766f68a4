#!/usr/bin/env bash
# The GPU work that awaits (rewritten 2026-11-26, third session, for the next one). A session's device time is 30
# minutes and this session's one-GPU machine counted in full, so this is one machine's worth, about 25 minutes on
# an H200, carried with .world (the serving test needs it):
#   1. the host-memory fixes' GPU tests (1f1c868: the store to the GPU in pieces, no pinned base copies where a
#      compressed tier delivers every base expert; 8 of them passed this session), about 3 minutes;
#   2. the fixed-rate tier served exactly with CUDA graphs on both sides, DeepSeek-V2 and Qwen3-MoE (issue 28's
#      "done when"; the Qwen3 case passed eager on the CPU build), about 6 minutes;
#   then the fused fixed-rate expert GEMM's second version (below), about 2 minutes (correctness first: the machine
#   may be taken back mid-run);
#   3. the Qwen3-30B-A3B shape's memory-bound regime with the Huffman tier, whose server the host OOM-killed before
#      the fixes (plain vLLM and the fixed-rate tier have 2 rounds each: benchmarks/RESULTS.md), about 8 minutes
#      with the base and its store generated.
# Run it in the background and follow it at once: the machine goes back 30 s after a call returns, background job
# or not, and it may be taken back mid-run, so each wait copies what is written so far:
#   bash benchmarks/scripts/background.sh start pending bash benchmarks/scripts/gpu_pending.sh
#   bash benchmarks/scripts/background.sh wait pending 540; cp /tmp/bgout.tgz $OUT/; \
#     tar -czf $OUT/slices-now.tgz -C /tmp/pe2e/out slices     (again until finished)
# background.sh joins its arguments into one shell line: pass a compound command as one quoted argument, not
# through `bash -c '...'` (which then runs an empty bash).
# Still waiting after this, for later machines (each about 12 minutes, steps in the 2026-11-26 second session's
# version of this file: `git show 7de328d:benchmarks/scripts/gpu_pending.sh`): the fused mark-and-fetch launch
# (benchmarks/2026-11-26-h200-b/fused-fetch.patch), DeepSeek-V2-Lite's spare regime with the adaptive server, and
# issue 29's protocol grid (benchmarks/serve-bench/README.md).
# Needs ../shared/gpu/README.md's install. Then untar bgout.tgz's pe2e/out/slices into benchmarks/paging-e2e/ and
# commit.
set -u
export OUT=/tmp/bgout PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
mkdir -p $OUT
pack() { (cd /tmp && tar -czf /tmp/bgout.tgz bgout $(ls -d pe2e/out/slices 2>/dev/null)) 2>/dev/null; }
bash benchmarks/scripts/gpu_tests.sh hostmem tests/test_store_cuda.py tests/test_paging.py tests/test_row_fetch.py \
  tests/test_paging_fixed.py tests/test_vllm_model.py -k cuda; pack
bash benchmarks/scripts/gpu_tests.sh fixed_graphs tests/test_serve.py -k "fixed_rate_tier_served_exactly or \
store_tier_served_exactly"; pack
# The fused fixed-rate expert GEMM's second version (its patch beside this session's logs; compiled for sm_90 on
# the CPU with Triton 3.9: kWidth 2 like vLLM's, predicted bit-exact, still 206-225 registers): the device's Triton
# 3.6 compile check, its tests and the bench, then the patch taken back; about 2 minutes.
patch=benchmarks/2026-11-26-h200-c/fused-moe.patch
if git apply "$patch"; then
  (export PYTHONPATH=/tmp/site:$PWD; timeout 120 python3 benchmarks/scripts/fixed_rate_moe_compile.py --only deepseek \
     > $OUT/fixed_rate_moe_compile.log 2>&1
   timeout 180 python3 -m pytest -q tests/test_fixed_rate_moe.py > $OUT/fixed_rate_moe_tests.log 2>&1
   timeout 240 python3 benchmarks/scripts/fixed_rate_moe_bench.py > $OUT/fixed_rate_moe_bench.log 2>&1)
  git apply -R "$patch"
fi; pack
bash benchmarks/scripts/paging_e2e_gpu.sh qwen3-30b-a3b --regimes memory-bound --servers compressed \
  --budget 600 > $OUT/pe2e-qwen3-compressed.log 2>&1; pack
echo all done
