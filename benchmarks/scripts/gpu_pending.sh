#!/usr/bin/env bash
# The GPU work that awaits (rewritten 2026-11-26, fourth session, for the next one). A plain call gets an H100 now,
# counting half or two thirds of its held time: about two machines a session of about 22 minutes' work each. This
# is the first, carried with .world (the serving tests need it):
#   1. issue 28's serving exactness with CUDA graphs on both sides after 0aca4cd changed the pager's start-up order
#      (the tier built as the layers page out): every paged mode at once on DeepSeek-V2 and Qwen2-MoE, the
#      fixed-rate tier on DeepSeek-V2 and Qwen3-MoE, the Huffman store tier; and the start-up order test's CUDA
#      cases (its store case's spy changed after its last GPU run); about 13 minutes;
#   2. the fused mark-and-fetch launch (issue 28, the machinery's last percent at batch 1; off unless
#      ESFTCTL_FUSED_FETCH=1), its patch applied in a copy of the tree installed from there (a device call copies
#      the working tree again and takes a patch's new files away mid-run): its tests and the micro-measure
#      (inactive_26_layers_*_us_per_layer in row_fetch.log); about 3 minutes.
# The second machine: issue 29's protocol grid (benchmarks/serve-bench/README.md, `--budget` what is left), or
# DeepSeek-V2-Lite's regimes in slices-h100/ (benchmarks/paging-e2e/README.md).
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
bash benchmarks/scripts/gpu_tests.sh order tests/test_paging.py -k "give_theirs and cuda"; pack
bash benchmarks/scripts/gpu_tests.sh paged_graphs tests/test_serve.py -k "paging_with_cuda_graphs or \
fixed_rate_tier_served_exactly or store_tier_served_exactly"; pack
rm -rf /tmp/fetch && cp -r . /tmp/fetch
(cd /tmp/fetch && git apply benchmarks/2026-11-26-h200-b/fused-fetch.patch &&  # esftctl from the copy now (last)
 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/fetch_install.log 2>&1 &&
 bash benchmarks/scripts/gpu_tests.sh fused_fetch tests/test_row_fetch.py tests/test_paging.py;
 timeout 300 python3 benchmarks/scripts/row_fetch_bench.py > $OUT/row_fetch.log 2>&1); pack
echo all done
