#!/usr/bin/env bash
# `esftctl bench serve --model deepseek-v2-lite` (issue 29) on the device machine, in slices that resume across
# sessions (esftctl/bench/serve_slices.py), after ../shared/gpu/README.md's install put vLLM's CUDA build in
# /tmp/site. Slices already in benchmarks/serve-bench/slices (committed from earlier sessions) are copied in and
# skipped; at the end collect.sh packs the slices this machine wrote (slices-new.tgz), the grid's report
# (reports.tgz: serve-GRID-DEVICE.json and .png) and the servers' logs into $OUT (tarballs: $OUT brings back at
# most 8 files, 2 folders down; slices are 5 down). Commit the new slices with
#   tar -xzf slices-new.tgz -C benchmarks/serve-bench/
# and the next session resumes after them; `esftctl bench serve --report --out benchmarks/serve-bench OPTIONS`
# rebuilds the report without a GPU. A slice that failed is committed too (its error is in the report): delete
# its file to run it again.
#
# Budget: --budget SECONDS is the time this run may spend on slices: a slice starts only if its estimate (its
# server's measured start-up unless the server is up already, plus the part's own seconds as measured, else the
# defaults in serve_slices.py) fits what is left, plus 120 s to generate the base first on a fresh machine and
# 90 s to write the adapters; one that does not fit is passed over for later ones that do. Give it what the
# machine has left: the session's device time (status: budget_left_s; a one-GPU machine may count half its held
# time) and at most 30 minutes held a machine, less about 3 minutes (the start, the install, the transfers):
# gpu_pending.sh says more. Run it in the background, always on the same
# card (slices of another card go to a grid of their own; the protocol grid began on an H200):
#   bash benchmarks/lab/background.sh start serve bash benchmarks/lab/serve_bench_gpu.sh --budget 1200 ...
#   bash benchmarks/lab/background.sh wait serve 540; bash benchmarks/lab/collect.sh
#     (again within 30 s, until it says finished; collect.sh in the same call every time: the job's own collect at
#     its end writes into the $OUT of the call that started it, which brings nothing back; 2026-12-06)
# Slices (H100, deepseek-v2-lite): a server's start with CUDA graphs 2.5-3.5 min (two merged copies 4-5 min and
# the 31 GB copy written first), then a part's warm-up (about 17 s) and runs (about 61 s each at a finite rate of
# 60 s); one slice per server and adapter count (--slice-by adapters), the counts of one round on one start.
# Usage: bash benchmarks/lab/serve_bench_gpu.sh [esftctl bench serve options]   (slices in /tmp/bench/out)
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out=/tmp/bench/out
mkdir -p "$out" /tmp/bench/scratch
if [ -d benchmarks/serve-bench/slices ]; then cp -rn benchmarks/serve-bench/slices "$out/"; fi
[ -f /tmp/bench/slices.stamp ] || touch /tmp/bench/slices.stamp  # slices newer than this: this machine's
df -B1G / /tmp /dev/shm; free -g; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$(df -B1G --output=avail /dev/shm | tail -1)" -ge 40 ]; then work=/dev/shm/bench; else work=/tmp/bench/work; fi
echo "base in $work"
python3 -m esftctl.cli bench serve --model deepseek-v2-lite --work "$work" --scratch /tmp/bench/scratch \
  --out "$out" "$@"
rc=$?
bash benchmarks/lab/collect.sh
exit $rc
