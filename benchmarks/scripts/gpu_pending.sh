#!/usr/bin/env bash
# The GPU work that awaits (written 2026-11-26, sixth session, for its second machine; a plain call gets an H100,
# counting half of its held time). Issue 28: the memory-bound regime's `+adapters` server (4 adapters loaded, the
# requests spread over them), never run, on the Qwen3-30B-A3B shape where the H100 has plain vLLM (1 round) and the
# fixed-rate tier (2): plain vLLM's round 1 and the fixed-rate tier with adapters, rounds 0 and 1 (generating the base
# 2-3 min, a slice 4-6 min). Then issue 29's protocol grid (benchmarks/serve-bench/README.md) with what is left.
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
PE2E_SLICES=benchmarks/paging-e2e/slices-h100 bash benchmarks/scripts/paging_e2e_gpu.sh qwen3-30b-a3b \
  --regimes memory-bound --rounds 2 --servers vllm,fixed+adapters --budget 900 > $OUT/memory_bound.log 2>&1; pack
left=$((1380 - SECONDS))  # seconds this machine has left for issue 29's grid
echo "issue 29 budget: $left s" >> $OUT/memory_bound.log
if [ "$left" -ge 600 ]; then
  bash benchmarks/scripts/serve_bench_gpu.sh --budget "$left" --adapter-shape deepseek --adapters 0,1,5,10,20 \
    --rates 1,2,5 --alphas 1 --duration 60 --repeats 3 --servers base,merged,esftctl,lora > $OUT/serve.log 2>&1
fi
pack
echo all done
