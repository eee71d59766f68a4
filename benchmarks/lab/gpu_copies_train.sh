#!/usr/bin/env bash
# Issues 85 and 86 on the GPU machine, in priority order, each part's results written as it ends (so a machine that
# goes back mid-run still returns what finished):
#   1. the per-request copies served exactly on CUDA: variants in one step (DeepSeek-V2's, MLA's kv_b_proj included,
#      and Qwen2-MoE's), non-expert modules of both with CUDA graphs;
#   2. `esftctl bench consolidate --serve-only`: three variants in one step against one plain vLLM server per variant
#      (SETUPS: add `consolidated` for the per-step server), every request at once (throughput);
#   3. `esftctl bench train` on DeepSeek-V2-Lite's shape: ESFT (token, gate) against full fine-tuning and LoRA;
#   4. the same on Qwen3-30B-A3B's shape (QWEN_LAYERS, default 8);
#   5. ESFT alone on the whole 27-layer DeepSeek-V2-Lite shape (its full fine-tune does not fit one card);
#   6. issue 87's tiled fixed-rate expert GEMM: its CUDA tests against vLLM's kernel, then its bench (both GEMMs of
#      one layer, 1 / 32 / 256 tokens, against vLLM's kernel and the tier's decode-then-GEMM);
#   6s. the same bench with the fused kernel's configuration sweep (SWEEP_GRID; 24 configs a row by default);
#   7. issue 87 item 2: a layer's rows from the host as the fixed-rate code against bf16 (effective rate);
#   8a, 8b. issue 87 item 1: paging with adapter rows kept on the device, on CUDA: 8a the pager's and the runtime's
#      paging tests with the driver's aliases (no server, a minute or two), 8b DeepSeek-V2 served paged with CUDA
#      graphs (about 300 s);
#   9. issue 87 item 3's CuTe DSL design: its CUDA tests against vLLM's kernel, then the GEMM bench (its `cute`
#      column beside the Triton design's). Needs benchmarks/lab/cute_payload.sh's install in /tmp/cute-site.
# Results in /tmp/res (pass it to background.sh wait). Carry .world (the tiny world) with the install's last part.
#   bash benchmarks/lab/background.sh start ct "bash benchmarks/lab/gpu_copies_train.sh"
#   bash benchmarks/lab/background.sh wait ct 540 /tmp/res   (again until it prints "finished")
# PARTS: which parts to run (default "1 2 3"; TESTS: part 1's test ids); TRAIN_LAYERS: the train bench's layers (default 10: full fine-tuning
# of DeepSeek-V2-Lite's first 10 layers with bf16 AdamW is about 47 GB of weights and state).
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 ESFTCTL_WORLD=$PWD/.world PYTHONUNBUFFERED=1
res=/tmp/res
mkdir -p "$res"
for part in ${PARTS:-1 2 3}; do
  t0=$(date +%s)
  case $part in
    1) OUT=$res DEADLINE=${TESTS_DEADLINE:-660} bash benchmarks/lab/gpu_tests.sh copies ${TESTS:-\
         'tests/test_serve_variants.py::test_one_step_mla_variants_served_exactly' \
         'tests/test_serve_variants.py::test_one_step_variants_served_exactly' \
         'tests/test_serve_module_copies.py::test_module_adapter_with_cuda_graphs_served_exactly'} ;;
    2) python3 -m esftctl.cli bench consolidate --serve-only --setups ${SETUPS:-one-step,own} --rate inf \
         --requests 480 --out "$res/consolidate" ;;
    3) python3 -m esftctl.cli bench train --model deepseek-v2-lite --layers "${TRAIN_LAYERS:-10}" \
         --out "$res/train-dsv2" --work /tmp ;;
    4) python3 -m esftctl.cli bench train --model qwen3-30b-a3b --layers "${QWEN_LAYERS:-8}" \
         --out "$res/train-qwen3" --work /tmp ;;
    5) python3 -m esftctl.cli bench train --model deepseek-v2-lite --layers 27 --methods esft-token,esft-gate \
         --out "$res/train-dsv2-whole" --work /tmp ;;
    6) OUT=$res DEADLINE=${TESTS_DEADLINE:-300} bash benchmarks/lab/gpu_tests.sh kernel tests/test_fixed_rate_moe.py
       OUT=$res python3 benchmarks/lab/fixed_rate_moe_bench.py 2>&1 | tee "$res/fixed_rate_moe_bench.log" ;;
    6s) mkdir -p "$res/sweep" && OUT=$res/sweep python3 benchmarks/lab/fixed_rate_moe_bench.py --sweep \
         --sweep-grid "${SWEEP_GRID:-M=16,32,64 N=64,128 K=64,128 warps=4 stages=2,3}" 2>&1 \
         | tee "$res/fixed_rate_moe_sweep.log" ;;
    7) OUT=$res python3 benchmarks/lab/host_codes_bench.py 2>&1 | tee "$res/host_codes.log" ;;
    8a) OUT=$res DEADLINE=${TESTS_DEADLINE:-300} bash benchmarks/lab/gpu_tests.sh paging tests/test_runtime_paging.py \
         tests/test_runtime_paging_fixed.py tests/test_kernel_row_fetch.py 'tests/test_runtime_vllm_model.py' \
         -k 'pag or tier or cuda or fetch or zero_copy or decode' ;;
    8b) OUT=$res DEADLINE=${TESTS_DEADLINE:-420} bash benchmarks/lab/gpu_tests.sh paging-served \
         'tests/test_serve_adapters.py::test_paging_with_cuda_graphs_served_exactly[deepseek_v2]' ;;
    9) OUT=$res DEADLINE=${TESTS_DEADLINE:-300} bash benchmarks/lab/gpu_tests.sh cute tests/test_fixed_rate_moe_cute.py
       OUT=$res PYTHONPATH=/tmp/site:/tmp/cute-site python3 benchmarks/lab/fixed_rate_moe_bench.py 2>&1 \
         | tee "$res/fixed_rate_moe_cute_bench.log" ;;
  esac
  echo "part $part: exit $? in $(( $(date +%s) - t0 )) s" | tee -a "$res/parts.log"
done
