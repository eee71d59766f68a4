#!/usr/bin/env bash
# The GPU work that awaits (written 2026-11-26, sixth session, for the next one; a plain call gets an H100, counting
# half of its held time: two machines a session, about 24 minutes of work each). This is the first, carried with
# .world (the serving tests need it). Issue 28's parking (a paged layer alone in its block keeps its rows there,
# fetching nothing; the adaptive planner leaves the window's layers one a block), CPU-tested only:
#   1. the pager's CUDA cases (graph replays whose last residency parks two layers, adapters loaded while
#      parked) and the runtime's (the adaptive start now parks the window's layer): about 3 minutes;
#   2. the serving tests with CUDA graphs on both sides whose assertions changed: DeepSeek-V2 fetching with one
#      layer parked, Qwen2-MoE adaptive with both window layers parked, the fixed-rate tier; about 20 minutes.
# The second machine: `--regimes spare --rounds 3 --servers resident,adaptive` in slices-h100/ (the adaptive
# slices measured before parking are in benchmarks/2026-11-26-h100-f/adaptive-before-parking/; about 12 minutes),
# then issue 29's protocol grid (benchmarks/serve-bench/README.md) with what is left.
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
pack() { (cd /tmp && tar -czf /tmp/bgout.tgz bgout pe2e/out/slices) 2>/dev/null; }
# The seventh session's first machine ran step 1 (56 passed) and the first serving test before it went back; the
# eighth's ran the rest of the serving tests (3 passed) and the adaptive server's round 0 with parking. Left: its
# rounds 1 and 2 against slices-h100's resident ones (about 13 minutes with the base's generation).
PE2E_SLICES=benchmarks/paging-e2e/slices-h100 bash benchmarks/scripts/paging_e2e_gpu.sh deepseek-v2-lite \
  --regimes spare --rounds 2 --servers resident,adaptive --budget 470 > $OUT/spare.log 2>&1; pack
echo all done
