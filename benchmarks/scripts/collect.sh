#!/usr/bin/env bash
# Copy a device run of serve_bench_gpu.sh to $OUT (the files that come back: at most 8, 2 folders down, so
# tarballs): slices-new.tgz (the slices this machine wrote, paths from slices/: untar into benchmarks/serve-bench/),
# reports.tgz (serve-GRID-DEVICE.json and .png), logs.tgz (the servers' logs) and vllm-results.tgz (vLLM's own
# result files). Safe to run while the bench still runs: it packs the slices written so far (each appears whole).
out=${OUT:-/tmp}
bench=/tmp/bench/out
if [ -f /tmp/bench/slices.stamp ] && [ -d "$bench/slices" ]; then
  (cd "$bench" && find slices -name '*.json' -newer /tmp/bench/slices.stamp | tar -czf "$out/slices-new.tgz" -T -)
  echo "new slices: $(tar -tzf "$out/slices-new.tgz" | grep -c '\.json$')"
fi
(cd "$bench" 2>/dev/null && ls serve-*.json serve-*.png 2>/dev/null | tar -czf "$out/reports.tgz" -T -)
tar -czf "$out/logs.tgz" $(ls -d /dev/shm/bench/state /tmp/bench/work/state 2>/dev/null) 2>/dev/null
[ -d "$bench/vllm-results" ] && tar -czf "$out/vllm-results.tgz" -C "$bench" vllm-results 2>/dev/null
ls -la "$out"
