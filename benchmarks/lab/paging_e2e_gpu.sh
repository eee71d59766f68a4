#!/usr/bin/env bash
# Issue 28 item 4 on the device machine: `esftctl bench paging --serve` (esftctl.bench.serve_paging) in slices that
# each fit one call, after ../shared/gpu/README.md's install put vLLM's CUDA build in /tmp/site.
# Slices already in benchmarks/paging-e2e/slices (committed from earlier sessions, H200; PE2E_SLICES names another
# folder: slices-h100 on an H100) are copied in and skipped; the slices run now (slices-MODEL.tgz: `tar -xzf
# slices-MODEL.tgz -C benchmarks/paging-e2e/`), the merged report (paging_serve.json, .png) and the servers' logs go
# to $OUT; commit the slices so that the next session resumes.
# The generated base goes to /dev/shm (host memory, 125 GB: DeepSeek-V2-Lite 31 GB, the Qwen3-30B-A3B-shaped 32
# layers 41 GB; the host tier pins 29 / 39 GB more); the disk (64 GB) takes its Huffman store (20 / 26 GB: with it
# in /dev/shm too the machinery-store server died at start-up), the adapters (4 DeepSeek-sized, 7 GB) and vLLM's
# result files. One model per machine at a time: the other's files are removed first. After a run the host's
# memory and the kernel's last messages (an OOM kill leaves no Python traceback) go to the log.
# Usage: bash benchmarks/lab/paging_e2e_gpu.sh MODEL [esftctl bench paging --serve options, e.g. --budget 540]
#   MODEL: deepseek-v2-lite or qwen3-30b-a3b
# Estimates (H100, DeepSeek-V2-Lite; the Qwen3 shape about 1.3x): generating the base 1.5 min, its store 2-3 min
# (first slice with a store only); a slice (one server, one round, start with CUDA graphs 2-2.5 min included):
# memory-bound 4 min (vllm, resident) to 9 min (host), spare 3-5.5 min, machinery 3 min. A whole round: memory-
# bound 9 servers ~50 min, spare 5 ~20 min, machinery 3 ~9 min; 3 rounds of both models ~8 h of device time.
set -uo pipefail
model=${1:?usage: paging_e2e_gpu.sh MODEL [options]}; shift
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out=/tmp/pe2e/out work=/dev/shm/pe2e-$model
mkdir -p "$out" /tmp/pe2e/scratch
for other in /dev/shm/pe2e-*; do [ -e "$other" ] && [ "$other" != "$work" ] && rm -rf "$other" /tmp/pe2e/scratch/*; done
slices=${PE2E_SLICES:-benchmarks/paging-e2e/slices}  # rounds of one kind of card: slices/ H200, slices-h100/ H100
[ -d "$slices" ] && mkdir -p "$out/slices" && cp -rn "$slices/." "$out/slices/"
df -B1G / /dev/shm | tail -2; free -g | head -2; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m esftctl.cli bench paging --serve --model "$model" --work "$work" --scratch /tmp/pe2e/scratch --out "$out" "$@"
rc=$?
free -g | head -2; dmesg 2>/dev/null | grep -iE "out of memory|killed process" | tail -3
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/slices-$model.tgz" -C "$out" slices 2>/dev/null  # $OUT brings back files 2 folders down at most
  cp "$out"/paging_serve.* "$OUT/" 2>/dev/null
  tar -czf "$OUT/logs-$model.tgz" "$work/state" 2>/dev/null
fi
exit $rc
