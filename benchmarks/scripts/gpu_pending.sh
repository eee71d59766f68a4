#!/usr/bin/env bash
# The GPU work that awaits (rewritten 2026-11-26, for the next session), most important first: a DeepSeek-V3 FP8
# base served with adapters (issue 31), the paging bench's spare regime end to end and the machinery regime's last
# round (issue 28 item 4), about 28 minutes on an H200: the first machine of a session. The second machine runs
# issue 29's protocol grid in slices (benchmarks/serve-bench/README.md, --budget 1200). Run it in the background
# and follow it at once (the machine goes back 30 s after a call returns, background job or not):
#   bash benchmarks/scripts/background.sh start pending bash benchmarks/scripts/gpu_pending.sh
#   bash benchmarks/scripts/background.sh wait pending 540; cp /tmp/bgout.tgz $OUT/     (again until finished)
# Needs ../shared/gpu/README.md's install (with benchmarks/scripts/payload_quantized.sh's wheels) and the tiny
# world carried in .world. Then untar bgout.tgz's pe2e/out/slices into benchmarks/paging-e2e/ and commit.
set -u
export OUT=/tmp/bgout PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
mkdir -p $OUT
pack() { (cd /tmp && tar -czf /tmp/bgout.tgz bgout $(ls -d pe2e/out/slices 2>/dev/null)) 2>/dev/null; }
# A DeepSeek-V3-shaped FP8 base served with adapters (issue 31's production case; written 2026-11-26, its offline
# half checked on the CPU; about 3 minutes).
ESFTCTL_WORLD=$PWD/.world bash benchmarks/scripts/gpu_tests.sh fp8 tests/test_serve_fp8.py -k deepseek_v3; pack
# The spare regime (vLLM, resident, the Huffman and fixed-rate tiers, host, adaptive; batch 1 and 32 with CUDA
# graphs; about 4 minutes a server) and what is left of the machinery regime, one round each; the base and its
# store generated first (about 3 minutes).
bash benchmarks/scripts/paging_e2e_gpu.sh deepseek-v2-lite --regimes machinery,spare --budget 1200 \
  > $OUT/pe2e.log 2>&1; pack
echo all done
