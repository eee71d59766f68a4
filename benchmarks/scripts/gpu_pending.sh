#!/usr/bin/env bash
# The GPU work that awaits (rewritten 2026-11-26, second session, for the next one): issue 28's memory-bound regime
# on the KV-heavy Qwen3-30B-A3B shape (on DeepSeek-V2-Lite's MLA the fixed-rate tier reached 0.57x of plain vLLM
# there: too little KV to buy; benchmarks/RESULTS.md), after the row decoder's sweep (item 5). About 28 minutes on
# an H200: the first machine of a session. The second: DeepSeek-V2-Lite's spare regime's adaptive server
# (`paging_e2e_gpu.sh deepseek-v2-lite --regimes spare --servers adaptive`, about 5 minutes with the base
# generated), then issue 29's protocol grid in slices (benchmarks/serve-bench/README.md, the rest of the machine as
# --budget). Run it in the background and follow it at once: the machine goes back 30 s after a call returns,
# background job or not, and it may be taken back mid-run, so each wait copies what is written so far:
#   bash benchmarks/scripts/background.sh start pending bash benchmarks/scripts/gpu_pending.sh
#   bash benchmarks/scripts/background.sh wait pending 540; cp /tmp/bgout.tgz $OUT/; \
#     tar -czf $OUT/slices-now.tgz -C /tmp/pe2e/out slices     (again until finished)
# The second machine, first (about 12 minutes): the fused mark-and-fetch launch (issue 28, the machinery's last
# percent at batch 1; a helper's branch fused-fetch, its patch beside this session's logs, off unless
# ESFTCTL_FUSED_FETCH=1): its tests, the micro-measure, then the machinery regime with it on and off:
#   git apply benchmarks/2026-11-26-h200-b/fused-fetch.patch
#   bash benchmarks/scripts/gpu_tests.sh fused tests/test_row_fetch.py tests/test_paging.py
#   python3 benchmarks/scripts/row_fetch_bench.py > $OUT/row_fetch.log   (inactive_26_layers_*_us_per_layer)
#   rm -rf benchmarks/paging-e2e/slices; ESFTCTL_FUSED_FETCH=1 bash benchmarks/scripts/paging_e2e_gpu.sh \
#     deepseek-v2-lite --regimes machinery --servers resident,machinery --rounds 1 --budget 540
#   mv /tmp/pe2e/out/slices/deepseek-v2-lite/machinery/machinery /tmp/pe2e/machinery-fused; then the same
#   command without ESFTCTL_FUSED_FETCH and with --servers machinery; compare batch 1's TPOT of the three (do not
#   commit the fused slice under the machinery server's name).
# Then the fixed-rate tier served exactly with CUDA graphs on both sides, DeepSeek-V2 and Qwen3-MoE (written
# 2026-11-26, the Qwen3 case passed eager on the CPU build; about 6 minutes; needs .world carried):
#   bash benchmarks/scripts/gpu_tests.sh fixed_graphs tests/test_serve.py -k fixed_rate_tier_served_exactly
# Needs ../shared/gpu/README.md's install (with benchmarks/scripts/payload_quantized.sh's wheels). Then untar
# bgout.tgz's pe2e/out/slices into benchmarks/paging-e2e/ and commit.
set -u
export OUT=/tmp/bgout PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
mkdir -p $OUT
pack() { (cd /tmp && tar -czf /tmp/bgout.tgz bgout $(ls -d pe2e/out/slices 2>/dev/null)) 2>/dev/null; }
# The row decoder's variants (issue 28 item 5; written and tested on the CPU with Triton's interpreter on 2026-11-26,
# the patch beside this session's logs): their GPU tests, then the sweep (whole layer and 6 of 64 rows, each checked
# bit for bit, sorted by time), then the patch taken back; about 4 minutes.
patch=benchmarks/2026-11-26-h200-b/decoder-sweep.patch
if git apply "$patch"; then
  bash benchmarks/scripts/gpu_tests.sh decoder tests/test_fixed_rate.py tests/test_paging_fixed.py
  timeout 600 python3 benchmarks/scripts/fixed_rate_bench.py --rows-only > $OUT/decoder-sweep.log 2>&1
  git apply -R "$patch"
fi; pack
# Plain vLLM against the compressed GPU tiers with 256 requests of 4K in flight on an emulated 48 GB card, where
# vLLM keeps about 15 requests' KV (the model's docstring in esftctl/bench/synthetic_model.py): generating the
# base 2-3 minutes, the Huffman store 3-4 (before compressed's first slice), a slice 4-9 minutes.
bash benchmarks/scripts/paging_e2e_gpu.sh qwen3-30b-a3b --regimes memory-bound --servers vllm,fixed,compressed \
  --budget 960 > $OUT/pe2e-qwen3.log 2>&1; pack
echo all done
