#!/usr/bin/env bash
# The GPU work that code on main awaits (rewritten 2026-11-26), most important first, about 28 minutes on an H200 (the last step takes what is left);
# run it in the background and follow it at once (the machine goes back 30 s after a call returns, background job
# or not):
#   bash benchmarks/scripts/background.sh start pending bash benchmarks/scripts/gpu_pending.sh
#   bash benchmarks/scripts/background.sh wait pending 540; cp /tmp/bgout.tgz $OUT/     (again until finished)
# Needs ../shared/gpu/README.md's install (with benchmarks/scripts/payload_quantized.sh's wheels) and the tiny
# world carried in .world. Every step leaves its log in /tmp/bgout, all of it packed in /tmp/bgout.tgz after each
# step (the device brings back only a few files).
set -u
export OUT=/tmp/bgout PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 ESFTCTL_WORLD=$PWD/.world PYTHONUNBUFFERED=1
mkdir -p $OUT
pack() { (cd /tmp && tar -czf /tmp/bgout.tgz bgout $(ls -d pe2e/out/slices bench/out/slices 2>/dev/null)) 2>/dev/null; }
# The fixed-rate row decoder with several blocks a program (1 min), its steps x warps sweep (2 min) and the paging
# bench's fixed column again (2 min): issue 28.
bash benchmarks/scripts/gpu_tests.sh kernels tests/test_fixed_rate.py tests/test_paging_fixed.py; pack
python3 benchmarks/scripts/fixed_rate_bench.py > $OUT/fixed_rate_bench.log 2>&1; pack
python3 -m esftctl.cli bench paging --out $OUT/paging --layers 8 --batches 1,4,32,256 2>&1 | tail -30 \
  > $OUT/bench_paging.log; pack
# FluxMoE's machinery regime end to end (issue 28 item 4): the base (1.5 min), then resident, machinery and
# machinery-store with the spare regime's traffic (about 3 min each).
bash benchmarks/scripts/paging_e2e_gpu.sh deepseek-v2-lite --regimes machinery --budget 660 > $OUT/pe2e.log 2>&1
pack; rm -rf /dev/shm/pe2e-*
# ExpertWeave's protocol grid at low load (issue 29), the first slices in what time is left.
bash benchmarks/scripts/serve_bench_gpu.sh --budget 600 --adapter-shape deepseek --adapters 0,1,5,10,20 \
  --rates 1,2,5 --alphas 1 --duration 60 --repeats 3 --servers base,merged,esftctl,lora > $OUT/serve.log 2>&1; pack
echo all done
