#!/usr/bin/env bash
# The GPU work that awaits (written 2026-11-26, eighth session, for the next one). Issue 28's GPU work is done
# (RESULTS.md: "Issue 28 as it stands"); what is left is issue 29's protocol grid (benchmarks/serve-bench/README.md),
# 0 of its 34 slices so far (count 0 left out: that README says why; the two H100 slices of 2026-11-27's tenth
# session ran with vLLM's prefix cache on, which flattered the base, and belong to an older grid key). This starts
# it: the README's first command, with a machine's budget. Each machine runs plain vLLM's base first (2026-11-27: ratios are taken within one
# machine; the README says why), so a machine's first 7 minutes or so go to the base. Carry nothing beyond the install's three folders (the bench generates its base and
# adapters on the device).
# A plain call may get an H100 counting 50-67% of its held time, or a machine counting in full (the lease says
# which: its key "counts" is there only while a machine counts part): --budget is what the machine has left, at
# most 30 minutes held less about 6 (start, install, transfers, the last collect), and no more than budget_left_s
# when it counts in full.
# Run it in the background and follow it at once: the machine goes back 30 s after a call returns, background job
# or not, and it may be taken back mid-run, so each wait packs what is written so far:
#   bash benchmarks/scripts/background.sh start pending "BUDGET=1200 bash benchmarks/scripts/gpu_pending.sh"
#   bash benchmarks/scripts/background.sh wait pending 540; bash benchmarks/scripts/collect.sh   (again until done)
# Never set OUT in the calling command: collect.sh copies into the call's own $OUT. Then untar slices-new.tgz
# into benchmarks/serve-bench/ and commit it (the next machine skips those slices).
# background.sh joins its arguments into one shell line: pass a compound command as one quoted argument, not
# through `bash -c '...'` (which then runs an empty bash).
# Needs ../shared/gpu/README.md's install.
# SERVERS (2026-11-27, tenth session): the servers this machine measures, base and esftctl unless set. A machine
# runs two or three slices, and the low-load target (5 to 20 adapters within 3% of the base) needs those two on
# one machine; merged and multi-LoRA are the same grid's (the servers are not part of its key) and come after:
# SERVERS=base,merged,esftctl,lora.
set -u
bash benchmarks/scripts/serve_bench_gpu.sh --budget "${BUDGET:-1200}" --adapter-shape deepseek \
  --adapters 1,5,10,20 --rates 1,2,5 --alphas 1 --duration 60 --repeats 3 --servers "${SERVERS:-base,esftctl}"
echo all done
