#!/usr/bin/env bash
# The GPU checks that code on main awaits (written 2026-11-25, fourth session), most important first, about 28
# minutes in all on an H100; run it in the background and follow it at once (the machine goes back 30 s after a
# call returns, background job or not):
#   bash benchmarks/scripts/background.sh start pending bash benchmarks/scripts/gpu_pending.sh
#   bash benchmarks/scripts/background.sh wait pending 540      (again until it says finished)
# Needs ../shared/gpu/README.md's install with benchmarks/scripts/payload_quantized.sh's wheels (FP8), and the
# tiny world carried in .world. Every step leaves its log in /tmp/bgout and the whole of it packed in
# /tmp/bgout.tgz (the device brings back only a few files: copy that one to $OUT).
set -u
export OUT=/tmp/bgout PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 ESFTCTL_WORLD=$PWD/.world PYTHONUNBUFFERED=1
mkdir -p $OUT
t=benchmarks/scripts/gpu_tests.sh
pack() { tar -czf /tmp/bgout.tgz -C /tmp bgout 2>/dev/null; }
# Kernels and the fixed-rate tier (1-2 min): its masked row kernel has run only in Triton's interpreter.
bash $t kernels tests/test_fixed_rate.py tests/test_paging_fixed.py tests/test_paging.py tests/test_vllm_triton_moe.py \
  tests/test_row_fetch.py; pack
# Serving with one set of CUDA graphs, unchanged token adapters not rewritten and the kernel's path by the base's
# E (about 9 min, two architectures): issue 29.
bash $t graphs tests/test_serve.py -k test_cuda_graphs_served_exactly; pack
# The paging bench with the fixed column (about 2 min): issue 28.
python3 -m esftctl.cli bench paging --out $OUT/paging --layers 8 --batches 1,4,32,256 2>&1 | tail -30 \
  > $OUT/bench_paging.log; pack
# FP8 bases served exactly against plain vLLM's FP8 model, eager and CUDA graphs (about 8 min): issue 31.
bash $t fp8 tests/test_serve_fp8.py; pack
# GPT-OSS served with adapters (about 3 min): served exactly on the CPU build only so far; issue 31.
bash $t gptoss tests/test_serve.py -k "other_architecture and gpt_oss"; pack
# The step profile after the kernel-path fix, against plain vLLM (about 5 min): issue 29.
python3 benchmarks/scripts/profile_step.py --out $OUT/profile --passes esft-graphs,plain-graphs --budget 150 \
  > $OUT/profile.log 2>&1; rm -f $OUT/profile/*.json.gz; pack
echo all done
