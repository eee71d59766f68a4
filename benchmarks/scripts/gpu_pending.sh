#!/usr/bin/env bash
# The GPU work that awaits (written 2026-11-26, fifth session, for the next one; a plain call gets an H100, counting
# half of its held time: two machines a session, about 22 minutes of work each). This is the first, carried with
# .world (the serving tests need it). Issue 28's adaptive planner now starts with the layers that fit beside the KV
# cache's need (8024a15), measured on no GPU yet:
#   1. its GPU test, and every paged mode's serving exactness with CUDA graphs (the adaptive planner is in both
#      servers of test_paging_with_cuda_graphs_served_exactly); about 8 minutes;
#   2. the adaptive server in DeepSeek-V2-Lite's spare regime, rounds 0 and 1, in slices-h100/ (resident, fixed
#      and plain vLLM have two rounds there): the base 1.5 min, its Huffman store 1 min, a slice about 3.5 min.
# The second machine: issue 29's protocol grid (benchmarks/serve-bench/README.md, `--budget` what is left).
# Run it in the background and follow it at once: the machine goes back 30 s after a call returns, background job
# or not, and it may be taken back mid-run, so each wait copies what is written so far:
#   bash benchmarks/scripts/background.sh start pending bash benchmarks/scripts/gpu_pending.sh
#   bash benchmarks/scripts/background.sh wait pending 540; cp /tmp/bgout.tgz $OUT/      (again until finished)
# Never set OUT in the calling command: the wait copies into the call's own $OUT.
# background.sh joins its arguments into one shell line: pass a compound command as one quoted argument, not
# through `bash -c '...'` (which then runs an empty bash).
# Needs ../shared/gpu/README.md's install.
set -u
export OUT=/tmp/bgout PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
mkdir -p $OUT
pack() { (cd /tmp && tar -czf /tmp/bgout.tgz bgout) 2>/dev/null; }
bash benchmarks/scripts/gpu_tests.sh start tests/test_vllm_model.py -k "adaptive_paging_starts"; pack
bash benchmarks/scripts/gpu_tests.sh paged_graphs tests/test_serve.py -k "paging_with_cuda_graphs"; pack
PE2E_SLICES=benchmarks/paging-e2e/slices-h100 bash benchmarks/scripts/paging_e2e_gpu.sh deepseek-v2-lite \
  --regimes spare --rounds 2 --servers vllm,resident,fixed,adaptive --budget 600 > $OUT/spare_adaptive.log 2>&1; pack
echo all done
