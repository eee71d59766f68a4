#!/usr/bin/env bash
# Copy a device run of serve_bench_gpu.sh (or gpu_cards.sh: one output folder per card) to $OUT (the files that
# come back: at most 8, 2 folders down, so tarballs): slices-new.tgz (the slices this machine wrote, paths from
# slices/: untar into benchmarks/serve-bench/), reports.tgz (serve-GRID-DEVICE.json and .png), logs.tgz (the
# servers' logs, the cards' logs) and vllm-results.tgz (vLLM's own result files). Safe to run while the bench
# still runs: it packs the slices written so far (each appears whole).
out=${OUT:-/tmp}
folders=$(ls -d /tmp/bench/out /tmp/bench/out-* 2>/dev/null)
if [ -f /tmp/bench/slices.stamp ]; then
  args=()
  for dir in $folders; do
    [ -d "$dir/slices" ] || continue
    mapfile -t new < <(cd "$dir" && find slices -name '*.json' -newer /tmp/bench/slices.stamp)
    [ "${#new[@]}" -gt 0 ] && args+=(-C "$dir" "${new[@]}")
  done
  tar -czf "$out/slices-new.tgz" "${args[@]}" --files-from /dev/null
  echo "new slices: $(tar -tzf "$out/slices-new.tgz" | grep -c '\.json$')"
fi
(cd /tmp/bench/out 2>/dev/null && ls serve-*.json serve-*.png 2>/dev/null | tar -czf "$out/reports.tgz" -T -)
tar -czf "$out/logs.tgz" $(ls -d /dev/shm/bench/state /dev/shm/bench-*/state /tmp/bench/work/state \
  /tmp/bench/work-*/state /tmp/bench/*.log 2>/dev/null) 2>/dev/null
results=$(for dir in $folders; do [ -d "$dir/vllm-results" ] && echo "${dir#/tmp/bench/}/vllm-results"; done)
[ -n "$results" ] && tar -czf "$out/vllm-results.tgz" -C /tmp/bench $results 2>/dev/null
ls -la "$out"
