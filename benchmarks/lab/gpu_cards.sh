#!/usr/bin/env bash
# Issue 29's grid on a machine of several GPUs (nvidia-h100-x2 or -x4): one `esftctl bench serve` per card, each
# with its own rounds (--only-rounds), base, adapters and output folder, so that each card runs plain vLLM's base
# first and pairs its own rounds with it (ratios stay within one card: esftctl/bench/serve_slices.py). Why: a
# machine of several GPUs counts its held time in full, and one of one GPU counted 50-67% of it in 2026-11-27's
# eleventh session but all of it in the twelfth: k cards run the grid up to k times as fast per second of device
# time as one. What it does not give: the cards share a host
# (CPU, memory, PCIe), and a card's neighbours are busy while it measures; compare a round run here with one run
# alone before trusting a 3% difference.
# Usage: ROUNDS="1 2" BUDGET=1500 SERVERS=base,esftctl [BEFORE_1="..."] [AFTER="..."] \
#          bash benchmarks/lab/gpu_cards.sh
#   ROUNDS: one entry per card, each the --only-rounds of that card (e.g. "1 2 0 1"; a comma list gives a card
#   several rounds). Run it in the background and collect as gpu_pending.sh says (collect.sh packs every card's
#   slices and logs); the grid's options are grid_args.sh's, as gpu_pending.sh's are.
#   SERVERS_k: card k's servers instead of SERVERS (e.g. SERVERS_2=base,lora ROUNDS="1 2 0": card 2 runs
#   multi-LoRA's round 0 after a base round of its own). Each card runs the base's round on itself before that
#   round's other slices: the base's slice of the round where it is missing, else the round once more under a name
#   of its card's (on-<hash>.rN.json), so no two cards write the same copy. Two cards may share a round only where
#   this kind of card has the base's slices of it already (round 0's include the base's microbenchmarks): each card
#   first takes the base's missing slices among its rounds' (on a kind with none yet, give every card its own round).
#   BEFORE_k: a command card k runs before its bench, on that card alone, with OUT=/tmp/bench (e.g. the kernel tests
#   of code the bench has not run on a GPU yet, while the other card generates its base: the bench then starts
#   later and its budget should leave room for it); its output in /tmp/bench/before-k.log.
#   AFTER: a command the first card to finish its bench runs next, on that card alone, with OUT=/tmp/bench (e.g.
#   AFTER="bash benchmarks/lab/gpu_tests.sh kernels tests/test_kernel_row_checksum.py": GPU tests in the time the other
#   card still measures, a busier neighbour for it: prefer kernel tests to vLLM servers; its output in
#   /tmp/bench/after.log, which collect.sh packs with the logs).
# Needs ../shared/gpu/README.md's install.
set -u
source benchmarks/lab/grid_args.sh
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
read -r -a rounds <<< "${ROUNDS:?ROUNDS: one --only-rounds per card, e.g. ROUNDS=\"1 2\"}"
cards=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
if [ "${#rounds[@]}" -gt "$cards" ]; then echo "ROUNDS names ${#rounds[@]} cards, this machine has $cards"; exit 2; fi
mkdir -p /tmp/bench && [ -f /tmp/bench/slices.stamp ] || touch /tmp/bench/slices.stamp
df -B1G /dev/shm /tmp; free -g; nvidia-smi --query-gpu=index,name,uuid --format=csv,noheader
pids=() shm_left=$(df -B1G --output=avail /dev/shm | tail -1)
for card in "${!rounds[@]}"; do
  servers="SERVERS_$card"
  servers=${!servers:-${SERVERS:-base,esftctl}}
  need=40  # GB a card writes: the base (31) and its adapters; a merged model is one more
  [[ ",$servers," == *,merged,* ]] && need=75
  out=/tmp/bench/out-$card work=/dev/shm/bench-$card
  if [ "$shm_left" -ge "$need" ]; then shm_left=$(( shm_left - need )); else work=/tmp/bench/work-$card; fi
  mkdir -p "$out" "/tmp/bench/scratch-$card"
  [ -d benchmarks/serve-bench/slices ] && cp -rnp benchmarks/serve-bench/slices "$out/"  # -p: older than the stamp
  before="BEFORE_$card"
  (
    if [ -n "${!before:-}" ]; then  # this card's command first (its bench starts after it)
      echo "card $card: ${!before}" > "/tmp/bench/before-$card.log"
      CUDA_VISIBLE_DEVICES=$card OUT=/tmp/bench bash -c "${!before}" >> "/tmp/bench/before-$card.log" 2>&1
    fi
    CUDA_VISIBLE_DEVICES=$card python3 -m esftctl.cli bench serve --model deepseek-v2-lite --work "$work" \
      --scratch "/tmp/bench/scratch-$card" --out "$out" --budget "${BUDGET:-1500}" "${GRID_ARGS[@]}" \
      --servers "$servers" --only-rounds "${rounds[$card]}" \
      > "/tmp/bench/card-$card.log" 2>&1
    if [ -n "${AFTER:-}" ] && mkdir /tmp/bench/after.claimed 2>/dev/null; then  # the first card done runs it
      echo "card $card: $AFTER" > /tmp/bench/after.log
      CUDA_VISIBLE_DEVICES=$card OUT=/tmp/bench bash -c "$AFTER" >> /tmp/bench/after.log 2>&1
    fi
  ) &
  pids+=($!)
  echo "card $card: $servers, rounds ${rounds[$card]}, work $work, log /tmp/bench/card-$card.log"
done
for pid in "${pids[@]}"; do wait "$pid"; done
tail -n 3 /tmp/bench/card-*.log
bash benchmarks/lab/collect.sh
