#!/usr/bin/env bash
# The GPU work that awaits (2026-11-26, fifth session, its second H100): issue 28's spare regime on DeepSeek-V2-Lite
# in slices-h100/ (the H200 had every server of it but the adaptive one; an H100 has none): esftctl resident (the
# anchor), then adaptive (the planner between steps), then the fixed-rate tier; then the fixed-rate decoders on this
# card (item 5: the single decoder reached 89% of the H100's bound, the row decoder 59% of the H200's).
# About 20 minutes: the base 1.5 min, the Huffman store of the adaptive server 2-3 min, a spare slice 3-5.5 min.
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
export PE2E_SLICES=benchmarks/paging-e2e/slices-h100
mkdir -p $OUT
pack() { (cd /tmp && tar -czf /tmp/bgout.tgz bgout) 2>/dev/null; }
spare() { bash benchmarks/scripts/paging_e2e_gpu.sh deepseek-v2-lite --regimes spare --rounds 1 "$@"; }
spare --servers resident,adaptive --budget 900 > $OUT/spare.log 2>&1; pack
spare --servers resident,adaptive,fixed --budget 420 > $OUT/spare2.log 2>&1; pack
timeout 200 python3 benchmarks/scripts/fixed_rate_bench.py > $OUT/decoder_h100.log 2>&1; pack
echo all done
