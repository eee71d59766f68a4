#!/usr/bin/env bash
# The GPU work that awaits: issue 29's protocol grid (benchmarks/serve-bench/README.md), the README's first
# command with one machine's budget. A machine runs plain vLLM's base on a round before that round's other slices
# (ratios are taken within one machine and one round's traffic; rounds whose base slice is missing go first, where
# the base runs anyway), about 6 minutes; then each server's round, its adapter counts on one
# server start (since 2026-11-27's eleventh session: about 210 s of start-up, then about 200 s per count), each
# count's slice written as it ends. Carry nothing beyond the install's three folders (the bench generates its base
# and adapters on the device).
# BUDGET: seconds of slices this machine may start. A machine goes back at 30 minutes held (and one counting its
# held time in full spends a session's 1,800 s with it), less about 3 for the start, install and transfers; a
# slice cut off when the machine goes back is lost alone (the ones before it came back with the last collect), so
# the budget may run to the machine's end, with the last wait returning before it.
# What a BUDGET buys on a machine that has written no slice (estimates: esftctl/bench/serve_slices.py's START_S and
# the slices' own seconds): its base round about 435 s, then esftctl's first count with the server's start and the
# adapters' writing about 585 s, each further count about 255 s; so 1,020 s for the base and one count, 1,530 for
# three. A count that does not fit is passed over and the rest of the budget goes to more base rounds and the
# base's microbenchmarks (2026-11-29: BUDGET=900 gave base r0, micro and r1, no esftctl; 2026-12-04, after 85 s of
# GPU tests: BUDGET=1400 gave base r0 in 396 s and esftctl's 20, 10 and 5 adapters in 441, 198 and 198 s, and the
# machine had 420 s left, so 1,550 fits one more count). Run nothing else on the
# GPU until it prints "all done" (gpu_tests.sh refuses to).
# Run it in the background and follow it at once: the machine goes back 30 s after a call returns, background job
# or not, so each wait packs what is written so far:
#   bash benchmarks/lab/background.sh start pending "BUDGET=1600 bash benchmarks/lab/gpu_pending.sh"
#   bash benchmarks/lab/background.sh wait pending 540; bash benchmarks/lab/collect.sh   (again until done)
# Never set OUT in the calling command: collect.sh copies into the call's own $OUT. Then untar slices-new.tgz
# into benchmarks/serve-bench/ and commit it (the next machine skips those slices).
# background.sh joins its arguments into one shell line: pass a compound command as one quoted argument, not
# through `bash -c '...'` (which then runs an empty bash).
# Needs ../shared/gpu/README.md's install (its payload re-split by benchmarks/lab/payload_split.sh).
# SERVERS: the servers this machine measures, base and esftctl unless set (the low-load target, 5 to 20 adapters
# within 3% of the base, needs those two on one machine); merged copies and multi-LoRA are the same grid's (the
# servers are not part of its key) and come after: SERVERS=base,merged,esftctl,lora.
set -u
source benchmarks/lab/grid_args.sh
bash benchmarks/lab/serve_bench_gpu.sh --budget "${BUDGET:-1600}" "${GRID_ARGS[@]}" \
  --servers "${SERVERS:-base,esftctl}"
echo all done
