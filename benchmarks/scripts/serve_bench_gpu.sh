#!/usr/bin/env bash
# `esftctl bench serve --model deepseek-v2-lite` on the device machine, after ../shared/gpu/README.md's install
# put vLLM's CUDA build in /tmp/site. Run it under background.sh (it takes longer than one call may).
# The generated base (31 GB) goes to /dev/shm when that has room (host memory), else to the disk; bundles,
# the merged copy and LoRA adapters go to the disk, so a cold adapter load really reads the disk.
# Usage: bash benchmarks/scripts/serve_bench_gpu.sh [esftctl bench serve options]   (results in /tmp/bench/out)
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
df -B1G / /tmp /dev/shm; free -g; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$(df -B1G --output=avail /dev/shm | tail -1)" -ge 40 ]; then work=/dev/shm/bench; else work=/tmp/bench/work; fi
echo "base in $work"
python3 -m esftctl.cli bench serve --model deepseek-v2-lite --work "$work" --scratch /tmp/bench/scratch \
  --out /tmp/bench/out "$@"
